"""The one rule that tells a write which failed for lack of space from a bug, whatever library
reported it (``disk_full_errno``)."""

import errno

import pytest

from embed_core.errors import disk_full_errno, user_error


class LibraryError(Exception):
    """A library's own exception type (safetensors' SafetensorError is one)."""


@pytest.mark.parametrize("exc, expected", [
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), errno.EDQUOT),
    (LibraryError("Error while serializing: I/O error: No space left on device (os error 28)"), errno.ENOSPC),
    (LibraryError("I/O error: File too large (os error 27)"), errno.EFBIG),
    (OSError(errno.EACCES, "Permission denied"), None),
    (LibraryError("I/O error: Permission denied (os error 13)"), None),
    (RuntimeError("unexpected pos 576 vs 534"), None),
])
def test_a_full_disk_is_recognised_from_its_errno_or_a_librarys_message(exc, expected):
    assert disk_full_errno(exc) == expected


def test_an_error_raised_from_a_full_disk_is_a_full_disk_and_one_line():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("saving failed") from exc
    except RuntimeError as exc:
        assert disk_full_errno(exc) == errno.ENOSPC
        assert user_error(exc).startswith("no space left to write (ENOSPC")


def test_the_exception_chain_visits_each_exception_once_the_cause_before_the_context():
    from embed_core.errors import exception_chain

    cause, context, leaf = ValueError("cause"), KeyError("context"), OSError("leaf")
    top = RuntimeError("top")
    top.__cause__, top.__context__ = cause, context
    cause.__context__ = leaf
    leaf.__context__ = top  # a cycle, as a handler that re-raises can make
    assert [str(e) for e in exception_chain(top)] == ["top", "cause", "leaf", "'context'"]
    assert list(exception_chain(None)) == []

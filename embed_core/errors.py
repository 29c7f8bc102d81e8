"""Error types. Every message names where the problem is: file, row and field."""

from __future__ import annotations

import errno
import re
from typing import Callable, Iterator

MAX_MESSAGE_CHARS = 600


def printable(text: object, limit: int | None = None) -> str:
    """``text`` as one printable line: undecodable bytes (surrogate-escaped) as ``\\xNN``, control
    characters and line breaks escaped, cut to ``limit`` characters. Messages built from user data
    (a binary header, a NUL in a name) then log, print and serialise anywhere, Prefect's API
    included, which refuses lone surrogates."""
    out = []
    for ch in str(text):
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif 0xD800 <= code <= 0xDFFF or (not ch.isprintable() and ch != " "):
            out.append(ch.encode("unicode_escape").decode("ascii") if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    line = "".join(out)
    if limit is not None and len(line) > limit:
        line = line[:limit - 1] + "…"
    return line


class EmbedpipeError(Exception):
    """Base class: the CLI turns these into a one-line reason and exit code 2. The message is
    always one printable line (see :func:`printable`)."""

    def __init__(self, message: object = "", *args: object):
        super().__init__(printable(message, MAX_MESSAGE_CHARS), *args)


class ConfigError(EmbedpipeError):
    """The run config is invalid (unknown key, bad value, missing path)."""


class RowError(EmbedpipeError):
    """One input row is bad. Carries the location so it can be quarantined or reported.

    ``row`` is 1-based and counts physical lines of the file (header included), so it
    matches what an editor shows; for Parquet inputs it is the 0-based row index.
    """

    def __init__(self, file: str, row: int | None, field: str | None, reason: str, message: str):
        self.file = printable(file, 200)
        self.row = row
        self.field = printable(field, 200) if field is not None else None
        self.reason = reason  # short machine-readable tag, used for counts
        self.detail = printable(message, MAX_MESSAGE_CHARS)
        where = self.file
        if row is not None:
            where += f":{row}"
        if self.field is not None:
            where += f": field '{self.field}'"
        super().__init__(f"{where}: {self.detail}")

    def __reduce__(self):  # picklable (errors cross process boundaries, e.g. Prefect's process pool)
        return type(self), (self.file, self.row, self.field, self.reason, self.detail)


class SourceError(RowError):
    """A problem that makes a whole source unreadable (missing file, missing column in the header)."""


class SchemaError(RowError):
    """A record does not match the unified schema."""


class CollectiveError(EmbedpipeError):
    """A collective of a multi-process training failed: it waited longer than
    ``train.dist_timeout_s`` (a rank stalled), or lost the connection to a rank that died. Its
    message names this rank, the stage and the operation (``embed_core.dist.distributed``)."""


class LaunchError(EmbedpipeError):
    """The processes of a multi-process job cannot work as one: the launcher's environment is
    inconsistent, a scheduler started tasks without a launcher, the ranks cannot connect, or they
    do not share the run directory (``embed_core.dist.world``, ``embed_core.dist.distributed``)."""


class CheckpointError(EmbedpipeError):
    """A checkpoint cannot be resumed from (unsafe or damaged state file)."""


# errno values of a write that failed for lack of space (a full disk, a quota, a file-size limit)
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskFullError(EmbedpipeError):
    """A write failed for lack of space; what was committed before is intact."""


# How Rust's std::io::Error shows an errno in a library's message (safetensors: "... I/O error: No
# space left on device (os error 28)"): those libraries raise their own exception type, not OSError.
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and every exception it was raised from (``__cause__``) or while handling
    (``__context__``), each once, depth first with the cause before the context (the order Python
    prints them in, innermost last): the one walk for every question asked of a failure's history."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        todo += [item.__context__, item.__cause__]


def disk_full_errno(exc: BaseException | None) -> int | None:
    """The errno (ENOSPC, EDQUOT, EFBIG) when ``exc``, or an exception it was raised from or while
    handling, is a write that failed for lack of space: an ``OSError`` with that errno, or a
    library's error whose message carries it as Rust formats it (safetensors); else None. The one
    rule every writer uses to tell a full disk from a bug (``artifacts.StageWriter``,
    ``train.checkpoint``, ``user_error``)."""
    for item in exception_chain(exc):
        if isinstance(item, OSError) and item.errno in DISK_FULL_ERRNOS:
            return item.errno
        found = _OS_ERROR_IN_TEXT.search(str(item)[:2000]) if not isinstance(item, OSError) else None
        if found is not None and int(found.group(1)) in DISK_FULL_ERRNOS:
            return int(found.group(1))
    return None


# Set on an interrupt (KeyboardInterrupt, a signal's exception) that left stage writers uncommitted
# (``embed_core.artifacts``): their stage directories, for the command's one line (``flows.interrupts``).
UNCOMMITTED_ATTR = "embedpipe_uncommitted"


# OS errors that come from the user's files or machine (permissions, a full or read-only disk, a
# file where a directory belongs); others (e.g. a vanished file) may be bugs and keep their traceback.
_USER_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EISDIR, errno.ENOTDIR,
                errno.ENAMETOOLONG, errno.EFBIG}


# A MemoryError anywhere (an allocation past the machine's memory or the process's address-space
# limit), or a thread that cannot start for the same reason: the line the CLI prints, exit 2,
# instead of a traceback.
OUT_OF_MEMORY = ("out of memory (MemoryError): this process could not allocate what it needed; free memory or raise "
                 "the process's limit (ulimit -v), lower the batch sizes of the config, or lower a source's "
                 "limits (max_line_bytes, max_field_bytes, max_record_bytes) so an oversized input is quarantined "
                 "first; --debug shows where")


# Recognisers of errors raised by libraries in a form of their own (torch's distributed timeouts):
# each returns the error's one line, or None. A module registers its own where it is imported
# (``register_user_error``), so this module imports none of them.
_RECOGNISERS: list[Callable[[BaseException], str | None]] = []


def register_user_error(recognise: Callable[[BaseException], str | None]) -> None:
    """Make ``user_error`` ask ``recognise`` too (once per function, however often it is registered)."""
    if recognise not in _RECOGNISERS:
        _RECOGNISERS.append(recognise)


class GpuRunError(EmbedpipeError):
    """``make gpu-bundle`` / ``make gpu-run`` cannot go on (a requirement not installed here, pip or
    a step's command failing before it could report)."""


def user_error(exc: BaseException) -> str | None:
    """The one-line message for an error that comes from the user's input or machine, else None
    (a bug, whose traceback matters). The CLI prints it as its one error line; a flow run logs it
    as its one ERROR line and ends in a Failed state with it as the message."""
    if isinstance(exc, EmbedpipeError):
        return str(exc)
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and str(exc) == "can't start new thread"):
        return OUT_OF_MEMORY
    if isinstance(exc, OSError) and exc.filename is not None and exc.errno in _USER_ERRNOS:
        return printable(f"{exc.filename}: {exc.strerror or exc}", 600)
    full = disk_full_errno(exc)
    if full is not None:  # a write outside a stage writer, no file named
        return printable(f"no space left to write ({errno.errorcode.get(full, full)}: {exc}); what was "
                         "committed before is intact: free space on the disk and run again", 600)
    for recognise in _RECOGNISERS:
        line = recognise(exc)
        if line is not None:
            return printable(line, MAX_MESSAGE_CHARS)
    return None


class ReleaseError(EmbedpipeError):
    """The model to release does not prove it is what was trained (``embed_core.evaluate.release``):
    the saved model (or an export) encodes the probe unlike the in-training encoder, or it equals its
    base model."""

"""What the ``embedpipe`` command writes where: stderr carries exactly one line, the error that
ends the command (``--debug`` adds its traceback); everything else — results, progress, warnings,
our logs and Prefect's run logs — goes to stdout. A user-input error is a one-line message in the
console and in the Prefect UI alike: its run logs lose the traceback (``--debug`` keeps it).
"""

from __future__ import annotations

import errno
import logging
import sys
from contextlib import contextmanager
from typing import Iterator, TextIO

from embed_core.errors import DISK_FULL_ERRNOS, EmbedpipeError, printable

# OS errors that come from the user's files or machine (permissions, a full or read-only disk, a
# file where a directory belongs); others (e.g. a vanished file) may be bugs and keep their traceback.
_USER_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EISDIR, errno.ENOTDIR,
                errno.ENAMETOOLONG, errno.EFBIG}

# Where Prefect's engines log a failed run (a logger-level filter: handlers may be set up anew).
_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


def user_error(exc: BaseException) -> str | None:
    """The one-line message for an error that comes from the user's input or machine, else None
    (a bug: its traceback is printed). A Prefect flow re-raises its task's exception unchanged."""
    if isinstance(exc, EmbedpipeError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None and exc.errno in _USER_ERRNOS:
        return printable(f"{exc.filename}: {exc.strerror or exc}", 600)
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:  # a write outside a stage writer, no file named
        return printable(f"no space left to write ({errno.errorcode.get(exc.errno, exc.errno)}: {exc}); what was "
                         "committed before is intact: free space on the disk and run again", 600)
    return None


@contextmanager
def stderr_for_errors_only() -> Iterator[TextIO]:
    """For the block, ``sys.stderr`` is stdout and logging (ours and, set up when prefect is first
    imported, Prefect's console handler) writes to stdout; yields the real stderr, for the error line."""
    error_stream = sys.stderr
    sys.stderr = sys.stdout
    try:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)
        yield error_stream
    finally:
        sys.stderr = error_stream


class _NoTracebackForUserErrors(logging.Filter):
    """Prefect logs a traceback for every failed task and flow run; for a user-input error the
    traceback says nothing the one-line message does not, so the record keeps its message and
    loses the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and user_error(record.exc_info[1]):
            record.exc_info = None
            record.exc_text = None
        return True


@contextmanager
def run_logs_on_stdout(error_stream: TextIO, debug: bool) -> Iterator[None]:
    """Console log handlers (ours, Prefect's) write to stdout for the block and, unless ``debug``,
    run logs drop the tracebacks of user-input errors. Handlers set up before the command swapped
    stderr (a caller that imported prefect first) are re-pointed too, and restored afterwards."""
    quiet = _NoTracebackForUserErrors()
    changed: list[tuple[logging.StreamHandler, object]] = []
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict))]
    handlers = {id(h): h for lg in loggers for h in getattr(lg, "handlers", []) if isinstance(h, logging.StreamHandler)}
    for handler in handlers.values():
        if handler.stream in (error_stream, sys.__stderr__) or getattr(handler.stream, "closed", False):
            changed.append((handler, handler.stream))
            _point(handler, CURRENT_STDOUT)
    if not debug:
        for name in _RUN_LOGGERS:
            logging.getLogger(name).addFilter(quiet)
    try:
        yield
    finally:
        for name in _RUN_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        for handler, stream in changed:  # a handler whose own stream has closed keeps following stdout
            if not getattr(stream, "closed", False):
                _point(handler, stream)


class _CurrentStdout:
    """A stream that writes to whatever ``sys.stdout`` is when it writes: a handler re-pointed
    here never outlives the stdout of the command that re-pointed it (a caller's stdout may be
    replaced and closed after the command, e.g. a test's captured stream)."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()

    def __getattr__(self, name: str):
        return getattr(sys.stdout, name)


CURRENT_STDOUT = _CurrentStdout()


def _point(handler: logging.StreamHandler, stream) -> None:
    handler.stream = stream  # not setStream: it flushes the old stream, which may be closed
    if hasattr(handler, "console"):  # Prefect's rich console handler writes through its Console
        handler.console.file = stream

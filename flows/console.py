"""What the ``embedpipe`` command writes where: stderr carries exactly one line, the error that
ends the command (``--debug`` adds its traceback); everything else — results, progress, warnings,
our logs and Prefect's run logs — goes to stdout. A user-input error is a one-line message in the
console and in the Prefect UI alike (``flows.failures``).
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Iterator, TextIO


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


@contextmanager
def run_logs_on_stdout(error_stream: TextIO) -> Iterator[None]:
    """Console log handlers (ours, Prefect's) write to stdout for the block. Handlers set up before
    the command swapped stderr (a caller that imported prefect first) are re-pointed too, and
    restored afterwards: Prefect's console handler whatever stream it holds (it may hold a stderr
    that was replaced since, which is neither ``error_stream`` nor ``sys.__stderr__``), any other
    handler on the stderr. (A user-input error is one line in the run logs: ``flows.failures``.)"""
    changed: list[tuple[logging.StreamHandler, object]] = []
    for handler in stream_handlers():
        prefects = hasattr(handler, "console")
        if prefects or handler.stream in (error_stream, sys.__stderr__) or getattr(handler.stream, "closed", False):
            changed.append((handler, handler.stream))
            _point(handler, CURRENT_STDOUT)
    try:
        yield
    finally:
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


def stream_handlers() -> list[logging.StreamHandler]:
    """Every stream handler of every logger (once each) whose stream can be re-pointed."""
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict))]
    handlers = {id(h): h for lg in loggers for h in getattr(lg, "handlers", [])
                if isinstance(h, logging.StreamHandler) and _repointable(h)}
    return list(handlers.values())


def _repointable(handler: logging.StreamHandler) -> bool:
    """False for a handler whose stream is a read-only property (logging's last-resort handler,
    attached by some library: it writes to whatever ``sys.stderr`` is, which the command swaps)."""
    prop = getattr(type(handler), "stream", None)
    return not isinstance(prop, property) or prop.fset is not None


def _point(handler: logging.StreamHandler, stream) -> None:
    handler.stream = stream  # not setStream: it flushes the old stream, which may be closed
    if hasattr(handler, "console"):  # Prefect's rich console handler writes through its Console
        handler.console.file = stream

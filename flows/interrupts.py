"""How the ``embedpipe`` command ends on SIGINT (Ctrl-C) or SIGTERM (``timeout``, a service manager,
``kill``): within seconds, with one line on stderr and the shell's exit code for the signal, 130
for SIGINT and 143 for SIGTERM (128 + the signal's number).

A terminal's Ctrl-C, ``timeout`` and a service manager signal the whole process group. The
command's helper processes (the temporary Prefect server, the ranks of a local multi-process
training, a sweep's workers, the llama.cpp server) run in sessions of their own, so the signal
reaches the command alone: it stops its work where it is (a stage writer it leaves discards its
staging directory and notes the stage on the exception, ``embed_core.artifacts``), reports the run
as crashed to a server that is still there, stops its helpers and prints, e.g.::

    embedpipe: interrupted (SIGTERM): nothing was committed for runs/r/prepare, which is as it was; rerun to resume

A second signal while the command stops ends it at once (its helpers die with it: they are armed
with a parent-death signal, ``embed_core.procs``).
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator, TextIO

from embed_core.errors import UNCOMMITTED_ATTR, exception_chain

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The command received ``signum``. A KeyboardInterrupt, so that Prefect's engines treat a
    SIGTERM as they treat a Ctrl-C: the run crashed, its state is reported, the exception goes on."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def interruptible(error_stream: TextIO) -> Iterator[None]:
    """For the block, the first SIGINT or SIGTERM raises :class:`Interrupted` in the main thread; a
    later one prints its line and ends the process at once. Nothing is installed outside the main
    thread (Python's rule for signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) == 1:
            raise Interrupted(signum)
        print(f"embedpipe: interrupted again ({signal.Signals(signum).name}): stopped at once", file=error_stream,
              flush=True)
        os._exit(exit_code(Interrupted(received[0])))

    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def is_interrupt(exc: BaseException) -> bool:
    """A signal's exception: ours, a KeyboardInterrupt, or Prefect's ``TerminationSignal`` (its
    SIGTERM handler's, during a flow run) where it reaches the command itself."""
    return isinstance(exc, KeyboardInterrupt) or (type(exc).__name__ == "TerminationSignal"
                                                  and isinstance(getattr(exc, "signal", None), int))


def _signum(exc: BaseException) -> int:
    return getattr(exc, "signum", None) or getattr(exc, "signal", None) or signal.SIGINT


def exit_code(exc: BaseException) -> int:
    """128 + the signal's number, as a shell reports a process ended by it."""
    return 128 + _signum(exc)


def interrupted_line(exc: BaseException) -> str:
    """The command's one line for an interrupt: the signal, and the stages it left uncommitted."""
    name = signal.Signals(_signum(exc)).name
    stages = _uncommitted(exc)
    if stages:
        where = ", ".join(stages)
        return (f"interrupted ({name}): nothing was committed for {where}, which "
                f"{'is' if len(stages) == 1 else 'are'} as it was; rerun to resume")
    return f"interrupted ({name}): what was committed before is kept; rerun to resume"


def _uncommitted(exc: BaseException) -> list[str]:
    """The stage directories that stage writers left uncommitted as ``exc`` (or an exception it
    arose from: Prefect's own SIGTERM exception, re-raised as ours) passed through them."""
    out: list[str] = []
    for item in exception_chain(exc):
        out += [s for s in getattr(item, UNCOMMITTED_ATTR, []) if s not in out]
    return out

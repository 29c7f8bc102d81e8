"""Processes that die with the process that started them, even when it is SIGKILLed, and that a
signal to the terminal's process group (Ctrl-C) does not reach: the command that started them gets
it and stops them (``flows.interrupts``); every helper process starts in a session of its own.

Linux sends a process the signal it asked for with ``prctl(PR_SET_PDEATHSIG)`` when its parent
exits, and keeps the request across ``exec``. Three ways in:

* :func:`dying_with_parent` wraps a command line for ``subprocess.Popen``: the child runs
  ``python -m embed_core.procs <parent pid> <signal> <command...>``, which arms the signal, checks
  that its parent is still that pid (the parent may have died before the signal was armed: then it
  exits with code 1 and runs nothing) and ``exec``s the command in the same process. No
  ``preexec_fn``: that is unsafe in a process with threads.
* :func:`die_with_parent` arms it in the calling process: a process-pool worker's initializer, a
  rank started by a launcher; :func:`own_session_dying_with_parent` also moves it to a session of
  its own, as ``start_new_session=True`` does for a command line.
* :func:`guard` is for processes started by others (a local Ray instance's agents, started by its
  raylet): a guard process SIGKILLs the given processes once this process has exited, however it
  exited (the end of its stdin, a pipe only this process holds), unless :func:`release` ends it first.

The "parent" is, exactly, the parent's *thread* that started the child: start children from a
thread that lives as long as they should (the main thread, a pool's own threads).

:func:`parent_gone` tells a process armed this way that its parent has exited (the signal is
asynchronous, and elsewhere than Linux there is none): ``StageWriter.commit`` refuses to commit
then, so an orphan never writes into a run directory whose lock its parent held. Elsewhere than
Linux nothing is armed and children may outlive a killed parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_parent: int | None = None  # the parent this process was armed to die with


class ParentGone(RuntimeError):
    """The process that started this one has exited: this one must not commit anything."""


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel for ``sig`` when this process's parent exits (Linux; kept across ``exec``).
    ``parent``: the pid it must still have (default: the one an earlier call named, else its
    parent now); if it has another, that one is gone already and this process exits at once with
    code 1. Arm early (a launched rank: before its imports), so that a parent that dies before
    is noticed."""
    global _parent
    _parent = parent if parent is not None else _parent if _parent is not None else os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != _parent:
        os._exit(1)


def own_session_dying_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """:func:`die_with_parent`, in a session of its own: a signal to the terminal's process group
    (Ctrl-C, ``timeout``, a service manager's stop) reaches the parent alone, which stops this
    process itself (a process-pool worker's initializer)."""
    try:
        os.setsid()
    except OSError:  # already a session or group leader
        pass
    die_with_parent(sig, parent)


def kill_all(pids: set[int] | list[int]) -> None:
    """SIGKILL each of ``pids`` that still runs (children of this process: none is reused before
    it is waited for)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_SIGNAL_WATCH: dict[str, object] = {}


def end_on_signals(signals: tuple[int, ...], grace_s: float = 5.0) -> None:
    """Make each of ``signals`` end this process within about ``grace_s`` seconds, even while its
    main thread is blocked in C++ code (a collective that waits for a stalled rank). Python runs a
    signal's handler (Prefect's SIGTERM handler during a flow run, KeyboardInterrupt for SIGINT)
    only between two bytecodes of the main thread, so a blocked process ignores the signal as long
    as the C++ call lasts; but Python's C-level handler writes the signal's number to the wakeup
    fd at once. A daemon thread reads it, leaves the Python handler ``grace_s`` to end the process
    its own way (Prefect marks the run crashed), then ends it by the signal's default action. A
    signal without a Python handler needs none of this: its default action is immediate. Call it
    from the main thread (Python's rule for the wakeup fd); once per process, later calls do nothing."""
    import threading

    if _SIGNAL_WATCH or threading.current_thread() is not threading.main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    _SIGNAL_WATCH.update(fd=write_end, previous=previous)
    threading.Thread(target=_watch_signals, args=(read_end, previous, set(signals), grace_s), daemon=True,
                     name="end-on-signals").start()


def _watch_signals(read_end: int, previous: int, signals: set[int], grace_s: float) -> None:
    import time

    while True:
        numbers = os.read(read_end, 64)
        if previous != -1:  # the wakeup fd this one replaced still hears of every signal
            try:
                os.write(previous, numbers)
            except OSError:
                pass
        caught = [n for n in numbers if n in signals]
        if caught:
            time.sleep(grace_s)
            _default_action(caught[0])


def _default_action(sig: int) -> None:
    """End this process as ``sig`` would without a handler (SIGKILL if it is still alive after)."""
    import ctypes
    import time

    try:
        ctypes.CDLL(None).signal(sig, 0)  # SIG_DFL, below Python's handler table (no main thread needed)
        os.kill(os.getpid(), sig)
        time.sleep(1)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def parent_gone() -> bool:
    """True in a process armed by :func:`die_with_parent` whose parent has exited."""
    return _parent is not None and os.getppid() != _parent


def check_parent(action: str) -> None:
    """Raise :class:`ParentGone` before ``action`` when this process's parent has exited."""
    if parent_gone():
        raise ParentGone(f"not {action}: the process that started this one (pid {_parent}) has exited")


def dying_with_parent(command: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """``command`` as a command line for ``subprocess.Popen`` whose process gets ``sig`` when this
    process (the calling thread) exits."""
    return [sys.executable, "-m", __name__, str(os.getpid()), str(int(sig)), *command]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a local server or rendezvous this process starts."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def descendants(pid: int | None = None) -> list[int]:
    """The processes below ``pid`` (default: this one) now, from ``/proc`` (empty elsewhere)."""
    out: list[int] = []
    todo = [os.getpid() if pid is None else pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += children
            todo += children
    return out


def guard(pids: list[int]) -> subprocess.Popen | None:
    """A guard process that SIGKILLs ``pids`` (each only while it is still the same process) once
    this process has exited; None where ``/proc`` is missing. End it with :func:`release`."""
    if not Path("/proc/self/stat").exists():
        return None
    alive = [f"{pid}:{start}" for pid in pids if (start := _start_time(pid)) is not None]
    return subprocess.Popen([sys.executable, "-m", __name__, "--guard", *alive], stdin=subprocess.PIPE,
                            start_new_session=True)  # a Ctrl-C in the terminal reaches the command, not its guard


def release(guarded: subprocess.Popen | None) -> None:
    """End a guard without killing anything (the guarded processes were stopped properly)."""
    if guarded is not None:
        guarded.communicate(b"release\n")


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks after boot): with the pid, it names one process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _guard(items: list[str]) -> None:
    if sys.stdin.buffer.readline().strip() == b"release":  # else the end of the pipe: its holder is gone
        return
    for item in items:
        pid, start = item.split(":")
        if _start_time(int(pid)) == start:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _exec_dying_with(parent: int, sig: int, command: list[str]) -> None:
    die_with_parent(sig, parent)
    os.execvp(command[0], command)


if __name__ == "__main__":
    if sys.argv[1] == "--guard":
        _guard(sys.argv[2:])
    else:
        _exec_dying_with(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])

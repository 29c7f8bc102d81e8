"""Parents and children for the tests of processes that die with their parent (``embed_core.procs``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.helpers.repo import REPO


def python(code: str, env: dict | None = None) -> subprocess.Popen:
    """``python -c code`` (dedented) in the repository, its stdout a text pipe."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, stdout=subprocess.PIPE)


def gone(pid: int, seconds: float = 20) -> bool:
    """True once ``pid`` has exited (a zombie counts as exited), False after ``seconds``."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def kill_parent_and_check_children(code: str, env: dict | None = None) -> None:
    """Run ``code`` as a parent process (it prints its children's pids on one line, then a line
    "ready"), SIGKILL it, and check that every child is gone."""
    parent = python(code, env)
    children: list[int] = []
    try:
        children = [int(pid) for pid in parent.stdout.readline().split()]
        assert children and parent.stdout.readline().strip() == "ready"
        assert not any(gone(pid, seconds=0.5) for pid in children), "a child died before its parent"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert all(gone(pid) for pid in children), f"children outlived their SIGKILLed parent: {children}"


def process_tree(pid: int) -> dict[int, tuple[str, str]]:
    """Every process below ``pid`` now: pid -> (start time, command line). With its start time a
    pid names one process, even after the pid is reused."""
    from embed_core.procs import _start_time, descendants

    tree = {}
    for child in descendants(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        start = _start_time(child)
        if start is not None:
            tree[child] = (start, command)
    return tree


def still_running(tree: dict[int, tuple[str, str]]) -> dict[int, str]:
    """The processes of ``tree`` that still run (not exited, not zombies): pid -> command line."""
    from embed_core.procs import _start_time

    out = {}
    for pid, (start, command) in tree.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and _start_time(pid) == start:
            out[pid] = command
    return out


def left_running(tree: dict[int, tuple[str, str]], seconds: float) -> dict[int, str]:
    """``still_running(tree)`` once it is empty, or after ``seconds``: what outlived the wait."""
    deadline = time.time() + seconds
    while (left := still_running(tree)) and time.time() < deadline:
        time.sleep(0.2)
    return left

"""Ctrl-C in a terminal, ``timeout`` and a service manager's stop signal the whole process group of
the command. Through the real CLI, started as a shell starts it (a process group of its own): the
command stops within seconds with one line and the shell's code for the signal, nothing of it
keeps running (its temporary Prefect server included), and the next run computes the stage afresh."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli_run import in_process, write_config
from tests.helpers.procs import gone, process_tree, still_running
from tests.helpers.repo import REPO

pytestmark = pytest.mark.prefect

HEADER = "sentence1,sentence2,score\n"
ROWS = 20_000  # prepare takes seconds: the signal comes while it writes


def _start_cli(*argv) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)  # the command starts its own temporary server, as on a user's machine
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *map(str, argv)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _in_session(sid: int) -> list[int]:
    """The processes (not zombies) of session ``sid`` now."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getsid(int(entry.name)) == sid \
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def _writing(run_dir: Path, stage: str) -> bool:
    """The stage has a file in its staging directory: it is past opening its writer, and writes."""
    return run_dir.is_dir() and any(p.name.startswith(f".{stage}.staging-") and any(p.iterdir())
                                    for p in run_dir.iterdir())


def _wait_for_staging(proc: subprocess.Popen, run_dir: Path, stage: str, seconds: float = 240) -> None:
    deadline = time.time() + seconds
    while not _writing(run_dir, stage):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"the {stage} stage did not start writing within {seconds} s"
        time.sleep(0.05)


def test_a_signal_to_the_process_group_stops_the_command_within_seconds_with_one_line_and_leaves_nothing_running(
        tmp_path, capfd, prefect_harness):
    rows = "".join(f"Sentence number {i} is here.,Another sentence {i}.,{i % 5}\n" for i in range(ROWS))
    (tmp_path / "s.csv").write_text(HEADER + rows)
    config = write_config(tmp_path, [{"name": "sts", "kind": "sts", "path": "s.csv"}])
    run_dir = tmp_path / "runs/r"

    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = _start_cli("prepare", "--config", config)
        _wait_for_staging(proc, run_dir, "prepare")
        tree = process_tree(proc.pid)
        assert any("uvicorn" in command for _, command in tree.values()), f"no temporary server: {tree}"
        sent = time.monotonic()
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - sent

        name = signal.Signals(sig).name
        assert proc.returncode == 128 + sig, (name, proc.returncode, err[-3000:], out[-3000:])
        assert took < 15, f"{name}: the command took {took:.1f} s to stop"
        assert err.splitlines() == [f"embedpipe: interrupted ({name}): nothing was committed for "
                                    f"{run_dir / 'prepare'}, which is as it was; rerun to resume"], err[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert all(gone(pid, seconds=5) for pid in tree), f"{name}: left running: {still_running(tree)}"
        assert not _in_session(proc.pid), f"{name}: left running in the command's session: {_in_session(proc.pid)}"
        # the run directory the command made holds nothing committed: it is gone again, staging and all
        assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())

    rerun = in_process(capfd, "prepare", "--config", config)
    assert rerun.rc == 0, rerun.err
    assert "prepare (computed)" in rerun.out
    assert f"read {2 * ROWS}, written {2 * ROWS}" in rerun.out, rerun.out

"""A SIGKILLed ``embedpipe sweep`` leaves nothing running and nothing committed after it: its
process-pool workers (mid-variant), the temporary Prefect server and every other process it
started die with it, and no variant lands in the run directory once the command is gone. A Ctrl-C
to its process group stops it within seconds, its workers included, with one line."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.procs import process_tree, still_running
from tests.helpers.repo import REPO
from tests.integration.prefect.test_sweep import _sweep_config

STEPS = 20  # a variant trains for several seconds: long enough to be killed in the middle


def _tiny_sweep(tmp_path: Path, tiny_model: Path) -> Path:
    """Two variants trained at once (one worker process each), no test evaluation, no soup."""
    path = _sweep_config(tmp_path, tiny_model, 2)
    raw = yaml.safe_load(path.read_text())
    raw.pop("evaluate")
    raw["sweep"] = {"stage": "stage2", "params": {"lr": [1e-4, 5e-3]}, "method": "grid", "max_concurrency": 2}
    raw["train"]["stages"][1].update(steps=STEPS, checkpoint_every=1000)
    raw["train"]["stages"][1]["dev"]["eval_every"] = STEPS
    path.write_text(yaml.safe_dump(raw))
    return path


def _committed(run_dir: Path) -> dict[str, bytes]:
    """Every committed stage of the run directory: its manifest."""
    return {p.parent.name: p.read_bytes() for p in sorted(run_dir.glob("*/manifest.json"))}


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_sigkilled_sweep_leaves_no_process_running_and_commits_no_variant_after_it(tmp_path, tiny_model):
    config = _tiny_sweep(tmp_path, tiny_model)
    run_dir = tmp_path / "runs/demo"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)  # the command's own temporary Prefect server, as a user's shell runs it
    cli = subprocess.Popen([sys.executable, "-m", "flows.cli", "sweep", "--config", str(config)], cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tree: dict[int, tuple[str, str]] = {}
    try:
        # mid-variant: both variants have started training (their checkpoint directories exist)
        _wait_for(lambda: cli.poll() is not None or len(list(run_dir.glob("checkpoints/stage2-*"))) == 2, 300,
                  "both variants to start training")
        assert cli.poll() is None, "the sweep ended before it was killed"
        time.sleep(1)
        tree = process_tree(cli.pid)  # the temporary Prefect server, the pool's workers and resource tracker
        workers = [command for _, command in tree.values() if "spawn_main" in command]
        assert len(workers) == 2, tree
        assert not list(run_dir.glob("train-stage2-*")), "a variant was committed before the kill: train longer"

        cli.send_signal(signal.SIGKILL)
        cli.wait()
        at_kill = _committed(run_dir)
        deadline = time.monotonic() + 30
        while still_running(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not still_running(tree), f"processes outlived the SIGKILLed sweep: {still_running(tree)}"

        time.sleep(5)  # every process of the tree is gone; a process it started unseen would commit by now
        assert _committed(run_dir) == at_kill
        assert not list(run_dir.glob("train-stage2-*"))
    finally:
        if cli.poll() is None:
            cli.kill()
        for pid in still_running(tree):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_sweep_whose_process_group_gets_a_ctrl_c_stops_its_workers_at_once_with_one_line(tmp_path, tiny_model):
    """Ctrl-C in a terminal signals the whole process group: the workers, in sessions of their own,
    do not get it; the command kills them rather than wait for their variants, and ends within
    seconds with one line and exit 130."""
    config = _tiny_sweep(tmp_path, tiny_model)
    run_dir = tmp_path / "runs/demo"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    stderr = tmp_path / "stderr"
    cli = subprocess.Popen([sys.executable, "-m", "flows.cli", "sweep", "--config", str(config)], cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL, stderr=stderr.open("w"), start_new_session=True)
    tree: dict[int, tuple[str, str]] = {}
    try:
        _wait_for(lambda: cli.poll() is not None or len(list(run_dir.glob("checkpoints/stage2-*"))) == 2, 300,
                  "both variants to start training")
        assert cli.poll() is None, "the sweep ended before it was interrupted"
        time.sleep(1)
        tree = process_tree(cli.pid)
        assert len([command for _, command in tree.values() if "spawn_main" in command]) == 2, tree

        sent = time.monotonic()
        os.killpg(cli.pid, signal.SIGINT)
        cli.wait(timeout=120)
        took = time.monotonic() - sent
        err = stderr.read_text()
        assert cli.returncode == 130, (cli.returncode, err[-3000:])
        assert took < 20, f"the sweep took {took:.1f} s to stop"
        # the workers' own log lines and multiprocessing's resource tracker write to the same stderr
        # (their KeyError noise is older than this test); the command's own is its one line
        assert [line for line in err.splitlines() if line.startswith("embedpipe:")] == [
            "embedpipe: interrupted (SIGINT): what was committed before is kept; rerun to resume"], err[-3000:]
        assert not [line for line in err.splitlines() if "/flows/" in line or "/embed_core/" in line], err[-3000:]
        assert not still_running(tree), f"processes outlived the interrupted sweep: {still_running(tree)}"
        assert not list(run_dir.glob("train-stage2-*"))
    finally:
        if cli.poll() is None:
            cli.kill()
        for pid in still_running(tree):
            os.kill(pid, signal.SIGKILL)

"""Faults through the real CLI: a SIGKILL anywhere in a stage, a failed run, an unwritable run
directory, an unsafe checkpoint. What was produced before survives, nothing is left running,
and the next run cleans up after the killed one."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from embed_core.stages import records_upstream
from embed_core.rundir import CONFIG_SNAPSHOT
from tests.helpers.cli_run import in_process, in_subprocess, write_config
from tests.helpers.repo import REPO

HEADER = "sentence1,sentence2,score\n"
ROWS = "".join(f"Sentence number {i} is here.,Another sentence {i}.,{i % 5}\n" for i in range(200))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.prefect
def test_a_sigkill_at_any_point_of_a_stage_keeps_the_previous_artifact_and_leaves_nothing_running(
        tmp_path, capfd, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    (tmp_path / "s.csv").write_text(HEADER + ROWS)
    config = write_config(tmp_path, [{"name": "sts", "kind": "sts", "path": "s.csv"}])
    assert in_process(capfd, "prepare", "--config", config).rc == 0
    run_dir = tmp_path / "runs/r"
    before = snapshot(run_dir / "prepare")
    (tmp_path / "s.csv").write_text(HEADER + ROWS + "One more.,And another.,3\n")  # the next run recomputes

    for point, own_server in (("convert", True), ("write", False), ("commit", False)):
        children = tmp_path / f"children-{point}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "KILL_AT_CHILDREN": str(children)}
        env.pop("PREFECT_API_URL", None)
        if not own_server:  # the harness's server (faster); the first kill starts and orphans its own
            env["PREFECT_API_URL"] = PREFECT_API_URL.value()
        proc = subprocess.run([sys.executable, str(REPO / "tests/helpers/kill_at.py"), point, "prepare", "--config", config],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == -9, (point, proc.stdout[-2000:], proc.stderr[-2000:])
        assert snapshot(run_dir / "prepare") == before, point
        pids = [int(p) for p in children.read_text().split()]
        if own_server:
            assert pids, "the CLI should have started a temporary Prefect server"
        deadline = time.time() + 20
        while any(map(_alive, pids)) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, pids)), f"{point}: processes outlived the killed CLI: {pids}"
    leftovers = [p.name for p in run_dir.iterdir() if p.name.startswith(".prepare.")]
    assert leftovers, "the write kill should have left a staging directory behind"

    assert in_process(capfd, "prepare", "--config", config).rc == 0
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".prepare.")]
    assert snapshot(run_dir / "prepare") != before


@pytest.mark.prefect
def test_a_failed_run_keeps_the_config_snapshot_of_the_last_good_one(tmp_path, capfd, prefect_harness):
    (tmp_path / "s.csv").write_text(HEADER + ROWS)
    good = write_config(tmp_path, [{"name": "sts", "kind": "sts", "path": "s.csv"}])
    assert in_process(capfd, "prepare", "--config", good).rc == 0
    run_dir = tmp_path / "runs/r"
    snapshot_before = (run_dir / CONFIG_SNAPSHOT).read_bytes()
    bad = write_config(tmp_path, [{"name": "sts", "kind": "sts", "path": "missing.csv"}], name="bad.yaml")
    in_process(capfd, "prepare", "--config", bad).assert_one_line_error("missing.csv: file not found")
    assert (run_dir / CONFIG_SNAPSHOT).read_bytes() == snapshot_before
    status = in_process(capfd, "status", "--run-dir", run_dir)
    assert status.rc == 0 and "fresh" in status.out and "stale" not in status.out


@pytest.mark.prefect
def test_outputs_are_created_with_the_users_umask(tmp_path, capfd, prefect_harness):
    (tmp_path / "s.csv").write_text(HEADER + ROWS)
    assert in_process(capfd, "prepare", "--config", write_config(tmp_path, [
        {"name": "sts", "kind": "sts", "path": "s.csv"}])).rc == 0
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "runs/r/prepare").iterdir()}
    modes[CONFIG_SNAPSHOT] = (tmp_path / "runs/r" / CONFIG_SNAPSHOT).stat().st_mode & 0o777
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_a_run_dir_that_cannot_be_written_is_a_one_line_error(tmp_path):
    """Permissions do not stop root, so as root the directory is made immutable (chattr +i) instead."""
    (tmp_path / "s.csv").write_text(HEADER + ROWS)
    config = write_config(tmp_path, [{"name": "sts", "kind": "sts", "path": "s.csv"}])
    run_dir = tmp_path / "readonly"
    run_dir.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(run_dir)], capture_output=True).returncode != 0:
            pytest.skip("running as root on a filesystem without chattr +i: cannot make a directory unwritable")
    else:
        run_dir.chmod(0o555)
    try:
        result = in_subprocess("prepare", "--config", config, "--run-dir", run_dir, timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(run_dir)], capture_output=True)
        run_dir.chmod(0o755)
    result.assert_one_line_error(f"{run_dir}: cannot write in the run directory: ")


def test_resuming_from_a_checkpoint_that_holds_a_pickled_object_refuses_to_load_it(tmp_path, tiny_model):
    from embed_core.config import parse_config
    from embed_core.errors import CheckpointError
    from embed_core.prepare.run import run_prepare
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer
    from tests.unit.embed_core.train.test_training import _config_dict

    config = parse_config(_config_dict(tmp_path, tiny_model))
    run_dir = tmp_path / "runs/demo"
    run_prepare(config, run_dir)
    stage = config.train.stages[0]
    datasets = load_datasets(run_dir, stage, records_upstream(config, "train"))
    trainer = Trainer(config.train, stage, datasets, init_model=str(tiny_model), checkpoint_dir=tmp_path / "ck", seed=0)
    checkpoint = trainer.save_checkpoint()
    fresh = Trainer(config.train, stage, datasets, init_model=str(tiny_model), checkpoint_dir=tmp_path / "ck", seed=0)
    fresh.load_checkpoint(checkpoint)  # a plain checkpoint loads

    marker = tmp_path / "code-ran"
    torch.save({"model": _RunsCode(str(marker))}, checkpoint / "state.pt")
    with pytest.raises(CheckpointError, match="refusing to load: it references posix.system"):
        fresh.load_checkpoint(checkpoint)
    assert not marker.exists()


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)

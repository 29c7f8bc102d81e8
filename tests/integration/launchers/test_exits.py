"""How a launched training ends (``torchrun --standalone --nproc_per_node 2``, gloo on CPU, FSDP on a
tiny BERT): a successful run exits 0 on every rank (its process groups torn down, no abort at
interpreter exit); a rank that stalls before a collective fails the command within
``train.dist_timeout_s`` with one line naming the rank that waited; a killed or stopped launcher
leaves no rank running, even one blocked inside gloo's C++ wait."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.procs import gone, left_running, process_tree
from tests.helpers.repo import REPO, demo_prepare_only
from tests.helpers.tiny_model import build_tiny_bert

pytestmark = pytest.mark.prefect  # (so slow) the session's Prefect server

STALL = str(REPO / "tests" / "helpers" / "launch_with_stall.py")


def _config(demo: Path, model: Path, *, steps: int, timeout_s: float) -> dict:
    cfg = yaml.safe_load(demo.read_text())
    cfg["train"] = {"base_model": str(model), "max_length": 32, "precision": "fp32", "sharding": "fsdp",
                    "dist_timeout_s": timeout_s, "stages": [{
                        "name": "ret", "tasks": ["retrieval"], "steps": steps, "batch_size": {"retrieval": 4},
                        "warmup_steps": 0, "num_hard_negatives": 1, "query_max_length": 24,
                        "passage_max_length": 32, "checkpoint_every": 100, "lr": 1e-3}]}
    return cfg


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, prefect_harness):
    """The demo's prepared records and a tiny BERT; the environment of every command."""
    tmp = tmp_path_factory.mktemp("exits")
    demo_prepare_only(tmp)
    from prefect.settings import PREFECT_API_URL

    # the session's Prefect server: each command (rank 0) skips starting a temporary one of its own
    env = dict(os.environ, EMBEDPIPE_CACHE_DIR=str(tmp / "hashes"), OMP_NUM_THREADS="1",
               PREFECT_API_URL=PREFECT_API_URL.value())
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "prepare", "--config", str(tmp / "demo.yaml"),
                           "--run-dir", str(tmp / "base")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, build_tiny_bert(tmp / "tiny", dropout=0.0), env


def _train_command(prepared, tmp_path: Path, script: list[str], *, steps: int, timeout_s: float) -> list[str]:
    tmp, model, _ = prepared
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_config(tmp / "demo.yaml", model, steps=steps,
                                                            timeout_s=timeout_s)))
    shutil.copytree(tmp / "base" / "prepare", tmp_path / "run" / "prepare")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script,
            "train", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run")]


def _start_stalled(prepared, tmp_path: Path, *, timeout_s: float, ignores_sigterm: bool = False):
    """torchrun with rank 1 stalled before step 2 (rank 0 waits in step 2's first collective): the
    launcher, its process tree once rank 1 stalls, and the time it stalled."""
    env = {**prepared[2], "STALL_DIR": str(tmp_path), "STALL_IGNORES_SIGTERM": "1" if ignores_sigterm else "0"}
    launcher = subprocess.Popen(_train_command(prepared, tmp_path, [STALL, "1", "2"], steps=3, timeout_s=timeout_s),
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (tmp_path / "stalled").exists():
        assert launcher.poll() is None and time.time() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(3)  # rank 0 is inside the collective now
    tree = process_tree(launcher.pid)
    assert sorted(_ranks(tree)) == [0, 1], tree
    return launcher, tree, float((tmp_path / "stalled").read_text())


def _ranks(tree: dict) -> dict[int, int]:
    """rank -> pid of the launched ranks in ``tree`` (their environment holds RANK)."""
    ranks = {}
    for pid, (_, command) in tree.items():
        if "launch_with_stall.py" in command:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            ranks[int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=")[1])] = pid
    return ranks


def test_a_successful_fsdp_run_under_torchrun_exits_0_on_every_rank(prepared, tmp_path):
    proc = subprocess.run(_train_command(prepared, tmp_path, ["-m", "flows.cli"], steps=2, timeout_s=300),
                          cwd=REPO, env=prepared[2], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr + proc.stdout
    assert (tmp_path / "run" / "train-ret" / "model").is_dir()


def test_a_directory_where_a_model_file_belongs_is_one_line_under_torchrun(prepared, tmp_path):
    tmp, model, env = prepared
    broken = shutil.copytree(model, tmp_path / "model")
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer.json").mkdir()  # was silently skipped: the tokenizer came from a fallback
    command = _train_command(prepared, tmp_path, ["-m", "flows.cli"], steps=1, timeout_s=60)
    cfg = yaml.safe_load((tmp_path / "c.yaml").read_text())
    cfg["train"]["base_model"] = str(broken)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("embedpipe: error: ")]
    assert lines == [f"embedpipe: error: {broken / 'tokenizer.json'}: is a directory, expected a file; copy or "
                     "download the model again"], proc.stderr[-3000:]
    assert "IsADirectoryError" not in proc.stderr + proc.stdout
    assert not (tmp_path / "run" / "train-ret").exists()


def test_a_rank_stalled_before_a_collective_fails_the_command_within_the_timeout_with_one_line(prepared, tmp_path):
    launcher, _, stalled_at = _start_stalled(prepared, tmp_path, timeout_s=15)
    try:
        _, stderr = launcher.communicate(timeout=15 + 60)
    finally:
        launcher.kill()
    ended_at = time.time()
    assert launcher.returncode != 0
    assert ended_at - stalled_at < 15 + 30, stderr[-3000:]
    lines = [x for x in stderr.splitlines() if x.startswith("embedpipe: error: ")]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("embedpipe: error: training rank 0 of 2, stage ret: a collective (")
    assert "waited longer than train.dist_timeout_s = 15 s" in lines[0]


def test_a_sigkilled_torchrun_leaves_no_rank_alive_even_one_blocked_in_a_collective(prepared, tmp_path):
    launcher, tree, _ = _start_stalled(prepared, tmp_path, timeout_s=300)
    launcher.kill()
    launcher.communicate()
    assert left_running(tree, seconds=10) == {}


def test_a_sigtermed_torchrun_stops_a_rank_blocked_in_a_collective_within_seconds(prepared, tmp_path):
    """Rank 0 waits inside gloo's C++ wait, under the Prefect flow's Python SIGTERM handler, which
    cannot run there; rank 1 ignores SIGTERM (hung). torchrun forwards the SIGTERM to both and
    would SIGKILL them only after its 30 s shutdown timeout: rank 0 must be gone well before."""
    launcher, tree, _ = _start_stalled(prepared, tmp_path, timeout_s=300, ignores_sigterm=True)
    rank_0 = _ranks(tree)[0]
    try:
        launcher.send_signal(signal.SIGTERM)
        assert gone(rank_0, seconds=10)
    finally:
        launcher.kill()
        launcher.communicate()
    assert left_running(tree, seconds=10) == {}

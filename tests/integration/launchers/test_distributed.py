"""Training under real multi-process launchers (torchrun; deepspeed with ZeRO-2; gloo on CPU): rank 0
alone writes, the weights and the lineage equal a one-process run over the same global batches, and a
killed rank resumes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from embed_core.procs import free_port
from tests.helpers.repo import REPO, demo_prepare_only
from tests.helpers.tiny_model import build_tiny_bert

pytestmark = pytest.mark.prefect  # (so slow) the session's Prefect server

STEPS = 4


def _config(demo_copy: Path, model: Path, batch: int) -> dict:
    cfg = yaml.safe_load(demo_copy.read_text())
    # fp32 (not auto, which is bf16 on CPUs with native bf16): the launched runs are compared with one
    # process to fp32 tolerances
    cfg["train"] = {"base_model": str(model), "max_length": 32, "precision": "fp32", "stages": [{
        "name": "ret", "tasks": ["retrieval"], "steps": STEPS, "batch_size": {"retrieval": batch}, "warmup_steps": 0,
        "num_hard_negatives": 1, "query_max_length": 24, "passage_max_length": 32, "checkpoint_every": 2, "lr": 1e-3}]}
    return cfg


def _cli(*args: str, launcher: list[str] | None = None, env: dict) -> subprocess.CompletedProcess:
    cmd = [*(launcher or [sys.executable, "-m", "flows.cli"]), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _torchrun(script: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script]


def _lineage(run_dir: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(run_dir / "train-ret" / "lineage.parquet").to_pylist()


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "train-ret" / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, prefect_harness):
    """The reference: one process, global batch 8, on a tiny BERT without dropout (ranks pad their
    slices differently, so dropout masks could not match across process counts)."""
    tmp = tmp_path_factory.mktemp("one")
    demo_prepare_only(tmp)
    model = build_tiny_bert(tmp / "tiny", dropout=0.0)
    from prefect.settings import PREFECT_API_URL

    # the session's Prefect server: each command (rank 0) skips starting a temporary one of its own
    env = dict(os.environ, EMBEDPIPE_CACHE_DIR=str(tmp / "hashes"), OMP_NUM_THREADS="1",
               PREFECT_API_URL=PREFECT_API_URL.value())
    (tmp / "one.yaml").write_text(yaml.safe_dump(_config(tmp / "demo.yaml", model, batch=8)))
    proc = _cli("run", "--config", str(tmp / "one.yaml"), "--run-dir", str(tmp / "one"), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, model, env


def _assert_rank_0_alone_wrote(run_dir: Path) -> None:
    """One stage directory, one history entry, no staging leftovers, no checkpoints left."""
    assert sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".lock")) == [
        ".embedpipe", "checkpoints", "config.yaml", "history.jsonl", "prepare", "train-ret"]
    assert not list((run_dir / "checkpoints").rglob("step-*"))
    history = [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [h["stage"] for h in history] == ["train-ret"]
    assert json.loads((run_dir / "train-ret" / "manifest.json").read_text())["steps"] == STEPS


def _assert_like_one_process(one: Path, run_dir: Path) -> None:
    """Equal weights: the gradient of the gathered loss summed over ranks and averaged is the
    one-process gradient; gloo sums in another order than one process does, hence the tolerance."""
    w1, w2 = _weights(one), _weights(run_dir)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=2e-5, rtol=1e-4), k
    # the lineage rank 0 wrote is both ranks' records: the one-process run's global batches of 8
    assert _lineage(run_dir) == _lineage(one) and [len(r["positions"]) for r in _lineage(run_dir)] == [8] * STEPS


@pytest.fixture(scope="module")
def two_nodes(one_process, tmp_path_factory) -> Path:
    """Multi-node as a cluster runs it: one ``torchrun --nnodes 2 --rdzv-backend c10d`` launcher per
    node (here two on one machine, one process each), meeting at a rendezvous endpoint; two ranks of
    4 = the one-process run's global batch of 8, drawn by the same sampler. The uninterrupted
    two-rank run of this module (the killed-and-resumed torchrun run must end on its weights)."""
    import socket

    tmp, model, env = one_process
    work = tmp_path_factory.mktemp("nodes")
    run_dir = work / "nodes"
    shutil.copytree(tmp / "one" / "prepare", run_dir / "prepare")
    (work / "nodes.yaml").write_text(yaml.safe_dump(_config(tmp / "demo.yaml", model, batch=4)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
         str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nodes-test",
         "-m", "flows.cli", "train", "--config", str(work / "nodes.yaml"), "--run-dir", str(run_dir)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outputs = [p.communicate(timeout=600) for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    return run_dir


def test_two_torchrun_launchers_as_two_nodes_train_like_one_process(one_process, two_nodes, tmp_path):
    """Global rank 0 alone writes the stage for both nodes; the weights are one process's and moved
    away from the base model."""
    tmp, _, _ = one_process
    _assert_rank_0_alone_wrote(two_nodes)
    _assert_like_one_process(tmp / "one", two_nodes)
    base = build_tiny_bert(tmp_path / "base-copy", dropout=0.0)
    assert not torch.equal(_weights_of(base)["embeddings.word_embeddings.weight"],
                           _weights(two_nodes)["embeddings.word_embeddings.weight"])


def test_torchrun_two_processes_train_like_one_process_and_resume_after_a_killed_rank(one_process, two_nodes,
                                                                                    tmp_path):
    """``torchrun --standalone --nproc_per_node 2``: rank 1 SIGKILLs itself after step 3, the
    launcher stops the job with the step-2 checkpoint kept; the same command again resumes both
    ranks and ends bit-identical to the uninterrupted two-rank run (``two_nodes``), so like one
    process, with rank 0 alone writing."""
    tmp, model, env = one_process
    killed = tmp_path / "killed"
    shutil.copytree(tmp / "one" / "prepare", killed / "prepare")
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(_config(tmp / "demo.yaml", model, batch=4)))
    train = ("train", "--config", str(tmp_path / "two.yaml"), "--run-dir", str(killed))
    proc = _cli("1", "3", *train, launcher=_torchrun([str(REPO / "tests" / "helpers" / "launch_with_kill.py")]), env=env)
    assert proc.returncode != 0
    assert not (killed / "train-ret").exists()
    assert [p.name for p in sorted((killed / "checkpoints" / "ret").glob("step-*"))] == ["step-0000002"]
    assert sorted(p.name for p in (killed / "checkpoints" / "ret" / "step-0000002").glob("rng-*.pt")) == [
        "rng-0.pt", "rng-1.pt"]
    proc = _cli(*train, launcher=_torchrun(["-m", "flows.cli"]), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr + proc.stdout
    _assert_rank_0_alone_wrote(killed)
    w2, w3 = _weights(two_nodes), _weights(killed)
    assert w2.keys() == w3.keys()
    for k in w2:
        assert torch.equal(w2[k], w3[k]), k
    _assert_like_one_process(tmp / "one", killed)
    assert _lineage(killed) == _lineage(two_nodes)  # the steps before the checkpoint replayed on resume


def test_train_processes_2_without_a_launcher_starts_its_own_ranks_and_trains_like_one_process(one_process, tmp_path):
    """What a Prefect flow run on a worker with two devices does (train.processes: 2, or auto with
    two GPUs): the command is rank 0 and starts rank 1 itself; rank 0 alone commits."""
    tmp, model, env = one_process
    run_dir = tmp_path / "spawned"
    shutil.copytree(tmp / "one" / "prepare", run_dir / "prepare")
    cfg = _config(tmp / "demo.yaml", model, batch=4)
    cfg["train"]["processes"] = 2
    # a second stage: the process group of the first is torn down and a new one made
    cfg["train"]["stages"].append({**cfg["train"]["stages"][0], "name": "again", "steps": 1})
    (tmp_path / "spawned.yaml").write_text(yaml.safe_dump(cfg))
    proc = _cli("train", "--config", str(tmp_path / "spawned.yaml"), "--run-dir", str(run_dir), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((run_dir / "train-ret" / "manifest.json").read_text())
    assert manifest["processes"] == 2 and manifest["steps"] == STEPS
    assert json.loads((run_dir / "train-again" / "manifest.json").read_text())["processes"] == 2
    assert [json.loads(x)["stage"] for x in (run_dir / "history.jsonl").read_text().splitlines()] == [
        "train-ret", "train-again"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == []  # the ranks' spec and logs are gone
    w1, w2 = _weights(tmp / "one"), _weights(run_dir)
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=2e-5, rtol=1e-4), k


def _weights_of(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_deepspeed_launcher_with_zero_2_trains_like_one_process(one_process, tmp_path):
    """`deepspeed --num_gpus 2 --module flows.cli train` on CPU (DS_ACCELERATOR=cpu, gloo), ZeRO-2."""
    tmp, model, env = one_process
    run_dir = tmp_path / "ds"
    shutil.copytree(tmp / "one" / "prepare", run_dir / "prepare")
    cfg = _config(tmp / "demo.yaml", model, batch=4)
    cfg["train"]["deepspeed"] = {"zero_optimization": {"stage": 2}}
    (tmp_path / "ds.yaml").write_text(yaml.safe_dump(cfg))
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                "--module", "flows.cli"]
    proc = _cli("train", "--config", str(tmp_path / "ds.yaml"), "--run-dir", str(run_dir), launcher=launcher,
                env={**env, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    history = [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [h["stage"] for h in history] == ["train-ret"] and not list((run_dir / "checkpoints").rglob("step-*"))
    w1, w2 = _weights(tmp / "one"), _weights(run_dir)
    # ZeRO-2 keeps fp32 master weights and reduces partitioned gradients: same math, other order
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=5e-5, rtol=1e-4), k

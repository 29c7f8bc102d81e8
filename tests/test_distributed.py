"""Training under a real multi-process launcher (torchrun, gloo on CPU): rank 0 alone writes, the
weights equal a one-process run over the same global batches, and a killed rank resumes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import REPO
from tests.tiny_model import build_tiny_bert

pytestmark = pytest.mark.slow

STEPS = 4


def _config(demo_copy: Path, model: Path, batch: int) -> dict:
    cfg = yaml.safe_load(demo_copy.read_text())
    cfg["train"] = {"base_model": str(model), "max_length": 32, "stages": [{
        "name": "ret", "tasks": ["retrieval"], "steps": STEPS, "batch_size": {"retrieval": batch}, "warmup_steps": 0,
        "num_hard_negatives": 1, "query_max_length": 24, "passage_max_length": 32, "checkpoint_every": 2, "lr": 1e-3}]}
    return cfg


def _cli(*args: str, launcher: list[str] | None = None, env: dict) -> subprocess.CompletedProcess:
    cmd = [*(launcher or [sys.executable, "-m", "flows.cli"]), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _torchrun(script: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script]


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "train-ret" / "model" / "model.safetensors"))


def test_torchrun_two_processes_train_like_one_process_and_resume_after_a_killed_rank(demo_copy, tmp_path):
    model = build_tiny_bert(tmp_path / "tiny", dropout=0.0)
    env = dict(os.environ, EMBEDPIPE_CACHE_DIR=str(tmp_path / "hashes"), OMP_NUM_THREADS="1")

    one = tmp_path / "one"
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(_config(demo_copy, model, batch=8)))
    proc = _cli("run", "--config", str(tmp_path / "one.yaml"), "--run-dir", str(one), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # two ranks of 4 = the one-process run's global batch of 8, drawn by the same sampler
    two = tmp_path / "two"
    shutil.copytree(one / "prepare", two / "prepare")
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(_config(demo_copy, model, batch=4)))
    train = ("train", "--config", str(tmp_path / "two.yaml"), "--run-dir", str(two))
    proc = _cli(*train, launcher=_torchrun(["-m", "flows.cli"]), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # rank 0 alone wrote: one stage directory, one history entry, no staging leftovers, no checkpoints left
    assert sorted(p.name for p in two.iterdir() if not p.name.startswith(".lock")) == [
        "checkpoints", "config.yaml", "history.jsonl", "prepare", "train-ret"]
    assert not list((two / "checkpoints").rglob("step-*"))
    history = [json.loads(x) for x in (two / "history.jsonl").read_text().splitlines()]
    assert [h["stage"] for h in history] == ["train-ret"]
    manifest = json.loads((two / "train-ret" / "manifest.json").read_text())
    assert manifest["steps"] == STEPS
    # equal weights: the gradient of the gathered loss summed over ranks and averaged is the
    # one-process gradient; gloo sums in another order than one process does, hence the tolerance
    w1, w2 = _weights(one), _weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=2e-5, rtol=1e-4), k
    base = build_tiny_bert(tmp_path / "base-copy", dropout=0.0)
    assert not torch.equal(_weights_of(base)["embeddings.word_embeddings.weight"], w2["embeddings.word_embeddings.weight"])

    # rank 1 SIGKILLs itself after step 3: the launcher stops the job; the checkpoint of step 2 stays
    killed = tmp_path / "killed"
    shutil.copytree(one / "prepare", killed / "prepare")
    train = ("train", "--config", str(tmp_path / "two.yaml"), "--run-dir", str(killed))
    proc = _cli("1", "3", *train, launcher=_torchrun([str(REPO / "tests" / "launch_with_kill.py")]), env=env)
    assert proc.returncode != 0
    assert not (killed / "train-ret").exists()
    assert [p.name for p in sorted((killed / "checkpoints" / "ret").glob("step-*"))] == ["step-0000002"]
    assert sorted(p.name for p in (killed / "checkpoints" / "ret" / "step-0000002").glob("rng-*.pt")) == [
        "rng-0.pt", "rng-1.pt"]
    # the same command again: both ranks resume from step 2 and end where the uninterrupted run did
    proc = _cli(*train, launcher=_torchrun(["-m", "flows.cli"]), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr + proc.stdout
    w3 = _weights(killed)
    for k in w2:
        assert torch.equal(w2[k], w3[k]), k


def _weights_of(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))

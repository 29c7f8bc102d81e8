"""``train.sharding: fsdp`` under a real launcher: ``torchrun --nproc_per_node 2`` (gloo, CPU) training
a tiny random-init bidirectional Qwen3 with GradCache. Two sharded processes end with the weights of
one unsharded process over the same global batches; a rank killed mid-stage and the same command
again end bit-identical to the uninterrupted sharded run; the committed model (consolidated from
the shards) loads in sentence-transformers and encodes like the evaluate stage."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.repo import REPO
from tests.helpers.tiny_model import build_tiny_decoder

pytestmark = pytest.mark.prefect  # (so slow) the session's Prefect server

STEPS = 4


def _config(demo: Path, model: Path, *, batch: int, sharding: str) -> dict:
    cfg = yaml.safe_load(demo.read_text())
    # fp32 (computed and saved): compared with one process to fp32 tolerances; GradCache chunks of 3
    # texts, so a step runs several backward passes and FSDP must reduce only on the last
    cfg["train"] = {"base_model": str(model), "max_length": 32, "precision": "fp32", "save_dtype": "fp32",
                    "bidirectional": True, "sharding": sharding, "stages": [{
                        "name": "ret", "tasks": ["retrieval"], "steps": STEPS, "batch_size": {"retrieval": batch},
                        "warmup_steps": 0, "num_hard_negatives": 1, "query_max_length": 24,
                        "passage_max_length": 32, "checkpoint_every": 2, "lr": 1e-3, "grad_cache_chunk": 3}]}
    return cfg


def _cli(*args: str, launcher: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _torchrun(script: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script]


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "train-ret" / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, prefect_harness):
    """The demo's prepared records, a tiny Qwen3 (no dropout: its config has none) and the
    one-process reference: global batch 8, unsharded."""
    tmp = tmp_path_factory.mktemp("fsdp")
    shutil.copytree(REPO / "data", tmp / "data")
    demo = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    demo.update(data_root=str(tmp / "data"), run_root=str(tmp / "runs"))
    for section in ("synthesize", "mine", "evaluate", "train"):
        demo.pop(section, None)
    for source in demo["prepare"]["sources"]:  # dev records for the dev-evaluation test
        if source["name"] == "stsb":
            source["dev_fraction"] = 0.2
    (tmp / "demo.yaml").write_text(yaml.safe_dump(demo))
    model = build_tiny_decoder(tmp / "qwen3", "qwen3")
    from prefect.settings import PREFECT_API_URL

    # the session's Prefect server: each command (rank 0) skips starting a temporary one of its own
    env = dict(os.environ, EMBEDPIPE_CACHE_DIR=str(tmp / "hashes"), OMP_NUM_THREADS="1",
               PREFECT_API_URL=PREFECT_API_URL.value())
    (tmp / "one.yaml").write_text(yaml.safe_dump(_config(tmp / "demo.yaml", model, batch=8, sharding="none")))
    proc = _cli("run", "--config", str(tmp / "one.yaml"), "--run-dir", str(tmp / "one"),
                launcher=[sys.executable, "-m", "flows.cli"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, model, env


def test_fsdp_with_grad_cache_on_two_processes_trains_like_one_process_and_resumes_bit_identical(prepared, tmp_path):
    tmp, model, env = prepared
    (tmp_path / "fsdp.yaml").write_text(yaml.safe_dump(_config(tmp / "demo.yaml", model, batch=4, sharding="fsdp")))
    sharded = tmp_path / "sharded"
    shutil.copytree(tmp / "one" / "prepare", sharded / "prepare")
    train = ("train", "--config", str(tmp_path / "fsdp.yaml"), "--run-dir", str(sharded))
    proc = _cli(*train, launcher=_torchrun(["-m", "flows.cli"]), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list((sharded / "checkpoints").rglob("step-*"))

    # the same global batches: the reduce-scattered mean of the two ranks' gradients is the one-process
    # gradient up to summation order (gloo adds the ranks' halves, one process adds all rows at once);
    # over 4 AdamW steps at lr 1e-3 that stays below 1e-5 on weights of size ~0.02-1
    w1, w2 = _weights(tmp / "one"), _weights(sharded)
    assert w1.keys() == w2.keys() and len(w1) == 24  # the whole model: consolidated from both shards
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=2e-5, rtol=1e-4, msg=k)
    assert not torch.equal(w2["embed_tokens.weight"], _weights_of(model)["embed_tokens.weight"])  # it trained
    # the gradient norm each step logs is the whole gradient's (FSDP's shards reduced), as one process's
    import pyarrow.parquet as pq

    norms = [[r["grad_norm"] for r in pq.read_table(d / "train-ret" / "metrics.parquet").to_pylist()]
             for d in (tmp / "one", sharded)]
    assert len(norms[1]) == STEPS and norms[1] == pytest.approx(norms[0], rel=1e-4)

    # rank 1 SIGKILLs itself after step 3; the sharded checkpoint of step 2 stays, one shard per rank
    killed = tmp_path / "killed"
    shutil.copytree(tmp / "one" / "prepare", killed / "prepare")
    train = ("train", "--config", str(tmp_path / "fsdp.yaml"), "--run-dir", str(killed))
    proc = _cli("1", "3", *train, launcher=_torchrun([str(REPO / "tests" / "helpers" / "launch_with_kill.py")]), env=env)
    assert proc.returncode != 0 and not (killed / "train-ret").exists()
    step2 = killed / "checkpoints" / "ret" / "step-0000002"
    assert [p.name for p in sorted(step2.parent.glob("step-*"))] == ["step-0000002"]
    files = sorted(p.name for p in (step2 / "sharded").glob("*.distcp"))  # __<rank>_<writer thread>.distcp
    assert {f.split("_")[2] for f in files} == {"0", "1"} and len(files) > 2  # both ranks, several threads each
    proc = _cli(*train, launcher=_torchrun(["-m", "flows.cli"]), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr + proc.stdout
    w3 = _weights(killed)
    for k in w2:
        assert torch.equal(w2[k], w3[k]), k

    # the committed model: sentence-transformers encodes as the evaluate stage's encoder does
    from sentence_transformers import SentenceTransformer

    from embed_core.model.encoder import Encoder

    texts = ["what is a protein", "a much longer passage about proteins folding in cells", "x"]
    saved = sharded / "train-ret" / "model"
    ours = Encoder(str(saved), pooling="mean", max_length=32, precision="fp32", device="cpu").encode(texts)
    st = SentenceTransformer(str(saved), device="cpu").encode(texts)
    assert abs(st - ours).max() < 1e-5


def _weights_of(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_fsdp_on_two_processes_trains_lora_on_a_bf16_base_with_dev_evaluation_on_every_rank(prepared, tmp_path):
    """LoRA on a frozen bf16 base (bf16 compute), GradCache, a retrieval and an STS dataset, and an STS
    dev task scored every step with the best step kept: under FSDP every rank encodes the dev texts
    (each forward gathers layers from both ranks), rank 0's scores count, and the kept weights are
    reloaded from their shards; the committed model has the adapters merged. Gradients are
    reduce-scattered once per step (``fsdp_sync: step``; the first test covers every backward)."""
    import json

    from sentence_transformers import SentenceTransformer

    from embed_core.model.encoder import Encoder

    tmp, model, env = prepared
    cfg = _config(tmp / "demo.yaml", model, batch=4, sharding="fsdp")
    cfg["train"].update(precision="bf16", weights_dtype="bf16", fsdp_sync="step",  # the deferred reduce-scatter
                        lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]})
    cfg["train"]["stages"][0].update(
        tasks=["retrieval", "sts"], steps=3, checkpoint_every=10, lr=5e-3, batch_size={"retrieval": 4, "sts": 4},
        dev={"eval_every": 1, "max_rows": 20, "select": "best",
             "tasks": [{"name": "StsDev", "type": "sts", "dataset": "stsb"}]})
    (tmp_path / "lora.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "lora"
    shutil.copytree(tmp / "one" / "prepare", run_dir / "prepare")
    proc = _cli("train", "--config", str(tmp_path / "lora.yaml"), "--run-dir", str(run_dir),
                launcher=_torchrun(["-m", "flows.cli"]), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    import pyarrow.parquet as pq

    dev = pq.read_table(run_dir / "train-ret" / "dev.parquet").to_pylist()
    assert [r["step"] for r in dev] == [1, 2, 3]
    manifest = json.loads((run_dir / "train-ret" / "manifest.json").read_text())
    best = max(dev, key=lambda r: r["selection"])
    assert manifest["selected"]["step"] == best["step"]
    saved = run_dir / "train-ret" / "model"
    weights = _weights_of(saved)
    assert not any("lora" in k for k in weights) and len(weights) == 24  # merged: the plain Qwen3 layout
    # merged in fp32 (no LoRA update rounded to the bf16 base's precision), and said so in config.json
    assert {w.dtype for w in weights.values()} == {torch.float32}
    assert json.loads((saved / "config.json").read_text())["dtype"] == "float32"
    texts = ["what is a protein", "a much longer passage about proteins folding in cells"]
    ours = Encoder(str(saved), pooling="mean", max_length=32, precision="fp32", device="cpu").encode(texts)
    st = SentenceTransformer(str(saved), device="cpu").encode(texts)
    assert abs(st - ours).max() < 1e-5

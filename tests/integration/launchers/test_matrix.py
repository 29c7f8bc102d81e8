"""The distributed test matrix (``make test-matrix``; opt-in: about 10 minutes on 2 cores).

Real launchers (``torchrun``, gloo on CPU) train tiny random-init models saved as real checkpoints
are (Qwen3 / Qwen2 / Llama / Mistral causal-LM classes with tied or untied ``lm_head``; BERT) on
real records of varying length from ``data/`` (SciFact passages up to 96 tokens, STS-B pairs,
Banking77 labels, SICK NLI), through the train stage as the CLI runs it. The factors, covered
pairwise rather than as a full product (each row names its own):

    back end {none, fsdp, deepspeed ZeRO-2} x GradCache {off, grad_cache_chunk, grad_cache_max_tokens}
    x packing {off, on} x ranks {2, 3} x tasks {retrieval only, retrieval + classification + STS + NLI}
    + LoRA on a bf16 base under FSDP + Matryoshka dims under FSDP with GradCache

Each row: every rank exits 0 (one launch trains all rows of a world size, so a hang or an abort
fails every row of it), and the committed model equals a reference within a tolerance:
* retrieval-only rows: one process with the global batch (the losses gather every rank's rows, and
  a record's draw does not depend on its rank: the same loss over the same texts);
* mixed-task rows: the same world size without sharding (classification and STS losses are per
  rank, so their mean is not one process's loss over the global batch; sharded must equal
  unsharded at equal world size).
Tolerance (fp32): the runs differ only in summation order (gloo adds the ranks' halves, one
process all rows at once). The step losses and gradient norms, each over the whole model, match to
``rel 1e-4``. Weights: 4 AdamW steps at lr 1e-3 move a weight by up to ~4e-3, and the differences
measured are below 1e-5, so ``atol 5e-5``, except that AdamW divides each gradient element by its
own running RMS: an element whose gradient is at rounding level (a word-piece seen once in the
batch) takes a step of up to lr whose size depends on that rounding (measured: one element of
30522 x 32 off by 2.7e-4, BERT with packing over 3 ranks). So at most 1 in 10,000 elements may
exceed 5e-5, and none may exceed 4 x lr (the most 4 steps can move it). A wrong reduction (a
gradient not averaged, a rank's rows lost) changes the gradient norm and most elements. The bf16
row compares with its own unsharded run at ``atol 2e-3`` (bf16's 8 bits of mantissa on
activations of size ~1).
A killed rank (SIGKILL after step 3; checkpoints every 2 steps) and the same command again end
bit-identical to the uninterrupted row, for one row per back end.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.repo import MIXED_SOURCES, MIXED_TASKS, REPO
from tests.helpers.tiny_model import build_tiny_bert, build_tiny_causal_lm

pytestmark = [pytest.mark.matrix, pytest.mark.slow]

STEPS = 4
LR = 1e-3
SOURCES = MIXED_SOURCES
MIXED = MIXED_TASKS
ZERO2 = {"zero_optimization": {"stage": 2}}

# (row id, model, world, back end, GradCache, packing, tasks, extra train options)
ROWS = [
    ("qwen3-tied fsdp chunk4", "qwen3-tied", 2, "fsdp", {"grad_cache_chunk": 4}, "off", ["retrieval"], {}),
    ("qwen3-tied fsdp chunk3 mixed", "qwen3-tied", 2, "fsdp", {"grad_cache_chunk": 3}, "off", MIXED, {}),
    ("qwen3-tied fsdp nocache", "qwen3-tied", 2, "fsdp", {}, "off", ["retrieval"], {}),
    ("bert fsdp nocache mixed", "bert", 2, "fsdp", {}, "off", MIXED, {}),
    ("qwen2-untied fsdp tokens packed mixed", "qwen2-untied", 2, "fsdp", {"grad_cache_max_tokens": 160}, "on", MIXED, {}),
    ("llama-tied none chunk4 packed", "llama-tied", 2, "none", {"grad_cache_chunk": 4}, "on", ["retrieval"], {}),
    ("mistral-untied deepspeed nocache", "mistral-untied", 2, "deepspeed", {}, "off", ["retrieval"], {}),
    ("qwen3-tied fsdp lora bf16", "qwen3-tied", 2, "fsdp", {"grad_cache_chunk": 4}, "off", ["retrieval", "sts"],
     {"precision": "bf16", "weights_dtype": "bf16",
      "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}),
    ("qwen3-untied fsdp tokens mixed", "qwen3-untied", 3, "fsdp", {"grad_cache_max_tokens": 160}, "off", MIXED, {}),
    ("bert none chunk3 packed", "bert", 3, "none", {"grad_cache_chunk": 3}, "on", ["retrieval"], {}),
    ("qwen2-untied fsdp nocache packed", "qwen2-untied", 3, "fsdp", {}, "on", ["retrieval"], {}),
    ("llama-tied deepspeed nocache mixed", "llama-tied", 3, "deepspeed", {}, "off", MIXED, {}),
    # Matryoshka: the loss at each prefix dimension on the cached embeddings, the retrieval gathers once per dim
    ("qwen3-tied fsdp chunk4 matryoshka", "qwen3-tied", 2, "fsdp", {"grad_cache_chunk": 4}, "off", ["retrieval"],
     {"matryoshka": {"dims": [64, 16, 8], "weights": [1.0, 0.5, 0.25]}}),
]
KILLED = ["qwen3-tied fsdp chunk4", "llama-tied none chunk4 packed", "mistral-untied deepspeed nocache"]


def _slug(row_id: str) -> str:
    return row_id.replace(" ", "-")


def _train(model: Path, world: int, backend: str, cache: dict, packing: str, tasks: list[str], extra: dict,
           *, batch: int) -> dict:
    decoder = "bert" not in model.name
    train = {"base_model": str(model), "pooling": "mean", "precision": "fp32", "max_length": 128,
             "bidirectional": decoder, "packing": packing, **({"sharding": "fsdp"} if backend == "fsdp" else {}),
             **({"deepspeed": ZERO2} if backend == "deepspeed" else {}), **extra}
    train["stages"] = [{"name": "s", "tasks": tasks, "steps": STEPS, "batch_size": {t: batch for t in tasks},
                        "warmup_steps": 0, "lr": LR, "checkpoint_every": 2, "num_hard_negatives": 1,
                        "query_max_length": 32, "passage_max_length": 96, **cache}]
    return train


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every row trained: the launches of each world size, the references, and the killed rows
    resumed; returns {row id: {"run": dir, "reference": dir, "resumed": dir or None, "tol": atol}}."""
    tmp = tmp_path_factory.mktemp("matrix")
    tokenizer = build_tiny_bert(tmp / "tokenizer", dropout=0.0)
    models = {"bert": tokenizer}
    for name in {r[1] for r in ROWS} - {"bert"}:
        kind, tied = name.split("-")
        models[name] = build_tiny_causal_lm(tmp / name, kind, tied=tied == "tied", tokenizer_dir=tokenizer)
    base = {"run_name": "m", "run_root": str(tmp / "runs"), "data_root": str(REPO / "data"), "seed": 7,
            "prepare": {"sources": SOURCES}}
    prepared = _prepare(tmp / "prepared", base)
    launches: dict[tuple[int, str], list[dict]] = {}
    out: dict[str, dict] = {}
    for row_id, model, world, backend, cache, packing, tasks, extra in ROWS:
        run = tmp / _slug(row_id)
        cfg = {**base, "train": _train(models[model], world, backend, cache, packing, tasks, extra, batch=4)}
        launches.setdefault((world, "run"), []).append(_case(prepared, run, cfg))
        if tasks == ["retrieval"] and "lora" not in extra:  # one process, the global batch
            ref = {**base, "train": _train(models[model], 1, "none", cache, packing, tasks, extra, batch=4 * world)}
            ref["train"].pop("deepspeed", None)
            launches.setdefault((1, "run"), []).append(_case(prepared, tmp / f"{_slug(row_id)}-ref", ref))
        else:  # the same world size, unsharded
            ref = {**base, "train": _train(models[model], world, "none", cache, packing, tasks, extra, batch=4)}
            launches.setdefault((world, "run"), []).append(_case(prepared, tmp / f"{_slug(row_id)}-ref", ref))
        out[row_id] = {"run": run, "reference": tmp / f"{_slug(row_id)}-ref", "resumed": None,
                       "tol": 2e-3 if "lora" in extra else 5e-5}
        if row_id in KILLED:
            out[row_id]["resumed"] = tmp / f"{_slug(row_id)}-killed"
            launches.setdefault((world, row_id), []).append(_case(prepared, out[row_id]["resumed"], cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", EMBEDPIPE_CACHE_DIR=str(tmp / "hashes"))
    for (world, what), cases in launches.items():
        spec = tmp / f"spec-{world}-{_slug(what)}.json"
        spec.write_text(json.dumps({"cases": cases}))
        if what != "run":  # rank 1 SIGKILLs itself after step 3; the same launch again resumes from step 2
            proc = _launch(world, spec, env, kill=(1, 3))
            assert proc.returncode != 0, f"{what}: the killed launch exited 0"
            step2 = Path(cases[0]["run_dir"]) / "checkpoints" / "s" / "step-0000002"
            assert (step2 / "trainer_state.json").exists() and not (Path(cases[0]["run_dir"]) / "train-s").exists()
        proc = _launch(world, spec, env)
        assert proc.returncode == 0, f"world {world} {what}: exit {proc.returncode}\n{proc.stdout[-4000:]}"
        assert "terminate called" not in proc.stdout and proc.stdout.count("case done") == world * len(cases)
        if what != "run":
            assert "resumed from" in proc.stdout
    return out


def _prepare(run_dir: Path, base: dict) -> Path:
    from embed_core import stages
    from embed_core.config import RunConfig

    config = RunConfig.model_validate({**base, "train": _train(Path("x"), 1, "none", {}, "off", ["retrieval"], {}, batch=4)})
    stage = stages.get("prepare")
    ctx = stages.context(config, run_dir, stage)
    stage.run(ctx, stages.cache_decision(stage, ctx)[0])
    return run_dir / "prepare"


def _case(prepared: Path, run_dir: Path, cfg: dict) -> dict:
    shutil.copytree(prepared, run_dir / "prepare")
    return {"config": cfg, "run_dir": str(run_dir)}


def _launch(world: int, spec: Path, env: dict, kill: tuple[int, int] | None = None) -> subprocess.CompletedProcess:
    helper = REPO / "tests" / "helpers" / ("kill_cases.py" if kill else "train_cases.py")
    args = [*map(str, kill)] if kill else []
    cmd = [sys.executable, str(helper), *args, str(spec)] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), str(helper),
         *args, str(spec)]
    return subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1200)


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "train-s" / "model" / "model.safetensors"))


@pytest.mark.parametrize("row", [r[0] for r in ROWS])
def test_every_row_of_the_matrix_exits_zero_and_trains_like_its_reference(matrix, row):
    got = matrix[row]
    w, ref = _weights(got["run"]), _weights(got["reference"])
    assert w.keys() == ref.keys() and not any("lora" in k or "lm_head" in k for k in w)
    diff = torch.cat([(w[k] - ref[k]).abs().flatten() for k in ref])
    over = int((diff > got["tol"] + 1e-4 * torch.cat([ref[k].abs().flatten() for k in ref])).sum())
    assert over <= diff.numel() // 10_000 and float(diff.max()) <= STEPS * LR, (row, over, float(diff.max()))
    import pyarrow.parquet as pq

    rows = [pq.read_table(d / "train-s" / "metrics.parquet").to_pylist() for d in (got["run"], got["reference"])]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] and rows[0][-1]["step"] == STEPS
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in rows[0]] == pytest.approx([r[key] for r in rows[1]], rel=1e-4 if got["tol"] < 1e-3
                                                          else 2e-2), (row, key)


@pytest.mark.parametrize("row", KILLED)
def test_a_row_killed_mid_stage_resumes_bit_identical_to_the_uninterrupted_run(matrix, row):
    got = matrix[row]
    w, resumed = _weights(got["run"]), _weights(got["resumed"])
    assert w.keys() == resumed.keys()
    for k in w:
        assert torch.equal(w[k], resumed[k]), f"{row}: {k}"

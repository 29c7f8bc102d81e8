"""The CI twin of ``deployments/configs/qzhou-decoder.yaml``: the recipe as shipped, read from the YAML
(so the twin follows it when it changes), with only its sizes made CI-sized (``TWIN_SIZES``, the one
list of what the twin changes) and every training choice kept: bidirectional attention, pooling,
instructions and their template, precision, sharding (FSDP with a process group of one), weights
dtype and LoRA when the recipe sets them, GradCache, gradient checkpointing, both stages with their
tasks, losses, η and dev evaluation. The base model is a tiny random-init Qwen3 built in code.

Data: the recipe's sources point at ../shared/data; the twin replaces ``prepare.sources`` and
``prepare.contamination`` with the demo's (the repository's data/, ``deployments/configs/demo.yaml``),
STS-B's with a 10 % dev split for the recipe's dev task, and drops ``mine`` (its corpus is a
../shared/data path), ``synthesize`` and ``evaluate``. Then the real CLI: ``embedpipe prepare`` (in
this process) and ``embedpipe train`` (its own process, as a shell runs it), both on the session's
Prefect server."""

import copy
import json
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from tests.helpers.cli_run import in_process, in_subprocess
from tests.helpers.repo import REPO
from tests.helpers.tiny_model import build_tiny_decoder

pytestmark = pytest.mark.prefect  # (so slow) the session's Prefect server: each command skips starting its own

RECIPE = REPO / "deployments/configs/qzhou-decoder.yaml"

# Everything the twin changes in the recipe, in one place: sizes (warm-up is a length too: 300 steps of it
# would leave 3 steps at lr ≈ 0), BATCH for every batch size a stage names (its tasks kept), DROPPED
# sections, and where the data (the demo's sources, twin_config) and the base model (built in code) are.
TWIN_SIZES = {
    "train": {"max_length": 64},
    # 3 steps: stage 2's seeded draws (seed 42, η 0.72) reach a non-retrieval task at step 3
    "stage": {"steps": 3, "warmup_steps": 0, "query_max_length": 24, "passage_max_length": 48,
              "grad_cache_max_tokens": 96, "checkpoint_every": 2, "log_every": 1},
    "dev": {"eval_every": 3, "max_rows": 8},
}
BATCH = 4
DROPPED = ("synthesize", "mine", "evaluate")


def twin_config(recipe: dict, *, base_model: Path, run_root: Path) -> dict:
    """The recipe with TWIN_SIZES applied, the demo's data and the tiny base model."""
    cfg = copy.deepcopy(recipe)
    demo = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    cfg.update(data_root=str(REPO / "data"), run_root=str(run_root))
    cfg["prepare"] = {**cfg["prepare"], "sources": demo["prepare"]["sources"],
                      "contamination": demo["prepare"]["contamination"]}
    for source in cfg["prepare"]["sources"]:
        if source["name"] == "stsb":
            source["dev_fraction"] = 0.1
    for section in DROPPED:
        cfg.pop(section, None)
    cfg["train"].update(base_model=str(base_model), **TWIN_SIZES["train"])
    for stage in cfg["train"]["stages"]:
        stage.update(TWIN_SIZES["stage"])
        stage["batch_size"] = {task: BATCH for task in stage["batch_size"]}
        if stage.get("dev"):
            stage["dev"].update(TWIN_SIZES["dev"])
    return cfg


def test_the_qzhou_decoder_recipe_trains_both_stages_end_to_end_on_a_tiny_qwen3(tmp_path, capfd, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    recipe = yaml.safe_load(RECIPE.read_text())
    train = recipe["train"]
    names = [s["name"] for s in train["stages"]]
    # what the twin is a twin of: if the recipe drops one of these, this test says so before it runs
    assert train["bidirectional"] and train["pooling"] == "mean" and train["use_instructions"]
    assert train["sharding"] == "fsdp" and train["precision"] == "bf16" and len(names) == 2
    assert train["stages"][0]["tasks"] == ["retrieval"] and train["stages"][1]["eta"] == 0.72
    assert all(s["grad_cache_max_tokens"] and s["gradient_checkpointing"] for s in train["stages"])

    model = build_tiny_decoder(tmp_path / "qwen3", "qwen3")
    config = tmp_path / "twin.yaml"
    config.write_text(yaml.safe_dump(twin_config(recipe, base_model=model, run_root=tmp_path / "runs"),
                                     sort_keys=False))
    run_dir = tmp_path / "runs" / "twin"
    t0 = time.perf_counter()
    prepared = in_process(capfd, "prepare", "--config", config, "--run-dir", run_dir)
    assert prepared.rc == 0, prepared.err[-3000:]
    trained = in_subprocess("train", "--config", config, "--run-dir", run_dir, timeout=300,
                            env={"PREFECT_API_URL": PREFECT_API_URL.value(), "OMP_NUM_THREADS": "1"})
    assert trained.rc == 0, (trained.err[-3000:], trained.out[-3000:])
    print(f"prepare + train: {time.perf_counter() - t0:.1f} s")

    first, second = (run_dir / f"train-{n}" for n in names)
    for stage in (first, second):
        manifest = json.loads((stage / "manifest.json").read_text())
        assert manifest["steps"] == TWIN_SIZES["stage"]["steps"], manifest
    tasks = [set(pq.read_table(stage / "metrics.parquet").column("task").to_pylist()) for stage in (first, second)]
    assert tasks[0] == {"retrieval"}
    assert tasks[1] - {"retrieval"}, f"stage 2 drew only {tasks[1]}: raise TWIN_SIZES' steps so it reaches another task"
    assert Path(json.loads((second / "manifest.json").read_text())["init_model"]).resolve() == \
        (first / "model").resolve()
    assert not list((run_dir / "checkpoints").rglob("step-*"))  # committed stages leave no checkpoints

    # the recipe's choices reached the saved model
    saved = second / "model"
    assert json.loads((saved / "config.json").read_text())["is_causal"] is False
    settings = json.loads((saved / "embedpipe.json").read_text())
    assert settings["pooling"] == "mean" and settings["use_instructions"] is True
    assert settings["training"]["train"]["sharding"] == "fsdp"
    assert settings["training"]["stage"]["dev"]["select"] == train["stages"][1]["dev"]["select"]
    assert (second / "dev.parquet").exists()

    # a decoder is committed in bf16 (train.save_dtype: auto), as Qwen ships, and config.json says so
    from safetensors.torch import load_file

    assert {w.dtype for w in load_file(str(saved / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16"

    # sentence-transformers encodes as embedpipe's Encoder (the evaluate stage's) does, at one precision
    from sentence_transformers import SentenceTransformer

    from embed_core.model.encoder import Encoder

    texts = ["what is a protein", "a much longer passage about proteins folding in cells", "x"]
    ours = Encoder(str(saved), pooling="mean", max_length=64, precision="fp32", device="cpu").encode(texts)
    st = SentenceTransformer(str(saved), device="cpu", model_kwargs={"dtype": torch.float32}).encode(texts)
    assert abs(st - ours).max() < 1e-5

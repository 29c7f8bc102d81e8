"""The steps around training under ``torchrun`` (2 gloo ranks on CPU): re-mining (``mine-<stage>``)
and the commit with a ``merge`` run on rank 0 alone and commit once (issue 43, item 4). Every rank
runs the train command; before this was fixed rank 1 mined too, opened its own staging directory of
``mine-stage2`` (deleting rank 0's, which it found as a leftover) and committed the step a second
time over rank 0's. Now a rank other than 0 that opens a stage writer fails the run, so an exit 0 on
both ranks says rank 1 wrote nothing; and each result equals what one process computes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.repo import REPO, tiny_demo_config
from tests.helpers.tiny_model import build_tiny_bert

pytestmark = pytest.mark.prefect  # (so slow) the session's Prefect server

RETRIEVAL = {"tasks": ["retrieval"], "steps": 2, "warmup_steps": 0}
REMINE = {"remine": {"num_negatives": 3}}
MERGE = {"stage": "stage1", "weight": 0.25}
# stage 2 of the merge run trains without hard negatives: each rank draws its records' negatives from a
# generator of its own (seed, step), so with negatives to choose from two ranks pick other ones than
# one process does, and the weights could not be compared
MERGED = {"merge": MERGE, "num_hard_negatives": 0}


def _config(tmp: Path, model: Path, stage2: dict, batch: int) -> dict:
    """Two retrieval stages of 2 steps on a tiny BERT (max_length 32, fp32, no dropout: the ranks'
    run is compared with one process's) over SciFact, mined with the same tiny model."""
    cfg = tiny_demo_config(tmp, model, "steps", [{"name": "stage1", **RETRIEVAL},
                                                 {"name": "stage2", **RETRIEVAL, **stage2}])
    cfg["prepare"]["sources"] = [s for s in cfg["prepare"]["sources"] if s["name"] == "scifact"]
    cfg["prepare"]["contamination"] = [c for c in cfg["prepare"]["contamination"] if c["name"] == "scifact-test"]
    cfg["mine"] = {"model": str(model), "max_length": 32, "datasets": ["scifact"], "range_min": 0, "range_max": 8,
                   "num_negatives": 2, "relative_margin": None}
    cfg["train"]["precision"] = "fp32"
    for stage in cfg["train"]["stages"]:
        stage["batch_size"] = {"retrieval": batch}
    return cfg


def _write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run_instances(cfg: dict, run_dir: Path, instances: list[str]) -> None:
    """Stage instances in this (one) process, as the registry runs them, without the CLI."""
    from embed_core import stages
    from embed_core.config import parse_config

    config = parse_config(cfg)
    for instance in instances:
        stage = stages.get("train" if instance.startswith(("train-", "mine-")) else instance)
        ctx = stages.context(config, run_dir, stage, instance, stage.options())
        stage.run(ctx, stage.fingerprint(ctx))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, prefect_harness):
    """prepare and mine, once, in this process; the torchrun runs start from copies of them."""
    from prefect.settings import PREFECT_API_URL

    tmp = tmp_path_factory.mktemp("steps")
    model = build_tiny_bert(tmp / "tiny", dropout=0.0)
    _run_instances(_config(tmp, model, {}, batch=4), tmp / "base", ["prepare", "mine"])
    # the session's Prefect server: rank 0 skips starting a temporary one of its own
    env = dict(os.environ, EMBEDPIPE_CACHE_DIR=str(tmp / "hashes"), OMP_NUM_THREADS="1",
               PREFECT_API_URL=PREFECT_API_URL.value())
    return tmp, model, env


def _torchrun_train(config: Path, run_dir: Path, env: dict) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "flows.cli", "train", "--config", str(config), "--run-dir", str(run_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def _start(tmp: Path, run_dir: Path, *stages: Path) -> Path:
    for source in (tmp / "base" / "prepare", tmp / "base" / "mine", *stages):
        shutil.copytree(source, run_dir / source.name)
    return run_dir


def _assert_committed_once(run_dir: Path, expected: list[tuple[str, bool]]) -> None:
    """One history entry per step (computed or cached, as ``expected``), no staging directory or
    superseded artifact left, no checkpoint left."""
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert [(h["stage"], h["cached"]) for h in history] == expected
    assert [p.name for p in run_dir.iterdir() if ".staging-" in p.name or ".old-" in p.name] == []
    assert not list((run_dir / "checkpoints").rglob("step-*"))


def _outputs(run_dir: Path, instance: str) -> dict[str, str]:
    manifest = json.loads((run_dir / instance / "manifest.json").read_text())
    return {name: info["sha256"] for name, info in manifest["outputs"].items()}


@pytest.fixture(scope="module")
def remined(prepared):
    tmp, model, env = prepared
    config = _write(tmp / "remine.yaml", _config(tmp, model, REMINE, batch=4))
    run_dir = _start(tmp, tmp / "remined")
    _torchrun_train(config, run_dir, env)
    return run_dir


def test_under_torchrun_the_remine_step_runs_on_rank_0_and_commits_once_what_one_process_mines(prepared, remined):
    """One ``torchrun`` run: stage 1 on both ranks, stage 2's re-mining on rank 0 alone, stage 2 on both.
    The step's records are byte for byte those one process mines with the same stage-1 model."""
    import pyarrow.parquet as pq

    from embed_core.train.engine.lineage import LINEAGE_FILE, read_metadata

    tmp, model, _ = prepared
    _assert_committed_once(remined, [("train-stage1", False), ("mine-stage2", False), ("train-stage2", False)])
    manifest = json.loads((remined / "mine-stage2" / "manifest.json").read_text())
    assert manifest["model"]["path"] == str(remined / "train-stage1" / "model")
    one = _start(tmp, tmp / "remined-one", remined / "train-stage1")
    _run_instances(_config(tmp, model, REMINE, batch=4), one, ["mine-stage2"])
    records = {n: h for n, h in _outputs(remined, "mine-stage2").items() if n.endswith(".parquet")}
    assert records and records == {n: h for n, h in _outputs(one, "mine-stage2").items() if n.endswith(".parquet")}
    lineage = read_metadata(pq.read_schema(remined / "train-stage2" / LINEAGE_FILE))
    assert lineage["upstream"] == "mine-stage2"  # stage 2 trained on the step's records


def _weights(run_dir: Path, instance: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / instance / "model" / "model.safetensors"))


def test_under_torchrun_the_merge_runs_on_rank_0_and_commits_once_what_one_process_merges(prepared, remined):
    """Stage 1 (copied from the remine run) is a cache hit on both ranks; stage 2 trains on both and
    is merged with stage 1 and committed by rank 0 once. One process over the same global batches
    (8 = 2 ranks x 4) merges to the same weights, up to gloo's summation order (as in
    test_distributed.py); the merge itself is exact (tests/integration/cli/test_merge.py)."""
    tmp, model, env = prepared
    config = _write(tmp / "merge.yaml", _config(tmp, model, MERGED, batch=4))
    run_dir = _start(tmp, tmp / "merged", remined / "train-stage1")
    _torchrun_train(config, run_dir, env)
    _assert_committed_once(run_dir, [("train-stage1", True), ("train-stage2", False)])
    assert json.loads((run_dir / "train-stage2" / "manifest.json").read_text())["merged_with"] == MERGE
    one = _start(tmp, tmp / "merged-one", remined / "train-stage1")
    _run_instances(_config(tmp, model, MERGED, batch=8), one, ["train-stage2"])
    ranks, single = _weights(run_dir, "train-stage2"), _weights(one, "train-stage2")
    stage1 = _weights(one, "train-stage1")
    assert ranks.keys() == single.keys()
    for name in ranks:
        assert torch.allclose(ranks[name], single[name], atol=2e-5, rtol=1e-4), name
    assert any(not torch.equal(ranks[n], stage1[n]) for n in ranks)  # stage 2's training is in the average

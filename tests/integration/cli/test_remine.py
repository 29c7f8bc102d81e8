"""Re-mining with the model being trained (issue 36, item 1): a training stage with ``remine``
gets its own negatives, mined with the model it starts from, in ``mine-<stage>/``, as one config
and one ``embedpipe run``; they are cached by that model's fingerprint."""

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from embed_core.artifacts import read_manifest
from embed_core.config import load_config
from embed_core.model.encoder import model_fingerprint
from embed_core.model.settings import read_model_settings
from embed_core.rundir import read_history
from embed_core.train.engine.lineage import LINEAGE_FILE, read_metadata
from tests.helpers.cli_run import in_process, in_subprocess
from tests.helpers.repo import tiny_demo_config

TASKS = {"tasks": ["retrieval"]}


def _config(tmp, tiny_model, stage2_lr=1e-3):
    cfg = tiny_demo_config(tmp, tiny_model, "remine", [
        # a high learning rate: stage 1's model ranks the pool differently from the base's
        {"name": "stage1", "steps": 6, "lr": 3e-3, **TASKS},
        {"name": "stage2", "steps": 2, "lr": stage2_lr, "remine": {"num_negatives": 3}, **TASKS}])
    # fp32: "auto" is bf16 on a CPU with native bf16, and the test mines again in fp32 to compare
    cfg["mine"] = {"model": str(tiny_model), "max_length": 32, "precision": "fp32", "datasets": ["scifact"],
                   "range_min": 0, "range_max": 8, "num_negatives": 2, "relative_margin": None}
    path = tmp / "remine.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def remined(tmp_path_factory, tiny_model, prefect_harness):
    tmp = tmp_path_factory.mktemp("remine")
    path = _config(tmp, tiny_model)
    result = in_subprocess("run", "--config", path, timeout=900)  # own process, session's server
    assert result.rc == 0, result.err[-3000:]
    return tmp, path, tmp / "runs/remine"


def as_cached(embeddings):
    """Embeddings as the stage's cache returns them: stored as float16 (cache_dtype), renormalised."""
    out = embeddings.astype(np.float16).astype(np.float32)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def _negatives(run_dir, instance):
    table = pq.read_table(run_dir / instance / "scifact.parquet", columns=["id", "negatives"]).to_pylist()
    return {r["id"]: r["negatives"] for r in table}


def test_one_run_mines_again_with_stage1s_model_between_the_two_stages(remined):
    _, _, run_dir = remined
    history = [entry["stage"] for entry in read_history(run_dir)]
    assert history.index("train-stage1") < history.index("mine-stage2") < history.index("train-stage2")
    manifest = read_manifest(run_dir, "mine-stage2")
    stage1_model = str(run_dir / "train-stage1/model")
    assert manifest["model"]["path"] == stage1_model
    assert manifest["model"]["fingerprint"] == model_fingerprint(stage1_model, "mean", 32, False)
    assert manifest["upstream"] == "prepare"  # the records the mine stage reads: its negatives are replaced


def test_the_remined_negatives_differ_from_the_base_models_and_are_stage1s_own(remined, tiny_model):
    from embed_core.mine.miner import mine_records
    from embed_core.model.encoder import Encoder
    from embed_core.schema import table_to_records

    _, path, run_dir = remined
    base, again = _negatives(run_dir, "mine"), _negatives(run_dir, "mine-stage2")
    mined = [i for i, negs in again.items() if negs]
    assert mined and all(len(again[i]) == 3 for i in mined)  # the stage's override of num_negatives
    assert sum(set(again[i]) != set(base[i]) for i in mined) >= len(mined) // 4, "the two models mine alike"

    # the same negatives as mining prepare's records directly with stage 1's model
    config = load_config(path)
    mine = config.mine.model_copy(update={"model": str(run_dir / "train-stage1/model"), "num_negatives": 3})
    encoder = Encoder(mine.model, pooling="mean", max_length=32, precision="fp32")
    records = table_to_records(pq.read_table(run_dir / "prepare/scifact.parquet"))
    trained = read_model_settings(mine.model)
    assert trained.use_instructions and records[0].instruction  # stage 1 trained with scifact's instruction
    direct, _ = mine_records(records, lambda texts: as_cached(encoder.encode(texts)), mine, seed=config.seed,
                             settings=trained)
    assert {r.id: r.negatives for r in direct} == again
    assert read_manifest(run_dir, "mine-stage2")["model"]["instructions"] is True


def test_stage2_trains_on_the_remined_records(remined):
    _, _, run_dir = remined
    assert read_metadata(pq.read_schema(run_dir / "train-stage2" / LINEAGE_FILE))["upstream"] == "mine-stage2"
    assert read_metadata(pq.read_schema(run_dir / "train-stage1" / LINEAGE_FILE))["upstream"] == "mine"


def test_the_remined_negatives_are_cached_by_the_models_fingerprint(remined, tiny_model, capfd):
    tmp, _, run_dir = remined
    before = read_manifest(run_dir, "mine-stage2")["created_at"]
    changed = _config(tmp, tiny_model, stage2_lr=5e-4)  # stage 2 changes, the model it starts from does not
    result = in_process(capfd, "train", "--config", changed, "--stage", "stage2")
    assert result.rc == 0, result.err[-3000:]
    assert read_manifest(run_dir, "mine-stage2")["created_at"] == before
    assert [(e["stage"], e["cached"]) for e in read_history(run_dir)][-2:] == [("mine-stage2", True),
                                                                               ("train-stage2", False)]

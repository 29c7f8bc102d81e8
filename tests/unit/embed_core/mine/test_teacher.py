"""The mining teacher (embed_core.mine.teacher): rescoring drops a planted false negative and keeps
the other candidates, its scores are the records' scores, a cross-encoder scores raw logits and
scores each pair once."""

import numpy as np
import pytest

from embed_core.config import parse_config
from embed_core.mine.miner import mine_records
from embed_core.mine.run import _cached_embed
from embed_core.mine.teacher import teacher_scorer
from embed_core.schema import Record
from tests.helpers.tiny_model import build_tiny_cross_encoder


def unit(*xs):
    v = np.array(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


def _config(teacher: dict, **mine):
    return parse_config({"prepare": {"sources": [{"name": "d", "kind": "beir", "path": "unused"}]},
                         "embedding_cache": {"machine_wide": False},
                         "mine": {"teacher": teacher, "range_min": 0, "range_max": 5, "num_negatives": 3,
                                  "relative_margin": None, **mine}})


QUERY = "the quick brown fox jumps over"
POSITIVE = f"{QUERY} the lazy dog"
PLANTED = f"{QUERY} a fence"  # another text, but the teacher reads 8 tokens: to it, the positive's equal
OTHERS = ["an apple a day keeps", "the slow brown cat sleeps under", "rain falls on the green hills"]


def test_teacher_rescoring_drops_a_planted_false_negative_and_keeps_the_others(tiny_model, tmp_path):
    config = _config({"path": str(tiny_model), "kind": "embedder", "max_length": 8, "margin": 1e-4})
    # the mining model ranks the planted text first (it is no duplicate of the positive to it)
    vecs = {QUERY: unit(1, 0, 0), POSITIVE: unit(0.9, 0.4, 0), PLANTED: unit(0.8, 0.6, 0),
            **{t: unit(0.7 - 0.1 * i, 0, 0.7) for i, t in enumerate(OTHERS)}}
    records = [Record(id="d:0", dataset="d", task="retrieval", query=QUERY, positives=[POSITIVE], source_ref="f:0")]
    teacher = teacher_scorer(config, tmp_path, config.mine, records, _cached_embed)
    embed = lambda texts: np.stack([vecs[t] for t in texts])  # noqa: E731
    plain, _ = mine_records(records, embed, config.mine, [POSITIVE, PLANTED, *OTHERS], seed=0)
    assert plain[0].negatives == [PLANTED, *OTHERS[:2]]
    out, stats = mine_records(records, embed, config.mine, [POSITIVE, PLANTED, *OTHERS], seed=0, teacher=teacher)
    assert out[0].negatives == OTHERS and stats.teacher_dropped == 1 and PLANTED[:40] in stats.teacher_dropped_examples[0]
    expected = teacher([(QUERY, t) for t in [POSITIVE, *OTHERS]])
    assert out[0].positive_scores == pytest.approx([expected[0]], abs=1e-6)
    assert out[0].negative_scores == pytest.approx(list(expected[1:]), abs=1e-6)
    assert max(out[0].negative_scores) < out[0].positive_scores[0] - 1e-4


def test_a_cross_encoder_teacher_scores_raw_logits_and_scores_each_pair_once(tmp_path):
    import torch
    from sentence_transformers import CrossEncoder

    model = build_tiny_cross_encoder(tmp_path / "ce")
    config = _config({"path": str(model), "kind": "cross_encoder", "max_length": 32})
    pairs = [(QUERY, POSITIVE), (QUERY, OTHERS[0]), ("another query", OTHERS[1])]
    scores = teacher_scorer(config, tmp_path / "run", config.mine, [], _cached_embed)(pairs)
    direct = CrossEncoder(str(model), max_length=32, device="cpu").predict(pairs, activation_fn=torch.nn.Identity())
    assert scores == pytest.approx(direct, abs=1e-5)
    again = teacher_scorer(config, tmp_path / "run", config.mine, [], _cached_embed)
    assert again(pairs[::-1]) == pytest.approx(scores[::-1], abs=1e-6)  # from the cache: no model loaded
    (shard,) = tmp_path.glob("run/cache/embeddings/*-pairs-float32/shard-*.keys.npy")  # one write, three pairs
    assert len(np.load(shard)) == 3


@pytest.mark.slow  # runs prepare and mine on real records, then a training step: make test, not make test-fast
def test_the_mine_stage_keeps_a_teachers_scores_and_listwise_kl_trains_on_them(tiny_model, tmp_path):
    import math

    import torch
    from sentence_transformers import CrossEncoder

    from embed_core.artifacts import read_records
    from embed_core.mine.run import run_mine
    from embed_core.prepare.run import run_prepare
    from embed_core.schema import table_to_records
    from embed_core.stages import records_upstream
    from embed_core.train.engine.batches import DatasetRecords
    from embed_core.train.config import TrainConfig, TrainStageConfig
    from embed_core.train.engine.trainer import Trainer
    from tests.helpers.repo import REPO

    ce = build_tiny_cross_encoder(tmp_path / "ce")
    config = parse_config({"data_root": str(REPO / "data"), "embedding_cache": {"machine_wide": False},
                           "prepare": {"sources": [{"name": "flag", "kind": "flagembedding",
                                                    "path": "flagembedding/msmarco.jsonl"}]},
                           "mine": {"model": str(tiny_model), "max_length": 32, "range_min": 0, "range_max": 30,
                                    "only_missing": False, "relative_margin": None, "tasks": ["retrieval"],
                                    "teacher": {"path": str(ce), "kind": "cross_encoder", "max_length": 64}}})
    run_dir = tmp_path / "run"
    run_prepare(config, run_dir)
    manifest = run_mine(config, run_dir, upstream=records_upstream(config, "mine"))
    assert manifest["teacher"]["kind"] == "cross_encoder" and manifest["teacher"]["fingerprint"]
    records = table_to_records(read_records(run_dir, "mine")["flag.parquet"])
    model = CrossEncoder(str(ce), max_length=64, device="cpu")
    r = records[0]
    logits = model.predict([(r.query, t) for t in (*r.positives, *r.negatives)], activation_fn=torch.nn.Identity())
    assert [*r.positive_scores, *r.negative_scores] == pytest.approx(list(logits), abs=1e-4)
    before = table_to_records(read_records(run_dir, records_upstream(config, "mine"))["flag.parquet"])
    mined = [sc for x, old in zip(records, before) for sc in x.negative_scores[len(old.negatives):]
             if sc >= min(x.positive_scores)]
    assert sum(len(x.negatives) - len(old.negatives) for x, old in zip(records, before)) > 0
    assert mined == []  # no mined negative at or above its record's lowest positive, to the teacher

    stage = TrainStageConfig(name="kd", steps=1, batch_size={"retrieval": 4}, num_hard_negatives=2, warmup_steps=0,
                             query_max_length=32, passage_max_length=32,
                             losses={"retrieval": {"name": "listwise_kl", "infonce_weight": 0.5}})
    cfg = TrainConfig(base_model=str(tiny_model), max_length=32, precision="fp32", stages=[stage])
    trainer = Trainer(cfg, stage, {"flag": DatasetRecords("flag", read_records(run_dir, "mine")["flag.parquet"])},
                      init_model=str(tiny_model), checkpoint_dir=tmp_path / "kd", seed=0, log=lambda _: None)
    (row,) = trainer.train_step()
    assert math.isfinite(row["loss"]) and row["loss"] > 0

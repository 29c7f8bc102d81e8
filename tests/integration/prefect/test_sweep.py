"""Sweeps: every variant of a train stage trained on the cached upstream artifacts, the winner chosen
on dev and evaluated on test, reproducibly (a rerun is all cache hits and picks the same winner)."""

import pyarrow.parquet as pq
import pytest
import yaml

from embed_core.config import load_config, parse_config
from tests.unit.embed_core.train.test_training import _config_dict

pytestmark = pytest.mark.prefect


def _sweep_config(tmp_path, tiny_model, concurrency):
    raw = _config_dict(tmp_path, tiny_model)
    for source in raw["prepare"]["sources"]:
        if source["name"] == "stsb":
            source["dev_fraction"] = 0.2
    stage1, stage2 = raw["train"]["stages"]
    stage1["steps"] = 2
    stage2.update(steps=4, checkpoint_every=2, dev={"eval_every": 2, "max_rows": 30, "tasks": [
        {"name": "StsDev", "type": "sts", "dataset": "stsb"}]})
    raw["evaluate"] = {"base_model": str(tiny_model), "tasks": [
        {"name": "STSBenchmark", "type": "sts", "path": "stsb/test.csv", "header": False,
         "columns": {"text1": 0, "text2": 1, "score": 2}, "max_rows": 40}]}
    raw["sweep"] = {"stage": "stage2", "params": {"lr": [1e-4, 5e-3], "losses.sts": ["cosent", "angle"]},
                    "method": "random", "samples": 3, "max_concurrency": concurrency, "soup_top_k": 2}
    path = tmp_path / f"sweep-{concurrency}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_sweep_picks_the_best_dev_variant_reproducibly_and_writes_a_config_that_reproduces_it(
        prefect_harness, tiny_model, tmp_path):
    from flows.sweep import sweep_flow

    run_dir = tmp_path / "runs/demo"
    first = sweep_flow(config_path=str(_sweep_config(tmp_path, tiny_model, 2)), run_dir=str(run_dir))
    assert len(first["variants"]) == 3 and not any(v["cached"] for v in first["variants"])
    scores = first["dev_scores"]
    best = max(scores.values())
    assert first["winner"] == min(v for v, score in scores.items() if score == best)  # ties: the first name
    rows = pq.read_table(run_dir / "sweep-stage2/variants.parquet").to_pylist()
    assert rows[0]["variant"] == first["winner"] and [r["dev_score"] for r in rows] == sorted(scores.values(), reverse=True)
    assert [s["task"] for s in first["test"]] == ["STSBenchmark"]  # only the winner is evaluated on test
    assert "winner" in (run_dir / "sweep-stage2/report.md").read_text()

    # the soup: the mean of the two best variants' weights, scored on dev and test like the winner
    from safetensors.torch import load_file

    soup = first["soup"]
    ranked = [r["variant"] for r in rows]
    assert soup["members"] == ranked[:2] and [s["task"] for s in soup["test"]] == ["STSBenchmark"]
    weights = [load_file(run_dir / f"train-{v}/model/model.safetensors") for v in ranked[:2]]
    averaged = load_file(run_dir / "sweep-stage2-soup/model/model.safetensors")
    name = next(iter(averaged))
    assert averaged[name].allclose((weights[0][name] + weights[1][name]) / 2, atol=1e-6)
    assert "model soup" in (run_dir / "sweep-stage2-soup/model/README.md").read_text()

    # the same sweep again, one variant at a time: all cache hits, the same winner and dev scores
    again = sweep_flow(config_path=str(_sweep_config(tmp_path, tiny_model, 1)), run_dir=str(run_dir))
    assert all(v["cached"] for v in again["variants"])
    assert again["winner"] == first["winner"] and again["dev_scores"] == scores

    winner = load_config(run_dir / "sweep-stage2/winner.yaml")
    assert winner.sweep is None
    stage2 = next(s for s in winner.train.stages if s.name == "stage2")
    settings = next(v["overrides"] for v in first["variants"] if v["variant"] == first["winner"])
    assert stage2.lr == settings["lr"] and stage2.losses["sts"]["name"] == settings["losses.sts"]


def test_a_sweep_needs_a_dev_section_on_its_stage(tiny_model, tmp_path):
    from embed_core.runs import sweep

    raw = yaml.safe_load(_sweep_config(tmp_path, tiny_model, 1).read_text())
    raw["train"]["stages"][1].pop("dev")
    with pytest.raises(Exception, match="needs a dev section with select: best"):
        sweep.variants(parse_config(raw))

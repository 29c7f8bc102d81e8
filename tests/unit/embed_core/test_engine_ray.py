"""engine: ray — mine's encoding on a real local Ray cluster of two actors."""

import pyarrow.parquet as pq
import pytest

from embed_core import engine as engines
from embed_core.stages import records_upstream
from embed_core.config import parse_config
from embed_core.mine.config import MineConfig
from embed_core.model.config import EngineConfig
from embed_core.mine.run import run_mine
from embed_core.prepare.run import run_prepare

pytest.importorskip("ray")  # the `ray` extra (make test installs it with the dev extra)


@pytest.mark.slow
def test_mine_on_a_local_two_worker_ray_cluster_gets_exactly_the_local_engines_negatives(shared_data, tiny_model,
                                                                                       tmp_path, monkeypatch):
    import ray

    base = parse_config({"data_root": str(shared_data), "prepare": {"sources": [
        {"name": "scifact", "kind": "beir", "path": "beir/scifact", "params": {"split": "train"}}]}})
    rows, manifests = {}, {}
    made = engines._ENCODERS.made
    for kind in ("local", "ray"):
        # each engine on its own empty machine-wide cache: both really encode the pool (SciFact's judged
        # documents) and the queries
        monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / f"cache-{kind}"))
        # fp32: bf16 (auto on CPUs with native bf16) rounds differently with each batch's padded length, and
        # the engines batch differently; exact equality is an fp32 property
        mine = MineConfig(model=str(tiny_model), max_length=64, relative_margin=None, batch_size=128, precision="fp32",
                          engine=EngineConfig(kind=kind, num_workers=2, batch_size=256))
        cfg = base.model_copy(update={"mine": mine})
        run_dir = tmp_path / kind
        run_prepare(cfg, run_dir)
        manifests[kind] = run_mine(cfg, run_dir, upstream=records_upstream(cfg, "mine"))
        rows[kind] = pq.read_table(run_dir / "mine/scifact.parquet").to_pylist()
    assert not ray.is_initialized()  # the stage started its local Ray instance and stopped it
    # one set of actors loaded the model for the queries and the passage pool, and went with the stage
    assert engines._ENCODERS.made == made + 1 and engines._ENCODERS.actors == []
    assert manifests["ray"]["counts"]["texts_encoded"] == manifests["local"]["counts"]["texts_encoded"] > 1000
    assert sum(len(r["negatives"]) for r in rows["local"]) >= 3 * 808
    assert [r["negatives"] for r in rows["ray"]] == [r["negatives"] for r in rows["local"]]
    scores = [x for r in rows["local"] for x in r["negative_scores"]]
    assert [x for r in rows["ray"] for x in r["negative_scores"]] == pytest.approx(scores, abs=1e-5)  # fp32 sums in another order
    # an engine is not part of the stage's key: the same inputs on either engine are one result
    assert manifests["ray"]["input_fingerprint"] == manifests["local"]["input_fingerprint"]


@pytest.mark.slow
def test_evaluate_on_a_local_two_worker_ray_cluster_scores_exactly_like_the_local_engine(shared_data, tiny_model,
                                                                                       tmp_path, monkeypatch):
    import ray

    from embed_core.evaluate.run import run_evaluate

    results, manifests = {}, {}
    made = engines._ENCODERS.made
    for kind in ("local", "ray"):
        monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / f"cache-{kind}"))  # both encode everything
        cfg = parse_config({"data_root": str(shared_data), "prepare": {"sources": [
            {"name": "stsb", "kind": "sts", "path": "stsb_en/stsb-en-train.csv", "header": False,
             "columns": {"text1": 0, "text2": 1, "score": 2}}]}, "evaluate": {
            "base_model": str(tiny_model), "batch_size": 128,
            "engine": {"kind": kind, "num_workers": 2, "batch_size": 512},
            "tasks": [{"name": "STSBenchmark", "type": "sts", "path": "stsb_en/stsb-en-test.csv", "header": False,
                       "columns": {"text1": 0, "text2": 1, "score": 2}}]}})
        manifests[kind] = run_evaluate(cfg, tmp_path / kind)
        results[kind] = {(r["task"], r["metric"]): r["value"]
                         for r in pq.read_table(tmp_path / kind / "evaluate/results.parquet").to_pylist()}
    assert not ray.is_initialized()
    # mteb asks for each side of the pairs on its own: the same actors encode both
    assert engines._ENCODERS.made == made + 1 and engines._ENCODERS.actors == []
    encoded = [m["models"][0]["texts_encoded"] for m in (manifests["local"], manifests["ray"])]
    assert encoded[0] == encoded[1] > 2500  # STS-B test's 2,758 sentences, less repeats
    assert results["ray"].keys() == results["local"].keys()
    # the actors batch (and so pad) texts differently: embeddings agree to float32 rounding
    assert results["ray"] == pytest.approx(results["local"], abs=1e-6)
    assert manifests["ray"]["input_fingerprint"] == manifests["local"]["input_fingerprint"]


@pytest.mark.slow
def test_every_process_of_a_local_ray_instance_dies_with_its_sigkilled_driver():
    """Ray's agents (started by its raylet) otherwise linger a minute after the driver is killed."""
    from tests.helpers.procs import kill_parent_and_check_children

    kill_parent_and_check_children("""
        import time
        from embed_core import procs
        from embed_core.engine import engine_session
        from embed_core.model.config import EngineConfig
        with engine_session(EngineConfig(kind="ray", num_workers=1)):
            import ray
            assert ray.get(ray.remote(lambda: 1).remote()) == 1  # a worker process too
            print(*procs.descendants(), flush=True)
            print("ready", flush=True)
            time.sleep(600)
    """)

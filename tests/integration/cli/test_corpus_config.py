"""The CI twin of ``deployments/configs/corpus.yaml``: the recipe as shipped, read from the YAML, with
only its sizes, its data and its models made CI-sized (``twin_config`` says what changes): a
BEIR directory of the repository's SciFact sample cut to 150 documents and the test queries judged
on them (``small_scifact``) instead of ../shared/data, the scripted OpenAI-compatible server instead
of the packaged LLM, the tiny BERT built in code as base, round-trip and mining model. Then ``embedpipe run``: corpus -> passages -> queries -> mine -> train
-> evaluate on SciFact test, through the real CLI on the session's Prefect server."""

import copy
import gzip
import json

import pyarrow.parquet as pq
import pytest
import yaml

from embed_core.artifacts import read_manifest, read_records
from embed_core.schema import table_to_records
from embed_core.train.engine.lineage import LINEAGE_FILE, read_metadata
from tests.helpers.cli_run import in_process
from tests.helpers.llm_server import ScriptedLLMServer
from tests.helpers.repo import REPO

pytestmark = pytest.mark.prefect  # (so slow) the session's Prefect server

RECIPE = REPO / "deployments/configs/corpus.yaml"


def small_scifact(root, docs: int = 150):
    """data/scifact cut to its first ``docs`` documents, the queries and the test judgments on them."""
    src, out = REPO / "data/scifact", root / "scifact"
    (out / "qrels").mkdir(parents=True)
    lines = gzip.open(src / "corpus.jsonl.gz", "rt").read().splitlines()[:docs]
    (out / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    kept = {json.loads(line)["_id"] for line in lines}
    counts = {}
    for split in ("test", "train"):  # train: the recipe's dev queries
        qrels = (src / f"qrels/{split}.tsv").read_text().splitlines()
        judged = [q for q in qrels[1:] if q.split("\t")[1] in kept]
        (out / f"qrels/{split}.tsv").write_text("\n".join([qrels[0], *judged]) + "\n")
        counts[split] = len(judged)
    (out / "queries.jsonl").write_text((src / "queries.jsonl").read_text())
    return counts["test"]


def twin_config(recipe: dict, *, tiny_model: str, run_root, url: str, data_root) -> dict:
    cfg = copy.deepcopy(recipe)
    cfg.update(data_root=str(data_root), run_root=str(run_root), run_name="corpus")
    source = cfg["prepare"]["sources"][0]
    source.update(path="scifact/corpus.jsonl")
    source["params"].update(chunk_tokens=64)
    cfg["prepare"]["contamination"][0].update(path="scifact")
    cfg["synthesize"]["server"] = {"base_url": url, "model": "scripted", "mode": "completion", "timeout_s": 5.0}
    cfg["synthesize"]["queries"].update(max_passages=12, min_words=2)
    cfg["synthesize"]["queries"]["round_trip"].update(top_k=50, max_length=32)
    cfg["mine"].update(model=tiny_model, max_length=32)
    cfg["train"].update(base_model=tiny_model, max_length=32)
    for stage in cfg["train"]["stages"]:
        stage.update(steps=2, warmup_steps=0, batch_size={"retrieval": 4}, query_max_length=16,
                     passage_max_length=32, checkpoint_every=2, log_every=1, origin_weight={"synthetic": 0.5})
        stage["dev"].update(eval_every=2)
        stage["dev"]["tasks"][0].update(path="scifact", max_corpus=None)
        stage["data_value"].update(steps=2, seeds=2)
    cfg["evaluate"]["models"] = ["base", str(run_root / "corpus/train-stage1/model")]
    cfg["evaluate"]["tasks"][0].update(path="scifact")
    return cfg


def test_the_corpus_recipe_runs_from_documents_to_an_evaluated_model(tmp_path, capfd, tiny_model, prefect_harness,
                                                                     monkeypatch):
    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / "cache"))  # an empty embedding cache
    recipe = yaml.safe_load(RECIPE.read_text())
    # what the twin is a twin of: if the recipe drops one of these, this test says so before it runs
    assert recipe["prepare"]["sources"][0]["kind"] == "corpus" and recipe["synthesize"]["strategies"] == ["queries"]
    assert recipe["synthesize"]["queries"]["round_trip"]["model"] == "base"
    assert [t["name"] for t in recipe["evaluate"]["tasks"]] == ["SciFact"]
    assert recipe["train"]["stages"][0]["data_value"]["units"] == ["origin:synthetic"]  # the gate is on
    assert small_scifact(tmp_path / "data") > 0
    with ScriptedLLMServer() as server:
        config = tmp_path / "corpus.yaml"
        config.write_text(yaml.safe_dump(twin_config(recipe, tiny_model=str(tiny_model), run_root=tmp_path / "runs",
                                                     url=server.base_url, data_root=tmp_path / "data"), sort_keys=False))
        result = in_process(capfd, "run", "--config", config)
        assert result.rc == 0, result.err[-3000:]
        calls = server.total_calls
    run_dir = tmp_path / "runs/corpus"
    passages = pq.read_table(run_dir / "prepare/corpus-scifact-corpus.parquet").to_pylist()
    assert len(passages) >= 150 and all(p["source_ref"].startswith("scifact/corpus.jsonl:") for p in passages)
    assert calls == 12 * 2  # 12 passages x the recipe's two kinds of query
    queries = read_manifest(run_dir, "synthesize")["queries"]["scifact-corpus"]
    records = table_to_records(read_records(run_dir, "mine")["scifact-corpus.parquet"])
    assert len(records) == queries["kept"] > 0 and {r.origin for r in records} == {"synthetic"}
    (mined,) = read_manifest(run_dir, "mine")["counts"]["datasets"]
    assert mined["dataset"] == "scifact-corpus" and mined["mined"] and mined["pool"] == "corpus"  # every passage
    # the corpus is encoded once: the round trip's embeddings (same model and settings) are mine's
    assert read_manifest(run_dir, "mine")["counts"]["texts_encoded"] == 0
    # the gate measured the generated queries against the start model; the stage did what it decided
    (decision,) = pq.read_table(run_dir / "value-stage1/decision.parquet").to_pylist()
    assert decision["unit"] == "origin:synthetic" and decision["mode"] == "add_one_in" and len(decision["deltas"]) == 2
    trained = read_manifest(run_dir, "train-stage1")
    if decision["action"] == "drop":
        assert trained["steps"] == 0 and trained["untrained"].startswith("the data-value gate dropped every record")
    else:
        assert trained["steps"] == 2 and read_metadata(pq.read_schema(run_dir / "train-stage1" / LINEAGE_FILE))[
            "origin_weight"] == {"synthetic": 0.5 * decision["weight"]}
    scores = read_manifest(run_dir, "evaluate")["counts"]["main_scores"]
    assert {(s["task"], s["metric"]) for s in scores} == {("SciFact", "ndcg_at_10")} and len(scores) == 2  # base, trained

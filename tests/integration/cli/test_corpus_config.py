"""The CI twin of ``deployments/configs/corpus.yaml``: the recipe as shipped, read from the YAML, with
only its sizes, its data and its models made CI-sized (``twin_config`` says what changes): the
repository's SciFact sample instead of ../shared/data (the first 120 documents as the corpus), the
scripted OpenAI-compatible server instead of the packaged LLM, the tiny BERT built in code as base,
round-trip and mining model. Then ``embedpipe run``: corpus -> passages -> queries -> mine -> train
-> evaluate on SciFact test, through the real CLI on the session's Prefect server."""

import copy

import pyarrow.parquet as pq
import pytest
import yaml

from embed_core.artifacts import read_manifest, read_records
from embed_core.schema import table_to_records
from embed_core.train.lineage import LINEAGE_FILE, read_metadata
from tests.helpers.cli_run import in_process
from tests.helpers.llm_server import ScriptedLLMServer
from tests.helpers.repo import REPO

pytestmark = pytest.mark.prefect  # (so slow) the session's Prefect server

RECIPE = REPO / "deployments/configs/corpus.yaml"


def twin_config(recipe: dict, *, tiny_model: str, run_root, url: str) -> dict:
    cfg = copy.deepcopy(recipe)
    cfg.update(data_root=str(REPO / "data"), run_root=str(run_root), run_name="corpus")
    source = cfg["prepare"]["sources"][0]
    source.update(path="scifact/corpus.jsonl.gz", max_rows=120)
    source["params"].update(chunk_tokens=64)
    cfg["prepare"]["contamination"] = [{"name": "scifact-test", "kind": "beir", "path": "scifact",
                                        "params": {"split": "test"}}]
    cfg["synthesize"]["server"] = {"base_url": url, "model": "scripted", "mode": "completion", "timeout_s": 5.0}
    cfg["synthesize"]["queries"].update(max_passages=12, min_words=2)
    cfg["synthesize"]["queries"]["round_trip"].update(top_k=50, max_length=32)
    cfg["mine"].update(model=tiny_model, max_length=32, corpora={"scifact-corpus": "scifact"})
    cfg["train"].update(base_model=tiny_model, max_length=32)
    for stage in cfg["train"]["stages"]:
        stage.update(steps=2, warmup_steps=0, batch_size={"retrieval": 4}, query_max_length=16,
                     passage_max_length=32, checkpoint_every=2, log_every=1, origin_weight={"synthetic": 0.5})
    cfg["evaluate"]["models"] = ["base", str(run_root / "corpus/train-stage1/model")]
    cfg["evaluate"]["tasks"][0].update(path="scifact")
    return cfg


def test_the_corpus_recipe_runs_from_documents_to_an_evaluated_model(tmp_path, capfd, tiny_model, prefect_harness):
    recipe = yaml.safe_load(RECIPE.read_text())
    # what the twin is a twin of: if the recipe drops one of these, this test says so before it runs
    assert recipe["prepare"]["sources"][0]["kind"] == "corpus" and recipe["synthesize"]["strategies"] == ["queries"]
    assert recipe["synthesize"]["queries"]["round_trip"]["model"] == "base"
    assert [t["name"] for t in recipe["evaluate"]["tasks"]] == ["SciFact"]
    with ScriptedLLMServer() as server:
        config = tmp_path / "corpus.yaml"
        config.write_text(yaml.safe_dump(twin_config(recipe, tiny_model=str(tiny_model), run_root=tmp_path / "runs",
                                                     url=server.base_url), sort_keys=False))
        result = in_process(capfd, "run", "--config", config)
        assert result.rc == 0, result.err[-3000:]
        calls = server.total_calls
    run_dir = tmp_path / "runs/corpus"
    passages = pq.read_table(run_dir / "prepare/corpus-scifact-corpus.parquet").to_pylist()
    assert len(passages) >= 120 and all(p["source_ref"].startswith("scifact/corpus.jsonl.gz:") for p in passages)
    assert calls == 12 * 2  # 12 passages x the recipe's two kinds of query
    queries = read_manifest(run_dir, "synthesize")["queries"]["scifact-corpus"]
    records = table_to_records(read_records(run_dir, "mine")["scifact-corpus.parquet"])
    assert len(records) == queries["kept"] > 0 and {r.origin for r in records} == {"synthetic"}
    assert any(r.negatives for r in records)  # mined from the whole SciFact corpus
    assert read_metadata(pq.read_schema(run_dir / "train-stage1" / LINEAGE_FILE))["origin_weight"] == {"synthetic": 0.5}
    results = read_manifest(run_dir, "evaluate")
    assert results is not None and "SciFact" in str(results)

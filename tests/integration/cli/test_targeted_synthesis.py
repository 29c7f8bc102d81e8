"""Error-driven synthesis (issue 36, item 2): before a stage with ``targeted_synthesis``, the model
it starts from scores prepare's dev records; the training records nearest to its failures — never
a dev record — are the only ones the LLM (a real local OpenAI-compatible server) writes for; the
stage trains on the result; the answers are cached by prompt."""

import pyarrow.parquet as pq
import pytest
import yaml

from embed_core.artifacts import read_manifest, read_records
from embed_core.rundir import read_history
from embed_core.schema import table_to_records
from embed_core.train.engine.lineage import LINEAGE_FILE, read_metadata
from tests.helpers.cli_run import in_process, in_subprocess
from tests.helpers.llm_server import ScriptedLLMServer
from tests.helpers.repo import tiny_demo_config

DATASETS = ["scifact", "stsb", "banking77"]


def _config(tmp, tiny_model, url):
    cfg = tiny_demo_config(tmp, tiny_model, "targeted", [
        {"name": "stage1", "tasks": ["retrieval"], "steps": 3},
        {"name": "stage2", "tasks": ["retrieval", "sts", "classification"], "steps": 2,
         "targeted_synthesis": {"datasets": DATASETS, "failures": 4, "neighbours": 2, "max_records": 9}}])
    cfg["prepare"]["sources"] = [{**s, "dev_fraction": 0.2} for s in cfg["prepare"]["sources"] if s["name"] in DATASETS]
    cfg["synthesize"] = {
        "server": {"base_url": url, "model": "scripted", "mode": "completion", "timeout_s": 5.0, "max_concurrency": 2},
        "datasets": [],  # no general synthesis: the targeted step only
        "filter": {"model": str(tiny_model), "max_length": 32, "paraphrase_min_sim": -1.0, "pair_min_sim": -1.0,
                   "negative_min_sim": -1.0}}
    path = tmp / "targeted.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def targeted(tmp_path_factory, tiny_model, prefect_harness):
    tmp = tmp_path_factory.mktemp("targeted")
    with ScriptedLLMServer() as server:
        path = _config(tmp, tiny_model, server.base_url)
        result = in_subprocess("run", "--config", path, timeout=900)  # own process, session's server
        assert result.rc == 0, result.err[-3000:]
        yield path, tmp / "runs/targeted", server


def test_the_step_runs_between_the_stages_with_the_model_stage2_starts_from(targeted):
    _, run_dir, _ = targeted
    history = [entry["stage"] for entry in read_history(run_dir)]
    assert history.index("train-stage1") < history.index("synth-stage2") < history.index("train-stage2")
    section = read_manifest(run_dir, "synth-stage2")["targeted"]
    assert section["model"] == str(run_dir / "train-stage1/model")
    assert set(section["datasets"]) == set(DATASETS)
    assert read_metadata(pq.read_schema(run_dir / "train-stage2" / LINEAGE_FILE))["upstream"] == "synth-stage2"


def test_dev_failures_select_training_records_only_and_the_llm_writes_for_those_alone(targeted):
    _, run_dir, server = targeted
    targets = pq.read_table(run_dir / "synth-stage2/_targets.parquet").to_pylist()
    dev = {r.id for t in read_records(run_dir, "prepare", kind="dev_records").values() for r in table_to_records(t)}
    training = {r.id for t in read_records(run_dir, "synthesize").values() for r in table_to_records(t)}
    assert 0 < len(targets) <= 9
    assert {t["dev_id"] for t in targets} <= dev and {t["record_id"] for t in targets} <= training
    assert not {t["record_id"] for t in targets} & dev
    assert len({t["dataset"] for t in targets}) >= 2  # the datasets take turns within the budget

    selected = {t["record_id"] for t in targets}
    made = [r for t in read_records(run_dir, "synth-stage2").values() for r in table_to_records(t)
            if r.origin != "original"]
    assert made and {r.id.rsplit("~", 1)[0] for r in made} <= selected  # <source id>~para (an LLM negative keeps the id)
    prompts = [b.get("prompt", "") for b in server.bodies]
    queries = {t["record_query"] for t in targets}
    assert len(prompts) >= len(selected) and all(any(q[:40] in p for q in queries) for p in prompts)


def test_the_step_reruns_from_the_llm_cache_without_a_request(targeted, capfd):
    path, run_dir, server = targeted
    before = server.total_calls
    result = in_process(capfd, "train", "--config", path, "--stage", "synth-stage2", "--force")
    assert result.rc == 0, result.err[-3000:]
    assert server.total_calls == before
    assert read_manifest(run_dir, "synth-stage2")["counts"]["client"]["requests"] == 0

"""Inputs are checked before use, through the real CLI: a stage refuses upstream artifacts and
trained models that differ from their manifests or are stale for its config (with the command to
run), a synthesize stage whose LLM server is down fails instead of committing, and a dataset filter
that names no source is a config error. Nothing already produced is lost."""

import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data
from tests.helpers.repo import add_tiny_stages


def _one_train_stage(config_path: Path, tmp_path: Path, *, evaluate: bool) -> tuple[dict, str]:
    """The demo config with one tiny train stage (no mine: training reads prepare's records)."""
    tiny = add_tiny_stages(config_path, tmp_path, evaluate=evaluate)
    raw = yaml.safe_load(config_path.read_text())
    raw.pop("mine")
    raw["train"]["stages"] = raw["train"]["stages"][:1]
    config_path.write_text(yaml.safe_dump(raw))
    return raw, tiny


def test_a_typo_in_mine_datasets_is_a_config_error_before_anything_runs(tmp_path, capfd):
    write_sts_data(tmp_path)
    config = write_config(tmp_path, [STS_SOURCE], mine={"datasets": ["stbs"]})
    in_process(capfd, "mine", "--config", config).assert_one_line_error(
        f"{config}: mine.datasets: no dataset 'stbs' (did you mean 'sts'? datasets are the names of prepare.sources: sts)")
    assert not (tmp_path / "runs").exists()


@pytest.mark.prefect
def test_evaluate_refuses_a_trained_model_whose_files_differ_from_its_manifest(tmp_path, capfd, tiny_model,
                                                                                prefect_harness):
    write_sts_data(tmp_path)
    stage = {"name": "stage1", "steps": 2, "batch_size": {"sts": 4}, "warmup_steps": 0, "query_max_length": 16,
             "passage_max_length": 16}
    config = write_config(tmp_path, [STS_SOURCE], train={"base_model": str(tiny_model), "max_length": 16,
                                                         "stages": [stage]},
                          evaluate={"base_model": str(tiny_model), "models": ["base", "trained"],
                                    "tasks": [{"name": "LocalSTS", "type": "sts", "path": STS_SOURCE["path"]}]})
    run_dir = tmp_path / "runs" / "r"
    assert in_process(capfd, "prepare", "--config", config).rc == 0
    assert in_process(capfd, "train", "--config", config).rc == 0
    weights = run_dir / "train-stage1" / "model" / "model.safetensors"
    shutil.copyfile(Path(tiny_model) / "model.safetensors", weights)  # the base model's weights swapped in

    in_process(capfd, "evaluate", "--config", config).assert_one_line_error(
        f"embedpipe: error: evaluate: {weights} is missing or changed since {run_dir}/train-stage1/manifest.json was "
        f"written; rerun that stage: `embedpipe train --stage stage1 --force --run-dir {run_dir}`")
    assert not (run_dir / "evaluate").exists()  # nothing scored, nothing released
    status = in_process(capfd, "status", "--run-dir", run_dir)
    assert "train-stage1       damaged" in status.out


@pytest.mark.prefect
def test_a_single_stage_run_refuses_an_upstream_stale_for_its_config_and_run_recomputes_it(demo_copy, tmp_path, capfd,
                                                                                          prefect_harness):
    raw, _ = _one_train_stage(demo_copy, tmp_path, evaluate=False)
    run_dir = tmp_path / "runs" / "demo"
    assert in_process(capfd, "prepare", "--config", demo_copy).rc == 0
    snapshot = (run_dir / "config.yaml").read_bytes()
    raw["prepare"]["cleaning"] = {"max_chars": 300}  # another prepare than the one that made the run dir's records
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(raw))

    in_process(capfd, "train", "--config", changed, "--run-dir", run_dir).assert_one_line_error(
        f"train-stage1: upstream stage prepare in {run_dir} is stale for this config: ",
        f"run `embedpipe prepare --run-dir {run_dir}` (with the same --config) first, or `embedpipe run`")
    assert not (run_dir / "train-stage1").exists()
    assert (run_dir / "config.yaml").read_bytes() == snapshot  # the new config is not recorded as used

    again = in_process(capfd, "run", "--config", changed, "--run-dir", run_dir)  # the pipeline recomputes upstream first
    assert again.rc == 0, again.err[-3000:]
    assert "prepare (computed)" in again.out and "train-stage1 (computed)" in again.out


@pytest.mark.prefect
def test_an_llm_server_that_is_down_fails_synthesize_instead_of_committing_it(demo_copy, tmp_path, capfd,
                                                                              prefect_harness):
    from tests.unit.embed_core.synthesize.test_synthesize import _server_cfg, closed_port

    url = f"http://127.0.0.1:{closed_port()}/v1"
    raw = yaml.safe_load(demo_copy.read_text())
    raw["prepare"]["sources"] = [s for s in raw["prepare"]["sources"] if s["name"] in ("scifact", "stsb", "banking77")]
    raw["synthesize"] = {**_server_cfg(url, server={"max_retries": 0}), "retry_delay_s": 0}
    demo_copy.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "runs" / "demo"
    assert in_process(capfd, "prepare", "--config", demo_copy).rc == 0

    # one line, after Prefect's task retry (which finds the server still down)
    failed = in_process(capfd, "synthesize", "--config", demo_copy)
    failed.assert_one_line_error(f"synthesize: 15 of 15 requests to {url} got no answer (first: connection: ",
                                 "more than synthesize.max_failed_share 0.5; nothing was committed")
    assert "Retry 1/1 will start immediately" in failed.out, failed.out[-3000:]
    assert not (run_dir / "synthesize").exists()
    status = in_process(capfd, "status", "--run-dir", run_dir)
    assert "synthesize         missing" in status.out


@pytest.mark.prefect
def test_an_llm_that_answers_only_prose_fails_synthesize_instead_of_committing_nothing(demo_copy, tmp_path, capfd,
                                                                                     prefect_harness):
    """Malformed answers are the model's, not an outage: beyond synthesize.max_malformed_share of
    them the stage fails with one line (it used to commit `synthesize (computed)` with 0 kept)."""
    from tests.helpers.llm_server import ScriptedLLMServer
    from tests.unit.embed_core.synthesize.test_synthesize import _server_cfg

    raw = yaml.safe_load(demo_copy.read_text())
    raw["prepare"]["sources"] = [s for s in raw["prepare"]["sources"] if s["name"] in ("scifact", "stsb", "banking77")]
    run_dir = tmp_path / "runs" / "demo"
    with ScriptedLLMServer(prose=True) as server:
        raw["synthesize"] = {**_server_cfg(server.base_url, max_parse_retries=0), "retry_delay_s": 0}
        demo_copy.write_text(yaml.safe_dump(raw))
        assert in_process(capfd, "prepare", "--config", demo_copy).rc == 0
        failed = in_process(capfd, "synthesize", "--config", demo_copy)
    failed.assert_one_line_error("synthesize: 15 of 15 answers of the generation model do not parse or validate",
                                 "it answered 'Sure! Here is a rewrite without JSON.'",
                                 "more than synthesize.max_malformed_share 0.9; nothing was committed")
    assert not (run_dir / "synthesize").exists()

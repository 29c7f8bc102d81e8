"""A flow run that fails on the user's input, read back from a real Prefect server as the UI shows
it: one ERROR line holding the CLI's text, no traceback, the state message that line, the run
named after the run. (That a bug keeps its traceback: tests/unit/flows/test_failures.py.)"""

import asyncio

import pytest
import yaml

from embed_core.errors import ConfigError, EmbedpipeError

pytestmark = pytest.mark.prefect


def _logs_and_run(flow_run_id):
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read():
        async with get_client() as client:
            run = await client.read_flow_run(flow_run_id)
            for _ in range(20):  # logs reach the server in batches, shortly after the run ends
                logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
                if any("Finished in state" in log.message for log in logs if log.task_run_id is None):
                    return run, logs
                await asyncio.sleep(0.5)
            return run, logs

    return asyncio.run(read())


def _broken_demo(demo_copy, tmp_path, **sections):
    cfg = yaml.safe_load(demo_copy.read_text())
    cfg.update(sections)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_misspelt_key_is_one_error_line_with_the_cli_text_and_the_run_keeps_its_name(prefect_harness, demo_copy,
                                                                                      tmp_path):
    from embed_core.config import load_config
    from flows.pipeline import pipeline_flow

    path = _broken_demo(demo_copy, tmp_path, run_name="typo-run",
                        train={"base_model": "m", "stages": [{"name": "first"}, {"name": "second", "setps": 3}]})
    with pytest.raises(ConfigError) as cli_error:  # the line `embedpipe run --config` prints after "error: "
        load_config(path)
    line = str(cli_error.value)
    assert line.endswith("train.stages[second].setps: Extra inputs are not permitted (did you mean 'steps'?)")

    state = pipeline_flow(config_path=str(path), return_state=True)
    run, logs = _logs_and_run(state.state_details.flow_run_id)
    assert state.is_failed() and state.message == line
    assert run.name == "typo-run"
    assert [log.message for log in logs if log.level >= 40] == [line]
    assert not any("Traceback" in log.message for log in logs)


def test_a_config_file_that_does_not_parse_names_the_run_after_the_file(prefect_harness, tmp_path):
    from flows.pipeline import pipeline_flow

    path = tmp_path / "nightly-scifact.yaml"
    path.write_text("prepare: [unclosed\n")
    state = pipeline_flow(config_path=str(path), return_state=True)
    run, logs = _logs_and_run(state.state_details.flow_run_id)
    assert state.is_failed() and state.message.startswith(str(path))
    assert run.name == "nightly-scifact"
    assert [log.message for log in logs if log.level >= 40] == [state.message]


def test_a_bad_source_inside_a_stage_task_is_one_error_line_and_is_not_retried(prefect_harness, demo_copy, tmp_path):
    from flows.pipeline import pipeline_flow

    cfg = yaml.safe_load(demo_copy.read_text())
    cfg["prepare"]["sources"][0]["path"] = "no/such/file.csv"
    path = _broken_demo(demo_copy, tmp_path, prepare=cfg["prepare"])
    state = pipeline_flow(config_path=str(path), return_state=True)
    _, logs = _logs_and_run(state.state_details.flow_run_id)
    errors = [log for log in logs if log.level >= 40]
    assert state.is_failed() and "no/such/file.csv" in state.message
    assert [log.message for log in errors] == [state.message]
    assert errors[0].task_run_id is not None  # logged where it happened: the prepare task's run
    assert not any("Traceback" in log.message or "Retry" in log.message for log in logs)
    with pytest.raises(EmbedpipeError, match="no/such/file.csv"):  # from Python, the flow raises it
        pipeline_flow(config_path=str(path))

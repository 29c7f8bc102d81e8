"""What the Prefect UI's run form shows: every description of the flows' parameters and of the
config they take renders as written (the UI treats descriptions as HTML, so ``<run_root>`` would
vanish)."""

import re

import pytest

ANGLE_BRACKETED = re.compile(r"<[A-Za-z_/.]")


def _descriptions(schema, path=""):
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "description" and isinstance(value, str):
                yield path, value
            else:
                yield from _descriptions(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for value in schema:
            yield from _descriptions(value, path)


def _flows():
    import flows.pipeline
    import flows.stage
    import flows.sweep
    import flows.watch
    from embed_core import stages

    return [flows.pipeline.pipeline_flow, flows.sweep.sweep_flow, flows.watch.data_watch_flow,
            *(flows.stage.stage_flow(s.name) for s in stages.all_stages())]


def test_no_description_in_a_flow_form_or_the_config_holds_text_in_angle_brackets():
    from prefect.utilities.callables import parameter_schema

    from embed_core.config import RunConfig

    schemas = [(flow.name, parameter_schema(flow.fn).model_dump()) for flow in _flows()]
    schemas.append(("RunConfig", RunConfig.model_json_schema()))  # what an inline config holds
    bad = [(name, path, text) for name, schema in schemas for path, text in _descriptions(schema)
           if ANGLE_BRACKETED.search(text)]
    assert bad == []


@pytest.mark.parametrize("name", ["pipeline", "train"])
def test_the_inline_config_is_a_partial_config_described_in_the_form(name):
    from prefect.utilities.callables import parameter_schema

    flow = next(f for f in _flows() if f.name == name)
    props = parameter_schema(flow.fn).model_dump()["properties"]
    assert "merged over config_path" in props["config"]["description"]
    assert "defaults to {run_root}/{run_name}" in props["run_dir"]["description"]


def test_the_scan_finds_an_angle_bracketed_name():
    assert [t for _, t in _descriptions({"a": {"description": "goes to <run_dir>/x"}}) if ANGLE_BRACKETED.search(t)]


def test_no_flow_form_shows_the_internal_parent_lock_parameter_which_a_stage_flow_still_takes():
    from prefect.utilities.callables import parameter_schema

    shown = {flow.name: set(parameter_schema(flow.fn).model_dump()["properties"]) for flow in _flows()}
    assert [name for name, props in shown.items() if "parent_lock" in props] == []
    assert {"config_path", "options"} <= shown["train"]  # the form itself is still there
    train = next(f for f in _flows() if f.name == "train")
    assert train.validate_parameters({"parent_lock": "run-1"})["parent_lock"] == "run-1"

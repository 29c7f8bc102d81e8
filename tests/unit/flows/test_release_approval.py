"""Which flow runs pause for a release decision (``release.approval``), read from Prefect's runtime
the way a worker sets it for a deployment run and its child flow runs."""

import pytest

from embed_core.config import parse_config
from flows.release import _duration, pauses_here

STS = {"name": "STS", "type": "sts", "path": "stsb/test.csv", "header": False,
       "columns": {"text1": 0, "text2": 1, "score": 2}}


def _config(approval: str):
    return parse_config({"prepare": {"sources": [{"name": "sts", "kind": "sts", "path": "stsb/train.csv"}]},
                         "evaluate": {"tasks": [STS]}, "release": {"approval": approval}})


@pytest.mark.parametrize("env, pauses", [
    ({}, False),  # the CLI: held for `embedpipe release promote`
    ({"PREFECT__RUNTIME__DEPLOYMENT__ID": "d-1"}, True),  # a deployment run (a schedule, the UI)
    ({"PREFECT__RUNTIME__FLOW_RUN__PARENT_DEPLOYMENT_ID": "d-1"}, True),  # the pipeline inside the data watch
])
def test_by_default_only_a_run_of_a_deployment_pauses(monkeypatch, env, pauses):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert pauses_here(_config("deployments")) is pauses
    assert pauses_here(_config("always")) is True
    assert pauses_here(_config("never")) is False


def test_the_timeout_is_written_in_the_unit_a_person_reads():
    assert [_duration(s) for s in (30, 600, 86400, 5400)] == ["30 s", "10 min", "24 h", "90 min"]

import pytest

from embed_core.config import parse_config
from embed_core.errors import ConfigError


def _raw(**release):
    task = {"name": "STS", "type": "sts", "path": "stsb/test.csv", "header": False,
            "columns": {"text1": 0, "text2": 1, "score": 2}}
    return {"prepare": {"sources": [{"name": "sts", "kind": "sts", "path": "stsb/train.csv"}]}, "evaluate": {"tasks": [task]}, "release": release}


def test_a_guard_task_that_is_not_an_evaluate_task_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match="release.guard_tasks: 'SciFact' is not an evaluate task \\(tasks: STS\\)"):
        parse_config(_raw(guard_tasks=["SciFact"]))
    assert parse_config(_raw(guard_tasks=["STS"])).release.guard_tasks == ["STS"]


def test_a_release_section_without_an_evaluate_section_enables_no_gate():
    from embed_core import stages

    raw = _raw(guard_tasks=["SciFact"])  # not checked: there are no evaluate tasks to name
    raw.pop("evaluate")
    assert "gate" not in [s.name for s in stages.enabled_stages(parse_config(raw))]
    assert "gate" in [s.name for s in stages.enabled_stages(parse_config(_raw()))]

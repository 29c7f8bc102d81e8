"""The train stage's extension points are tables, and what they decide is decided nowhere else: the
back end (``TrainConfig.backend_name``), the training mode (``embed_core.train.modes``) and the step
kind (``embed_core.train.stage.STEPS``)."""

import ast
import re
from pathlib import Path
from typing import get_args

import pytest

from tests.helpers.repo import REPO

LIBRARY = REPO / "embed_core"
BACKEND_DERIVATION = re.compile(r"deepspeed is (not )?None|sharding [!=]=")


def _hits(pattern: re.Pattern, allowed: set[tuple[Path, int]] = frozenset(), under: Path = LIBRARY) -> list[str]:
    out = []
    for path in sorted(under.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line) and (path, n) not in allowed:
                out.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    return out


def _function_lines(path: Path, name: str) -> set[tuple[Path, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    return {(path, n) for n in range(node.lineno, node.end_lineno + 1)}


def test_the_back_end_is_derived_from_sharding_and_deepspeed_in_one_function():
    config = LIBRARY / "train" / "config.py"
    inside = _function_lines(config, "backend_name")
    assert _hits(BACKEND_DERIVATION, inside) == []  # nowhere but there
    assert len(_hits(BACKEND_DERIVATION)) >= 1  # the scan finds the derivation itself: it can fail


@pytest.mark.parametrize(("sharding", "deepspeed", "name"), [
    ("none", None, "none"), ("fsdp", None, "fsdp"), ("none", {"zero_optimization": {"stage": 2}}, "deepspeed")])
def test_the_back_end_registry_answers_the_name_the_config_derives(sharding, deepspeed, name):
    from embed_core.train.config import TrainConfig
    from embed_core.train.engine.backends import backend_for

    train = TrainConfig(stages=[{"name": "s"}], sharding=sharding, deepspeed=deepspeed)
    assert train.backend_name() == name and backend_for(train).name == name


def test_fsdp_and_deepspeed_together_are_refused_by_the_one_derivation():
    from embed_core.train.config import TrainConfig

    with pytest.raises(ValueError, match="both shard the model"):
        TrainConfig(stages=[{"name": "s"}], sharding="fsdp", deepspeed={"zero_optimization": {"stage": 1}})


def test_every_training_mode_the_config_allows_has_one_table_entry():
    from embed_core.train.config import TrainMode
    from embed_core.train.modes import MODES

    assert set(MODES) == set(get_args(TrainMode))
    assert [m for m in MODES.values() if m.no_probe is None] == [MODES["contrastive"]]


def test_no_module_tests_a_stage_mode_by_name_outside_the_mode_table():
    mode_test = re.compile(r"\b(stage|s)\.mode\s*(==|!=|in\b)|\.mode\s*(==|!=)\s*\"(contrastive|autoregembed)")
    assert _hits(mode_test) == []


def test_no_module_of_the_library_tells_step_kinds_apart_by_name_outside_the_step_table():
    stage = LIBRARY / "train" / "stage.py"
    allowed = _function_lines(stage, "step_kind")
    prefix_tests = re.compile(r"is_(train|remine|synth)_instance\(|startswith\(\w*PREFIX|startswith\(kind\.prefix|"
                              r"startswith\(\(?\s*(\"|')(train|mine|synth|reference)-")
    assert _hits(prefix_tests, allowed, LIBRARY) == []
    assert len(_hits(prefix_tests)) >= 1  # the scan finds step_kind's own test: it can fail


def test_the_train_stage_never_asks_the_trainer_for_an_attribute_it_may_lack():
    train = LIBRARY / "train"
    files = [p for p in train.rglob("*.py")]  # the stage and its engine (checkpoints, back ends)
    found = [f"{p.name}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"(getattr|hasattr)\(\s*(trainer|outcome)", line)]
    assert files and found == []


def test_a_manifest_names_its_step_kind_and_one_written_before_is_read_by_its_sections():
    from embed_core.train.stage import REMINE, SYNTHESIS, TRAIN, manifest_kind

    assert manifest_kind({"step": "train", "stage_name": "s"}) is TRAIN
    assert manifest_kind({"step": "synth"}) is SYNTHESIS and manifest_kind({"step": "remine"}) is REMINE
    assert manifest_kind({"stage_name": "s", "steps": 3}) is TRAIN
    assert manifest_kind({"targeted": {"datasets": {}}}) is SYNTHESIS
    assert manifest_kind({"counts": {}}) is REMINE


def test_a_stages_steps_follow_the_step_table_in_order():
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.stage import STEPS, stage_steps, step_kind

    plain = TrainStageConfig(name="s2", steps=1)
    assert stage_steps(plain) == ["train-s2"]
    assert [step_kind(i).name for i in ("mine-s2", "synth-s2", "value-s2", "train-s2")] == [k.name for k in STEPS]
    assert [k.all_ranks for k in STEPS] == [False, False, False, True]
    gated = TrainStageConfig(name="s2", steps=1, remine={}, data_value={},
                             dev={"tasks": [{"name": "d", "type": "sts", "dataset": "a"}]})
    assert stage_steps(gated) == ["mine-s2", "value-s2", "train-s2"]

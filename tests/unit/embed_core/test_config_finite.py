"""Every float of a config is finite (issue 62): a NaN or an infinity anywhere — a field, a list
item, a dict value — is refused at load with one line naming the key; weights that sum to nothing
are refused too."""

from __future__ import annotations

import copy
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from embed_core.config import parse_config
from embed_core.errors import ConfigError
from tests.helpers.repo import REPO


def _demo_with_every_float() -> dict:
    """The demo config, with the float dicts and lists set, as a full dump (every default written)."""
    raw = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    stage = raw["train"]["stages"][0]
    stage.update(dataset_weight={"stsb": 1.0}, origin_weight={"original": 1.0},
                 matryoshka={"dims": [32, 16], "weights": [1.0, 0.5]})
    return parse_config(raw).model_dump(mode="json", exclude_none=False)


FULL = _demo_with_every_float()


def _float_paths(node, path=()):
    if isinstance(node, float):
        yield path
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _float_paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _float_paths(v, (*path, i))


PATHS = sorted(_float_paths(FULL), key=str)


def test_the_full_demo_config_has_floats_in_fields_lists_and_dicts():
    kinds = {type(p[-1]) for p in PATHS}
    assert len(PATHS) > 30 and kinds == {str, int}  # dict keys and list positions among them


@settings(max_examples=60, deadline=None)
@given(path=st.sampled_from(PATHS), value=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_a_non_finite_float_anywhere_is_refused_in_one_line_naming_its_key(path, value):
    raw = copy.deepcopy(FULL)
    node = raw
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    message = str(info.value)
    assert "\n" not in message and "finite" in message
    assert str(path[-1]) in message or f"[{path[-1]}]" in message or "." in message, message


@pytest.mark.parametrize("yaml_text, key", [
    ("matryoshka: {dims: [32, 16], weights: [.nan, 1.0]}", "matryoshka.weights.0"),
    ("dataset_weight: {stsb: .nan}", "dataset_weight.stsb"),
    ("origin_weight: {original: .inf}", "origin_weight.original"),
])
def test_the_non_finite_weights_users_wrote_are_refused_naming_the_key(yaml_text, key):
    raw = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    raw["train"]["stages"][0].update(yaml.safe_load(yaml_text))
    with pytest.raises(ConfigError, match="Input should be a finite number") as info:
        parse_config(raw)
    assert key in str(info.value)


def test_matryoshka_weights_that_are_all_zero_are_refused():
    raw = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    raw["train"]["stages"][0]["matryoshka"] = {"dims": [32, 16], "weights": [0.0, 0.0]}
    with pytest.raises(ConfigError, match="all 0, so nothing would train"):
        parse_config(raw)

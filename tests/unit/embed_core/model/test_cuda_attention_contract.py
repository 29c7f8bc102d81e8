"""What a decoder made bidirectional asks of its attention kernel, seen on a CPU: an attention
registered with transformers' ``AttentionInterface`` records the ``is_causal`` flag and mask of
every call (the flag FlashAttention-2 runs with on a GPU), for each architecture of the QZhou
family; a kernel that stays causal whatever it is asked (FlashAttention-2 before transformers 5.2)
is caught at load for every type; and the transformers range is one fact, checked at load."""

from pathlib import Path

import pytest
import torch

from embed_core.errors import ConfigError
from embed_core.model.compat import TRANSFORMERS_RANGE, transformers_problem
from embed_core.model.embedder import BIDIRECTIONAL_CHECKED, Embedder
from tests.helpers import attention_probe
from tests.helpers.tiny_model import build_tiny_decoder

ARCHS = sorted(BIDIRECTIONAL_CHECKED)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    attention_probe.register()


def test_pyproject_requires_the_transformers_range_the_code_checks():
    import tomllib

    deps = tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers{TRANSFORMERS_RANGE}" in deps
    assert transformers_problem("5.1.9") is not None  # the range starts where is_causal reaches every kernel


@pytest.mark.parametrize("version", ["4.45.0", "4.57.3", "5.1.0", "6.0.0"])
def test_a_transformers_outside_the_range_is_refused_in_one_line_that_says_what_to_install(version):
    problem = transformers_problem(version)
    assert problem is not None and "\n" not in problem
    assert version in problem and f"pip install 'transformers{TRANSFORMERS_RANGE}'" in problem


@pytest.mark.parametrize("version", ["5.2.0", "5.25.0"])
def test_a_transformers_inside_the_range_is_accepted(version):
    assert transformers_problem(version) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_every_attention_call_of_a_bidirectional_decoder_is_asked_to_be_non_causal(tmp_path, tiny_model, arch):
    path = build_tiny_decoder(tmp_path / arch, arch, tiny_model)
    m = Embedder(str(path), pooling="mean", bidirectional=True, attn_implementation=attention_probe.PROBE).eval()
    attention_probe.RECORDED.calls.clear()
    features = m.tokenize(["one two three four five"])  # no padding: any mask left is the causal pattern
    with torch.no_grad():
        m(features)
    calls = attention_probe.RECORDED.calls
    layers = m.model.config.num_hidden_layers
    assert len(calls) == layers, (arch, len(calls))
    for call in calls:
        assert call.is_causal is False, (arch, call.is_causal)  # what FlashAttention would run with
        if call.mask is not None:  # SDPA's boolean mask: the first token must see the last
            assert bool(call.mask[..., 0, -1].all()), arch


@pytest.mark.parametrize("arch", ARCHS)
def test_a_kernel_that_stays_causal_is_caught_at_load_for_every_decoder_type(tmp_path, tiny_model, arch):
    path = build_tiny_decoder(tmp_path / arch, arch, tiny_model)
    with pytest.raises(ConfigError, match="still runs causally") as info:
        Embedder(str(path), pooling="mean", bidirectional=True, attn_implementation=attention_probe.CAUSAL_ONLY)
    assert "\n" not in str(info.value)
    Embedder(str(path), pooling="mean", bidirectional=False, attn_implementation=attention_probe.CAUSAL_ONLY)


def test_every_place_that_states_the_transformers_range_states_the_same_one():
    import re

    from tests.helpers.repo import REPO

    stated = {}
    for path in [*REPO.glob("embed_core/**/*.py"), *REPO.glob("deployments/**/*"), REPO / "pyproject.toml",
                 REPO / "Makefile", *REPO.glob("docs/*.md")]:
        if path.is_file():
            for found in re.findall(r"transformers\s*(>=[0-9][0-9.,<>=]*[0-9])", path.read_text(errors="replace")):
                stated.setdefault(found, []).append(str(path.relative_to(REPO)))
    assert set(stated) == {TRANSFORMERS_RANGE}, stated

"""Which attention a trained model runs with: a flash-attn wheel that is found but does not import
(built for another torch) leaves ``auto`` on SDPA and refuses ``flash_attention_2`` in one line;
``flex_attention`` packs a group with a block-sparse document mask and gives the padded SDPA
embeddings (compiled FlexAttention, on the CPU here)."""

import sys

import pytest
import torch

from embed_core.errors import ConfigError
from embed_core.model.packing import resolve_attention


@pytest.fixture
def broken_flash_attn(tmp_path, monkeypatch):
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)


def test_a_flash_attn_wheel_that_does_not_import_leaves_auto_on_sdpa(broken_flash_attn):
    import importlib.util

    assert importlib.util.find_spec("flash_attn") is not None  # found, as a broken wheel is
    assert resolve_attention("auto", "cuda") is None
    with pytest.raises(ConfigError, match="flash-attn package that imports") as info:
        resolve_attention("flash_attention_2", "cuda")
    assert "\n" not in str(info.value)


def test_flex_attention_is_taken_as_named():
    assert resolve_attention("flex_attention", "cuda") == "flex_attention"


@pytest.mark.slow
def test_a_packed_group_under_flex_attention_embeds_as_the_padded_sdpa_group(tmp_path, tiny_model):
    from embed_core.model.embedder import Embedder
    from tests.helpers.tiny_model import build_tiny_decoder

    path = build_tiny_decoder(tmp_path / "qwen3", "qwen3", tiny_model)
    texts = ["a short one", "a much longer text than the other one, with more words in it", "x"]
    sdpa = Embedder(str(path), pooling="mean", bidirectional=True).eval()
    flex = Embedder(str(path), pooling="mean", bidirectional=True, attn_implementation="flex_attention").eval()
    features = sdpa.tokenize(texts)
    packed = flex.pack(features)
    assert packed is not None and packed["input_ids"].size(0) < len(texts)  # rows shared by texts
    with torch.no_grad():
        torch.testing.assert_close(flex(packed), sdpa(features), atol=1e-5, rtol=1e-5)

"""CPU inference: oneDNN's packed fp32 linear layers give the plain model's embeddings, and the
encoder caps oneDNN's primitive cache (what keeps bf16 encoding memory flat) unless the user set it."""

import os

import pytest
import torch
from transformers import AutoModel

from embed_core.model.cpu_inference import PackedLinear, onednn_linear_available
from embed_core.model.encoder import Encoder
from embed_core.model.onednn import ONEDNN_CACHE_CAPACITY, ONEDNN_CACHE_ENV
from tests.helpers.tiny_model import build_tiny_gemma

TEXTS = ["a short one", "a somewhat longer sentence about hard negatives and mining",
         "query: what is dense retrieval?", "x " * 90, "the same words, the same words, in another order"]

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")


def _plain_encoder(path, **kwargs) -> Encoder:
    """The same encoder with the model as transformers loads it (nn.Linear, separate GELU)."""
    enc = Encoder(str(path), precision="fp32", device="cpu", **kwargs)
    enc.model = AutoModel.from_pretrained(enc.path).eval()
    return enc


@needs_onednn
def test_fp32_cpu_encoder_packs_every_linear_layer_and_fuses_the_feed_forward_gelu(tiny_model):
    enc = Encoder(str(tiny_model), precision="fp32", device="cpu")
    layers = [m for m in enc.model.modules() if isinstance(m, PackedLinear)]
    assert enc.packed_layers == len(layers) > 0
    assert not [m for m in enc.model.modules() if isinstance(m, torch.nn.Linear)]
    fused = [m for m in layers if m.activation == "gelu"]
    assert len(fused) == enc.model.config.num_hidden_layers  # one feed-forward projection per layer


@needs_onednn
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_packed_linear_computes_the_linear_layer_and_its_exact_gelu(activation):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    x = torch.randn(3, 7, 64) * 2  # pre-activations of several units: erf and tanh GELU differ there
    expected = linear(x) if activation == "none" else torch.nn.functional.gelu(linear(x))
    with torch.inference_mode():
        got = PackedLinear(linear, activation)(x)
    assert got.shape == expected.shape and (got - expected).abs().max() < 1e-5


@needs_onednn
def test_packed_fp32_encoder_gives_the_plain_models_embeddings(tiny_model):
    packed = Encoder(str(tiny_model), precision="fp32", device="cpu").encode(TEXTS, batch_size=2)
    plain = _plain_encoder(tiny_model).encode(TEXTS, batch_size=2)
    assert abs(packed - plain).max() < 1e-5


@needs_onednn
def test_packed_decoder_without_biases_gives_the_plain_models_embeddings(tmp_path):
    gemma = build_tiny_gemma(tmp_path / "gemma")
    enc = Encoder(str(gemma), pooling="last_token", precision="fp32", device="cpu")
    assert enc.packed_layers > 0
    plain = _plain_encoder(gemma, pooling="last_token")
    assert abs(enc.encode(TEXTS) - plain.encode(TEXTS)).max() < 1e-5


def test_bf16_encoder_keeps_its_linear_layers_for_autocast(tiny_model):
    enc = Encoder(str(tiny_model), precision="bf16", device="cpu")
    assert enc.packed_layers == 0 and any(isinstance(m, torch.nn.Linear) for m in enc.model.modules())


def test_encoder_caps_onednns_primitive_cache_unless_the_user_set_it(tiny_model, monkeypatch):
    monkeypatch.delenv(ONEDNN_CACHE_ENV, raising=False)
    Encoder(str(tiny_model), precision="fp32", device="cpu")
    assert os.environ[ONEDNN_CACHE_ENV] == str(ONEDNN_CACHE_CAPACITY)
    monkeypatch.setenv(ONEDNN_CACHE_ENV, "256")
    Encoder(str(tiny_model), precision="fp32", device="cpu")
    assert os.environ[ONEDNN_CACHE_ENV] == "256"

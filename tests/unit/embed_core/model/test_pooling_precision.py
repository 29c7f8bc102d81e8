"""Pooling keeps fp32 sums whatever the hidden states' dtype (FSDP2's bf16 parameters, a bf16 LoRA
base): packed and padded, every pooling mode, texts of 300 and more tokens, against an exact
reference over the same bf16 states — on the CPU's kernels and with CUDA's bf16 atomic adds
emulated (``tests/helpers/bf16_atomics.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embed_core.model.encoder import pool_hidden
from embed_core.model.packing import pack_features, pool_packed
from tests.helpers.bf16_atomics import CudaAccumulation, sequential_bf16_index_add

LENGTHS = [300, 512, 40, 7, 333]
HIDDEN = 384


def _padded(lengths=LENGTHS, hidden=HIDDEN, seed=0):
    """Padded features and bf16 hidden states [B, L, H] like a decoder's: a shared offset per
    channel (hidden states are far from zero-mean) plus per-token noise."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    features = {"input_ids": torch.randint(5, 1000, (len(lengths), width), generator=g) * mask,
                "attention_mask": mask, "pool_mask": mask.clone()}
    offset = torch.randn(hidden, generator=g) * 4
    states = (offset + torch.randn(len(lengths), width, hidden, generator=g)).bfloat16()
    return features, states


def _exact_means(features, states):
    m = features["pool_mask"].unsqueeze(-1).double()
    return (states.double() * m).sum(1) / m.sum(1)


def _packed_states(features, states):
    packed = pack_features(features, varlen=False)
    rows, width = packed["segment_ids"].shape
    flat = torch.zeros(rows * width, states.size(-1), dtype=states.dtype)
    lengths = features["attention_mask"].sum(1)
    within = torch.cat([torch.arange(int(n)) for n in lengths])
    flat[packed["token_index"]] = states[packed["token_text"], within]
    return packed, flat.view(rows, width, -1)


def _error(pooled, exact):
    """Largest relative error of a text's pooled vector, and largest 1 - cos."""
    rel = ((pooled.double() - exact).norm(dim=-1) / exact.norm(dim=-1)).max().item()
    cos = F.cosine_similarity(pooled.double(), exact, dim=-1).min().item()
    return rel, 1 - cos


def test_the_emulated_cuda_bf16_adds_lose_what_an_fp32_accumulator_keeps():
    # the emulation must be able to fail the tests below: 512 rounded adds drift well past 1e-3
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(HIDDEN, generator=g) * 4 + torch.randn(512, HIDDEN, generator=g)).bfloat16()
    exact = rows.double().sum(0)
    index = torch.zeros(512, dtype=torch.long)
    bf16 = sequential_bf16_index_add(torch.zeros(1, HIDDEN, dtype=torch.bfloat16), 0, index, rows)[0]
    fp32 = torch.zeros(1, HIDDEN).index_add_(0, index, rows.float())[0]
    assert _error(bf16[None], exact[None])[0] > 1e-2
    assert _error(fp32[None], exact[None])[0] < 1e-6


def test_packed_mean_pooling_of_bf16_states_matches_the_exact_mean_for_texts_of_300_tokens_and_more():
    features, states = _padded()
    packed, hidden = _packed_states(features, states)
    pooled = pool_packed(hidden, packed, "mean")
    assert pooled.dtype == torch.float32
    rel, one_minus_cos = _error(pooled, _exact_means(features, states))
    assert rel < 1e-3 and one_minus_cos < 1e-6, (rel, one_minus_cos)


def test_packed_mean_pooling_stays_exact_when_adds_round_as_cudas_bf16_atomics_do():
    features, states = _padded(seed=2)
    packed, hidden = _packed_states(features, states)
    with CudaAccumulation() as mode:
        pooled = pool_packed(hidden, packed, "mean")
    assert mode.accumulators and set(mode.accumulators) == {torch.float32}
    rel, one_minus_cos = _error(pooled, _exact_means(features, states))
    assert rel < 1e-3 and one_minus_cos < 1e-6, (rel, one_minus_cos)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last_token"])
def test_padded_and_packed_pooling_of_bf16_states_agree_with_fp32_pooling_in_every_mode(pooling):
    features, states = _padded(seed=3)
    packed, hidden = _packed_states(features, states)
    reference = pool_hidden(states.float(), features["attention_mask"], pooling)
    with CudaAccumulation():
        padded = pool_hidden(states, features["attention_mask"], pooling)
        packed_out = pool_packed(hidden, packed, pooling)
    for out in (padded, packed_out):
        rel, _ = _error(out, reference.double())
        assert rel < 1e-3, (pooling, rel)


def test_padded_mean_pooling_sums_in_fp32_under_bf16_states():
    features, states = _padded(seed=4)
    with CudaAccumulation() as mode:
        pooled = pool_hidden(states, features["pool_mask"], "mean")
    assert pooled.dtype == torch.float32 and set(mode.accumulators) == {torch.float32}
    rel, one_minus_cos = _error(pooled, _exact_means(features, states))
    assert rel < 1e-3 and one_minus_cos < 1e-6

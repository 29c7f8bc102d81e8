"""Bulk-drawn dropout for CPU training: the masks torch's dropout would draw (each element dropped
with probability p, independently), the same zeroing and scaling forward and backward, the same
attention and gradients however its rows are chunked, and nothing of it in a saved model."""

import json

import pytest
import torch

from embed_core.model.bulk_dropout import NAME, BulkDropout, attention, bulk_dropout, drop_mask, use_bulk_dropout
from tests.helpers.tiny_model import build_tiny_bert, build_tiny_causal_lm


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_a_mask_drops_each_element_with_probability_p_and_neighbours_independently(p):
    torch.manual_seed(0)
    mask = drop_mask((1000, 1000), p)
    assert mask.dtype == torch.bool and mask.shape == (1000, 1000)
    # binomial over 10^6 elements: standard deviation <= 0.0005, so 0.003 is six of them
    assert abs(mask.float().mean().item() - p) < 0.003
    # two neighbours share one 64-bit draw: both dropped as often as independent draws would be
    pairs = mask.reshape(-1, 2)
    assert abs((pairs[:, 0] & pairs[:, 1]).float().mean().item() - p * p) < 0.003
    assert abs((mask[:, 1:] & mask[:, :-1]).float().mean().item() - p * p) < 0.003


def test_torchs_seed_fixes_the_masks_and_each_draw_is_new():
    torch.manual_seed(7)
    a, b = drop_mask((64, 64), 0.1), drop_mask((64, 64), 0.1)
    torch.manual_seed(7)
    assert torch.equal(drop_mask((64, 64), 0.1), a) and torch.equal(drop_mask((64, 64), 0.1), b)
    assert not torch.equal(a, b)
    # an odd count of elements: the last 64-bit draw is half used
    assert drop_mask((3, 5, 7), 0.3).shape == (3, 5, 7)


def test_dropout_zeroes_the_dropped_scales_the_kept_by_1_over_1_minus_p_and_so_does_its_gradient():
    torch.manual_seed(0)
    x = (torch.rand(50, 40) + 0.5).requires_grad_(True)
    y = bulk_dropout(x, 0.2, True)
    kept = y != 0
    assert 0.7 < kept.float().mean().item() < 0.9
    assert torch.allclose(y[kept], x.detach()[kept] / 0.8)
    (y * 3).sum().backward()
    assert torch.allclose(x.grad, kept.float() * 3 / 0.8)


def test_in_evaluation_or_at_p_0_dropout_is_the_identity_and_at_p_1_zero():
    x = torch.randn(4, 5)
    assert bulk_dropout(x, 0.1, False) is x and bulk_dropout(x, 0.0, True) is x
    assert torch.equal(bulk_dropout(x, 1.0, True), torch.zeros_like(x))
    module = BulkDropout(0.3).eval()
    assert module(x) is x


def _qkv(heads: int = 4, kv_heads: int = 4):
    torch.manual_seed(1)
    return (torch.randn(2, heads, 6, 8), torch.randn(2, kv_heads, 6, 8), torch.randn(2, kv_heads, 6, 8))


def test_the_attention_is_softmax_of_scaled_scores_plus_mask_dropped_with_the_drawn_mask_times_v():
    q, k, v = _qkv()
    module = torch.nn.Module().train()
    # SDPA's boolean mask: the second text's last two keys are padding
    attends = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    attends[1, :, :, 4:] = False
    torch.manual_seed(5)
    out, weights = attention(module, q, k, v, attends, dropout=0.25, scaling=0.3)
    torch.manual_seed(5)
    dropped = drop_mask((2, 4, 6, 6), 0.25)
    scores = (q @ k.transpose(2, 3)) * 0.3
    probs = torch.softmax(scores.masked_fill(~attends, float("-inf")), dim=-1).masked_fill(dropped, 0) / 0.75
    assert weights is None
    assert torch.allclose(out, (probs @ v).transpose(1, 2), atol=1e-6)
    # the padded keys get nothing, whatever their values
    v_far = v.clone()
    v_far[1, :, 4:] = 1e6
    torch.manual_seed(5)
    assert torch.allclose(attention(module, q, k, v_far, attends, dropout=0.25, scaling=0.3)[0], out, atol=1e-5)


@pytest.mark.parametrize("length", [300, 20])
@pytest.mark.parametrize("per_head", [False, True])
def test_the_attentions_output_and_gradients_are_the_formulas_whichever_texts_and_heads_a_chunk_holds(per_head,
                                                                                                      length):
    from embed_core.model.bulk_dropout import CHUNK_SCORES, _chunks

    torch.manual_seed(2)
    batch, heads = 2, 4
    # 300² scores a head: two heads of one text a chunk, four chunks; 20²: both texts in one chunk
    assert len(_chunks(batch, heads, length * length)) == (4 if length == 300 else 1)
    assert 2 * 300 * 300 <= CHUNK_SCORES < 4 * 300 * 300
    q, k, v = (torch.randn(batch, length, heads, 8).transpose(1, 2).requires_grad_(True) for _ in range(3))
    # an additive mask, one for all heads or one per head (padding, and a different key per head)
    bias = torch.zeros(batch, heads if per_head else 1, length, length)
    bias[1, :, :, length * 5 // 6:] = torch.finfo(torch.float32).min
    if per_head:
        for h in range(heads):
            bias[0, h, :, h] = torch.finfo(torch.float32).min
    module = torch.nn.Module().train()
    torch.manual_seed(9)
    out = attention(module, q, k, v, bias, dropout=0.2, scaling=0.25)[0]
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    torch.manual_seed(9)
    dropped = drop_mask((batch, heads, length, length), 0.2)
    probs = torch.softmax(q @ k.transpose(2, 3) * 0.25 + bias, dim=-1).masked_fill(dropped, 0) / 0.8
    expected = (probs @ v).transpose(1, 2)
    assert torch.allclose(out, expected, atol=1e-5)
    for ours, theirs in zip(grads, torch.autograd.grad((expected * weights).sum(), (q, k, v))):
        assert torch.allclose(ours, theirs, atol=1e-4)


def test_under_bf16_autocast_the_attention_computes_in_fp32_and_returns_the_querys_dtype():
    q, k, v = (t.bfloat16().requires_grad_(True) for t in _qkv())
    module = torch.nn.Module().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(4)
        out = attention(module, q, k, v, None, dropout=0.1)[0]
    torch.manual_seed(4)
    reference = attention(module, q.float(), k.float(), v.float(), None, dropout=0.1)[0]
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), reference, atol=1e-2)
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and q.grad.abs().sum() > 0


def test_without_dropout_or_with_grouped_key_value_heads_the_attention_is_sdpas():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module().train()
    module.is_causal = False
    q, k, v = _qkv()
    assert torch.allclose(attention(module, q, k, v, None, dropout=0.0)[0],
                          sdpa_attention_forward(module, q, k, v, None, dropout=0.0)[0])
    q, k, v = _qkv(heads=4, kv_heads=2)
    module.num_key_value_groups = 2
    torch.manual_seed(3)
    ours = attention(module, q, k, v, None, dropout=0.5)[0]
    torch.manual_seed(3)
    assert torch.equal(ours, sdpa_attention_forward(module, q, k, v, None, dropout=0.5)[0])


def test_a_bert_with_dropout_gets_bulk_dropout_and_attention_and_saves_and_encodes_as_before(tmp_path):
    from transformers import AutoModel

    path = build_tiny_bert(tmp_path / "bert", dropout=0.1)
    model, plain = AutoModel.from_pretrained(path), AutoModel.from_pretrained(path)
    dropouts = sum(type(m) is torch.nn.Dropout for m in model.modules())
    assert use_bulk_dropout(model) == dropouts > 0
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())
    assert model.config._attn_implementation == NAME
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102], [101, 7592, 102, 0, 0, 0]])
    mask = (ids != 0).long()
    model.eval(), plain.eval()
    with torch.no_grad():  # evaluation: no dropout, SDPA, the padding masked
        assert torch.allclose(model(input_ids=ids, attention_mask=mask).last_hidden_state,
                              plain(input_ids=ids, attention_mask=mask).last_hidden_state, atol=1e-5)
    model.train()
    torch.manual_seed(0)
    a = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.manual_seed(0)
    assert torch.equal(model(input_ids=ids, attention_mask=mask).last_hidden_state, a)
    a.sum().backward()
    assert model.embeddings.word_embeddings.weight.grad.abs().sum() > 0
    model.save_pretrained(tmp_path / "saved")
    assert NAME not in (tmp_path / "saved" / "config.json").read_text()
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["attention_probs_dropout_prob"] == 0.1
    reloaded = AutoModel.from_pretrained(tmp_path / "saved").eval()
    assert reloaded.config._attn_implementation == "sdpa"


def test_models_without_dropout_keep_their_modules_and_sdpa(tmp_path):
    from transformers import AutoModel

    for path in (build_tiny_bert(tmp_path / "bert", dropout=0.0), build_tiny_causal_lm(tmp_path / "qwen3")):
        model = AutoModel.from_pretrained(path)
        assert use_bulk_dropout(model) == 0
        assert model.config._attn_implementation == "sdpa"

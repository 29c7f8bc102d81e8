"""Dropout on the CPU with its random bits drawn in bulk, and an attention that drops them a few
heads at a time.

torch's CPU dropout draws one Bernoulli sample at a time from its Mersenne Twister (``bernoulli_``,
a serial kernel on this CPU class), and the attention-probability dropout of a BERT encoder draws
``batch · heads · length²`` of them per layer: on a 2-core AVX2 EPYC it was 18 % of a MiniLM training
step on 256-token passages (docs/experiments.md). Here the same masks — each element dropped
independently with probability ``p``, the rest scaled by ``1 / (1 - p)`` — come from numpy's PCG64,
which writes 64 random bits per call (two elements: each a 32-bit uniform compared with
``round(p · 2³²)``, so ``p`` is exact to 2⁻³²). Each mask's PCG64 seed is one draw from torch's default
generator, so ``torch.manual_seed`` fixes the masks and a checkpoint's torch RNG state resumes them.
A mask is applied by multiplying with it (``masked_fill`` is several times slower on the CPU).

With dropout, SDPA on the CPU falls back to its math path: a pass over the layer's whole
``batch · heads · length²`` probabilities for each of the mask, softmax and dropout, and as many
in the backward. ``attention`` instead computes a chunk at a time (as many whole texts, or heads of
one long text, as keep ``CHUNK_SCORES`` scores together), so a chunk's scores stay in the cache
between those passes; it keeps the fp32 probabilities and a byte mask for the backward.

The trainer swaps these in for training on the CPU only (``use_bulk_dropout``): CUDA's dropout is
fused and fast. The attention function keeps transformers' SDPA wherever it has no dropout to apply
(evaluation, ``p = 0``) or a shape this path does not handle (grouped key/value heads, a causal
attention without a mask). Its mask is transformers' eager one, additive, built once per forward
pass rather than converted from SDPA's boolean mask in every layer (SDPA takes either). Saved models
carry none of it: the modules hold no weights and the attention implementation is not written to
``config.json``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

NAME = "sdpa_bulk_dropout"


def _generator() -> np.random.Generator:
    """A PCG64 generator seeded by one draw from torch's default generator."""
    return np.random.Generator(np.random.PCG64(int(torch.randint(0, 2**62, (1,)))))


def _kept(generator: np.random.Generator, n: int, p: float, out: Tensor | None = None) -> Tensor:
    """``n`` booleans (into ``out``, else a new tensor), each False (dropped) with probability ``p``: one
    32-bit uniform per element. numpy compares, into memory torch allocated (so torch's memory
    profiler, and the planner's validation, count the mask)."""
    out = torch.empty(n, dtype=torch.bool) if out is None else out
    bits = generator.bit_generator.random_raw((n + 1) // 2)
    np.greater_equal(bits.view(np.int32)[:n], -(2**31) + round(p * 2**32), out=out.numpy().reshape(-1))
    return out


def _scaled(kept: Tensor, scale: float) -> Tensor:
    """The float multiplier of a kept mask: ``scale`` where kept, 0 where dropped (a multiplication by
    it is several times faster on the CPU than ``masked_fill`` with the mask)."""
    return kept.view(torch.uint8).to(torch.float32).mul_(scale)


def drop_mask(shape: torch.Size | tuple[int, ...], p: float) -> Tensor:
    """A boolean tensor of ``shape``: True (dropped) with probability ``p``, independently."""
    return ~_kept(_generator(), math.prod(shape), p).view(tuple(shape))


class _Dropped(torch.autograd.Function):
    """``x`` with the masked elements zeroed and the rest scaled; the backward applies the same mask
    (kept as one byte an element, not as a float tensor like torch's dropout)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, p: float) -> Tensor:
        kept = _kept(_generator(), x.numel(), p).view(x.shape)
        ctx.save_for_backward(kept)
        ctx.scale = 1.0 / (1.0 - p)
        return x * _scaled(kept, ctx.scale).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (kept,) = ctx.saved_tensors
        return grad * _scaled(kept, ctx.scale).to(grad.dtype), None


def bulk_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``torch.nn.functional.dropout`` with bulk-drawn masks (CPU tensors)."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return torch.zeros_like(x)
    return _Dropped.apply(x, p)


class BulkDropout(nn.Dropout):
    """``nn.Dropout`` whose masks are drawn in bulk."""

    def forward(self, x: Tensor) -> Tensor:
        return bulk_dropout(x, self.p, self.training)


class _DroppedAttention(torch.autograd.Function):
    """``softmax(q·kᵀ·scale + bias)``, dropped with bulk-drawn masks, times ``v``, for ``(rows, length,
    head_dim)`` inputs (rows = batch · heads), in fp32, computed a chunk of rows at a time (``_chunks``) so
    that each chunk's scores stay in the CPU's cache between the passes over them. The probabilities (fp32)
    and the drop mask (a byte) are what is kept for the backward, which recomputes the dropped
    probabilities chunk by chunk and folds the scales into the products."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, heads: int, scale: float,
                p: float) -> Tensor:
        rows, lq, lk = q.shape[0], q.shape[1], k.shape[1]
        chunks = _chunks(rows // heads, heads, lq * lk)
        probs, out = q.new_empty(rows, lq, lk), q.new_empty(rows, lq, v.shape[2])
        kept = torch.empty(rows, lq, lk, dtype=torch.bool)
        most = max(c.stop - c.start for c, _, _ in chunks)
        scores, keep = q.new_empty(most, lq, lk), q.new_empty(most, lq, lk)  # reused: no page faults
        generator, keep_scale = _generator(), 1.0 / (1.0 - p)
        for c, texts, head in chunks:
            n = c.stop - c.start
            torch.bmm(q[c], k[c].transpose(1, 2), out=scores[:n])
            if bias is None:
                scores[:n].mul_(scale)
            else:  # bias + scale · scores, the bias broadcast over the chunk's texts and heads
                by_text = scores[:n].view(texts.stop - texts.start, -1, lq, lk)
                torch.add(_bias_of(bias, texts, head), by_text, alpha=scale, out=by_text)
            torch.ops.aten._softmax.out(scores[:n], -1, False, out=probs[c])
            _kept(generator, n * lq * lk, p, out=kept[c])
            torch.mul(probs[c], keep[:n].copy_(kept[c].view(torch.uint8)), out=scores[:n])
            torch.bmm(scores[:n], v[c], out=out[c]).mul_(keep_scale)
        ctx.save_for_backward(q, k, v, probs, kept)
        ctx.chunks, ctx.scale, ctx.keep_scale = [c for c, _, _ in chunks], scale, keep_scale
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, probs, kept = ctx.saved_tensors
        grad, scale = grad.contiguous(), ctx.scale * ctx.keep_scale
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        most = max(c.stop - c.start for c in ctx.chunks)
        keep, grad_kept, grad_scores = (probs.new_empty(most, *probs.shape[1:]) for _ in range(3))
        for c in ctx.chunks:
            n = c.stop - c.start
            keep_, kept_grad, scores_grad = keep[:n].copy_(kept[c].view(torch.uint8)), grad_kept[:n], grad_scores[:n]
            torch.bmm(torch.mul(probs[c], keep_, out=kept_grad).transpose(1, 2), grad[c], out=dv[c])
            dv[c].mul_(ctx.keep_scale)
            torch.bmm(grad[c], v[c].transpose(1, 2), out=kept_grad).mul_(keep_)
            torch.ops.aten._softmax_backward_data.out(kept_grad, probs[c], -1, probs.dtype, grad_input=scores_grad)
            torch.bmm(scores_grad, k[c], out=dq[c]).mul_(scale)
            torch.bmm(scores_grad.transpose(1, 2), q[c], out=dk[c]).mul_(scale)
        return dq, dk, dv, None, None, None, None


CHUNK_SCORES = 2**18  # attention scores per chunk: 1 MiB of fp32, a few of which fit this CPU class's cache


def _chunks(texts: int, heads: int, scores_per_row: int) -> list[tuple[slice, slice, slice]]:
    """The chunks of a ``(texts · heads)``-row attention, each as (rows, texts, heads): as many whole
    texts as keep ``CHUNK_SCORES`` scores together, or, where one text's heads hold more, the most
    heads of one text that do (a divisor of ``heads``; at least one)."""
    per_text = heads * scores_per_row
    if per_text <= CHUNK_SCORES:
        step = CHUNK_SCORES // per_text
        return [(slice(t * heads, min(t + step, texts) * heads), slice(t, min(t + step, texts)), slice(0, heads))
                for t in range(0, texts, step)]
    per = max(d for d in range(1, heads + 1) if heads % d == 0 and (d == 1 or d * scores_per_row <= CHUNK_SCORES))
    return [(slice(t * heads + h, t * heads + h + per), slice(t, t + 1), slice(h, h + per))
            for t in range(texts) for h in range(0, heads, per)]


def _bias_of(bias: Tensor, texts: slice, heads: slice) -> Tensor:
    """The part of a ``(batch | 1, heads | 1, …)`` additive mask that a chunk's texts and heads see."""
    bias = bias[texts] if bias.shape[0] > 1 else bias
    return bias[:, heads] if bias.shape[1] > 1 else bias


def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
              dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``softmax(q·kᵀ·scale + mask)``, dropped in bulk,
    times ``v`` (computed in fp32, returned in the query's dtype); SDPA itself where there is nothing to
    drop or the shape is not the plain one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal_unmasked = attention_mask is None and bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    if dropout == 0.0 or key.shape[1] != query.shape[1] or causal_unmasked or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, length, _ = query.shape
    scale = query.size(-1) ** -0.5 if scaling is None else scaling
    bias = attention_mask  # additive (the registered mask function's); a caller's boolean one: True attends
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        bias = torch.zeros(attention_mask.shape).masked_fill_(~attention_mask, torch.finfo(torch.float32).min)
    q, k, v = (t.reshape(batch * heads, t.shape[2], t.shape[3]).float() for t in (query, key, value))
    out = _DroppedAttention.apply(q, k, v, None if bias is None else bias.float(), heads, scale, dropout)
    return out.view(batch, heads, length, -1).transpose(1, 2).contiguous().to(query.dtype), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


def use_bulk_dropout(model: nn.Module) -> int:
    """Swap every ``nn.Dropout`` of ``model`` with ``p > 0`` for a ``BulkDropout`` and an SDPA
    attention for ``attention``; returns the number of modules swapped (0: nothing to draw)."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout and child.p > 0:
                setattr(parent, name, BulkDropout(child.p, child.inplace))
                swapped += 1
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_attn_implementation", None) == "sdpa"}
    if swapped and configs:
        _register()
        for config in configs.values():
            config._attn_implementation = NAME
    return swapped

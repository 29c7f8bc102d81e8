"""Dropout on the CPU with its random bits drawn in bulk.

torch's CPU dropout draws one Bernoulli sample at a time from its Mersenne Twister (``bernoulli_``,
a serial kernel on this CPU class), and the attention-probability dropout of a BERT encoder draws
``batch · heads · length²`` of them per layer: on a 2-core AVX2 EPYC it was 18 % of a MiniLM training
step on 256-token passages (docs/experiments.md). Here the same masks — each element dropped
independently with probability ``p``, the rest scaled by ``1 / (1 - p)`` — come from numpy's PCG64,
which writes 64 random bits per call (two elements: each a 32-bit uniform compared with
``round(p · 2³²)``, so ``p`` is exact to 2⁻³²). Each mask's PCG64 seed is one draw from torch's default
generator, so ``torch.manual_seed`` fixes the masks and a checkpoint's torch RNG state resumes them.

The trainer swaps these in for training on the CPU only (``use_bulk_dropout``): CUDA's dropout is
fused and fast. The attention function keeps transformers' SDPA wherever it has no dropout to apply
(evaluation, ``p = 0``) or a shape this path does not handle (grouped key/value heads, a causal
attention without a mask); its mask is SDPA's. Saved models carry none of it: the modules hold no
weights and the attention implementation is not written to ``config.json``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

NAME = "sdpa_bulk_dropout"


def drop_mask(shape: torch.Size | tuple[int, ...], p: float) -> Tensor:
    """A boolean tensor of ``shape``: True (dropped) with probability ``p``, independently."""
    n = math.prod(shape)
    seed = int(torch.randint(0, 2**62, (1,)))
    bits = np.random.Generator(np.random.PCG64(seed)).bit_generator.random_raw((n + 1) // 2)
    uniform = torch.from_numpy(bits.view(np.int32)[:n]).view(tuple(shape))
    return uniform < (-(2**31) + round(p * 2**32))


class _Dropped(torch.autograd.Function):
    """``x`` with the masked elements zeroed and the rest scaled; the backward applies the same mask
    (kept as one byte an element, not as a float tensor like torch's dropout)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, p: float) -> Tensor:
        dropped = drop_mask(x.shape, p)
        ctx.save_for_backward(dropped)
        ctx.scale = 1.0 / (1.0 - p)
        return x.mul(ctx.scale).masked_fill_(dropped, 0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (dropped,) = ctx.saved_tensors
        return grad.mul(ctx.scale).masked_fill_(dropped, 0), None


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


def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
              dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``softmax(q·kᵀ·scale + mask)``, dropped in bulk,
    times ``v``; SDPA itself where there is nothing to drop or the shape is not the plain one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal_unmasked = attention_mask is None and bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    if dropout == 0.0 or key.shape[1] != query.shape[1] or causal_unmasked or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = query.size(-1) ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query * scale, key.transpose(2, 3))  # (the product's backward does not read it)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # SDPA's mask: True attends
            scores.masked_fill_(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores.add_(attention_mask)
    probs = bulk_dropout(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), dropout, True)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


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

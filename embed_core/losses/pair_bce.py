"""Pair-relevance binary cross-entropy (pair-relevance BCE paper, Eqs. 2–5; SigLIP-style).

Every anchor–candidate pair of the batch is a binary (or graded) classification:

    s(x, y) = α·xᵀy + β                                                          (Eq. 2)
    L_BCE   = −(1/B) Σ_k Σ_{y ∈ Y+ ∪ Y−} [ z·log σ(s(x_k, y)) + (1 − z)·log σ(−s(x_k, y)) ]

summed over the batch's candidates (every positive and every hard negative; only x_k's own
positive has z > 0) and divided by the number of anchors B, not by the number of pairs.

Logit bias from logit adjustment (Eq. 3, τ = 1): β = log(p / (1 − p)) with p the share of
positive pairs. With C candidates per anchor and one positive each, p = 1/C and β = −log(C − 1)
(B anchors, B positives, B hard negatives: β = −log(2B − 1), −6.24 at B = 256).

Graded relevance (Eq. 4): z = c + (1 − c)·r/R for r > 0, else 0 (c = 0.7: TREC-DL r = 1, 2, 3 →
0.8, 0.9, 1.0). Pointwise graded mode (Eq. 5): one (x_k, y_k, z_k) pair per example, no in-batch
negatives; β from the share of binarised targets z > 0. α = 20 (temperature 0.05), the paper's
best constant scale.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext, LossParams


def logit_bias(positive_share: float) -> float:
    """β = log(p / (1 − p)) (Eq. 3 with τ = 1)."""
    if not 0.0 < positive_share < 1.0:
        raise ValueError(f"the positive share must be in (0, 1), got {positive_share}")
    return math.log(positive_share / (1.0 - positive_share))


def graded_targets(relevance: Tensor, max_grade: float, cutoff: float = 0.7) -> Tensor:
    """Eq. 4: z = c + (1 − c)·r/R for r > 0, else 0."""
    if max_grade <= 0:
        raise ValueError(f"max_grade must be > 0, got {max_grade}")
    r = relevance.clamp(min=0.0, max=max_grade)
    return torch.where(r > 0, cutoff + (1.0 - cutoff) * r / max_grade, torch.zeros_like(r))


def pair_bce(q: Tensor, pos: Tensor, neg: Tensor | None = None, *, scale: float = 20.0, bias: float | None = None,
             targets: Tensor | None = None) -> Tensor:
    """In-batch BCE (Eq. 2). q, pos: [n, d]; neg: flat [m, d] hard negatives of the batch or None;
    targets: [n] z of each anchor's own positive (graded, Eq. 4), default 1. ``bias`` None: Eq. 3
    with p = 1/C, C = n + m candidates per anchor."""
    n = q.size(0)
    docs = pos if neg is None or neg.numel() == 0 else torch.cat([pos, neg.reshape(-1, neg.size(-1))], dim=0)
    if bias is None:
        bias = logit_bias(1.0 / docs.size(0)) if docs.size(0) > 1 else 0.0
    logits = scale * (q @ docs.T) + bias  # [n, C]; column i is anchor i's positive
    z = torch.zeros_like(logits)
    own = targets.to(logits.dtype) if targets is not None else torch.ones(n, dtype=logits.dtype, device=logits.device)
    z[torch.arange(n, device=q.device), torch.arange(n, device=q.device)] = own
    return F.binary_cross_entropy_with_logits(logits, z, reduction="sum") / n


def pair_bce_pointwise(a: Tensor, b: Tensor, z: Tensor, *, scale: float = 20.0, bias: float | None = None) -> Tensor:
    """Graded pointwise BCE (Eq. 5): pairs (a_k, b_k) with targets z_k ∈ [0, 1], no in-batch
    negatives. ``bias`` None: Eq. 3 with p = share of z > 0 in the batch (kept inside
    [1/(2n), 1 − 1/(2n)] so an all-positive or all-negative batch still has a finite bias)."""
    n = a.size(0)
    if bias is None:
        p = float((z > 0).float().mean())
        lo = 1.0 / (2 * n)
        bias = logit_bias(min(max(p, lo), 1.0 - lo)) if n > 1 else 0.0
    logits = scale * (a * b).sum(dim=-1) + bias
    return F.binary_cross_entropy_with_logits(logits, z.to(logits.dtype), reduction="sum") / n


class PairBCE(Loss):
    """In-batch BCE for retrieval (all-gathered across ranks), pointwise graded BCE for scored pairs."""

    name = "pair_bce"
    tasks = ("retrieval",) + ("sts", "nli", "pair_classification")

    class Params(LossParams):
        scale: float = Field(20.0, gt=0, description="Logit scale α (BCE paper: 20 = temperature 0.05).")
        bias: float | None = Field(None, description="Logit bias β; None = Eq. 3 from the batch (−log(C−1) "
                                   "in-batch, log(p/(1−p)) pointwise).")
        bias_warmup_from: float | None = Field(None, description="In-batch: start β here (BCE paper, Qwen2: −25) and "
                                               "move it linearly to its value over the stage's warmup_steps.")
        cutoff: float = Field(0.7, ge=0, lt=1, description="Graded targets z = c + (1−c)·r/R (Eq. 4); R = the "
                              "dataset's highest score.")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        p = self.params
        scores = torch.tensor(batch.scores, device=next(iter(emb.values())).device, dtype=torch.float32)
        z = graded_targets(scores, batch.max_score, p.cutoff)
        if "a" in emb:  # scored pairs
            return pair_bce_pointwise(emb["a"], emb["b"], z, scale=p.scale, bias=p.bias)
        q, pos, z, neg = ctx.gather(emb["query"]), ctx.gather(emb["positive"]), ctx.gather(z), ctx.gather_negatives(emb)
        candidates = pos.size(0) + neg.size(0)
        return pair_bce(q, pos, neg, scale=p.scale, bias=self.bias_at(ctx, candidates), targets=z)

    def bias_at(self, ctx: LossContext, candidates: int) -> float | None:
        """β at this step: the configured value (None: Eq. 3, −log(C−1)), reached linearly from
        ``bias_warmup_from`` over the warm-up steps when that is set."""
        p = self.params
        if p.bias_warmup_from is None or ctx.warmup_steps == 0 or ctx.step >= ctx.warmup_steps:
            return p.bias
        target = p.bias if p.bias is not None else logit_bias(1.0 / candidates) if candidates > 1 else 0.0
        return p.bias_warmup_from + (target - p.bias_warmup_from) * ctx.step / ctx.warmup_steps

"""CoDiEmb's STS losses (CoDiEmb Eqs. 4, 6, 7) on predicted scores ŷ_i = cos(f(x1_i), f(x2_i))
against gold scores y_i of a batch of pairs, and their combination

    L_STS = α·L_Pearson + β·L_RankKL + γ·L_PRO,   (α, β, γ) = (2, 5, 0.5), τ = 0.05.

* Pearson (Eq. 4): L = 1 − r(ŷ, y), population statistics; 0 when the gold scores are all equal.
* RankKL (Eq. 6): rank the batch by gold score, descending, ties get their average rank r_i ∈
  [0, N−1]; y'_i = (N−1−r_i)/(N−1); p = softmax(y'/τ), q = softmax(ŷ/τ); L = Σ_i p_i log(p_i/q_i)
  (the paper's sum; the authors' code divides by N).
* PRO (Eq. 7): sort by gold score, descending; every anchor i with a strictly lower item must
  outscore all later items, with gap-scaled temperatures T_i^j = τ/(y_i − y_j), and
  T_i^i = min_j T_i^j (the largest gap): −log( e^{ŷ_i/T_i^i} / (e^{ŷ_i/T_i^i} + Σ_{j after i} e^{ŷ_j/T_i^j}) ).
  Ties (the paper is silent): later items with the same gold score are left out of i's
  denominator, and an anchor without a strictly lower item is skipped, as in the authors' code.
  Reduction: the mean over the anchors used (the authors' code; the paper writes an expectation
  of the sum, which differs only by the constant number of anchors).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext, LossParams


def pearson_loss(pred: Tensor, gold: Tensor) -> Tensor:
    gold = gold.to(pred.dtype)
    if pred.numel() < 2 or torch.all(gold == gold[0]):
        return pred.sum() * 0.0
    pc, gc = pred - pred.mean(), gold - gold.mean()
    r = (pc * gc).mean() / (pc.pow(2).mean().sqrt() * gc.pow(2).mean().sqrt()).clamp_min(1e-12)
    return 1.0 - r


def average_ranks_desc(gold: Tensor) -> Tensor:
    """0-based ranks by gold score, highest first; tied scores share the mean of their ranks."""
    order = torch.argsort(gold, descending=True, stable=True)
    ranks = torch.empty_like(gold, dtype=torch.float64)
    ranks[order] = torch.arange(gold.numel(), dtype=torch.float64, device=gold.device)
    out = ranks.clone()
    for value in torch.unique(gold):
        tie = gold == value
        out[tie] = ranks[tie].mean()
    return out


def rank_kl_loss(pred: Tensor, gold: Tensor, *, tau: float = 0.05) -> Tensor:
    n = pred.numel()
    if n < 2:
        return pred.sum() * 0.0
    y = ((n - 1) - average_ranks_desc(gold)) / (n - 1)
    p = torch.softmax(y.to(pred.dtype) / tau, dim=0)
    log_q = torch.log_softmax(pred / tau, dim=0)
    return (p * (p.log() - log_q)).sum()


def pro_loss(pred: Tensor, gold: Tensor, *, tau: float = 0.05) -> Tensor:
    order = torch.argsort(gold, descending=True, stable=True)
    y, s = gold[order].to(pred.dtype), pred[order]
    losses = []
    for i in range(y.numel() - 1):
        gaps = y[i] - y[i + 1:]
        later = gaps > 1e-8  # strictly lower gold scores only (ties left out)
        if not bool(later.any()):
            continue
        g = gaps[later]
        anchor = s[i] * g.max() / tau  # ŷ_i / T_i^i, T_i^i = τ / max gap
        others = s[i + 1:][later] * g / tau  # ŷ_j / T_i^j
        losses.append(torch.logsumexp(torch.cat([anchor[None], others]), dim=0) - anchor)
    if not losses:
        return pred.sum() * 0.0
    return torch.stack(losses).mean()


def codiemb_sts(pred: Tensor, gold: Tensor, *, tau: float = 0.05, weights: tuple[float, float, float] = (2.0, 5.0, 0.5)
                ) -> dict[str, Tensor]:
    a, b, c = weights
    parts = {"pearson": pearson_loss(pred, gold), "rank_kl": rank_kl_loss(pred, gold, tau=tau),
             "pro": pro_loss(pred, gold, tau=tau)}
    return {"loss": a * parts["pearson"] + b * parts["rank_kl"] + c * parts["pro"], **parts}


class CoDiEmbSTS(Loss):
    """CoDiEmb's STS objective (per-rank: CoDiEmb keeps STS batches local)."""

    name = "codiemb_sts"
    tasks = ("sts", "nli", "pair_classification")

    class Params(LossParams):
        tau: float = Field(0.05, gt=0, description="τ of RankKL and PRO.")
        pearson_weight: float = Field(2.0, ge=0, description="Weight of the Pearson term (CoDiEmb: 2).")
        rank_kl_weight: float = Field(5.0, ge=0, description="Weight of the RankKL term (CoDiEmb: 5).")
        pro_weight: float = Field(0.5, ge=0, description="Weight of the PRO term (CoDiEmb: 0.5).")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        """a, b: [N, d] L2-normalised pair embeddings; gold: the batch's scores."""
        p = self.params
        gold = torch.tensor(batch.scores, device=emb["a"].device, dtype=torch.float32)
        return codiemb_sts((emb["a"] * emb["b"]).sum(-1), gold, tau=p.tau,
                           weights=(p.pearson_weight, p.rank_kl_weight, p.pro_weight))["loss"]

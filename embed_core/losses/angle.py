"""AnglE for scored pairs (Li & Li 2023, "AnglE-optimized Text Embeddings", §3.2–3.5):

    L = w_cos · L_cos + w_ibn · L_ibn + w_angle · L_angle

* ``L_cos`` — the cosine objective, CoSENT over ordered pairs of pairs (Eq. 3):
  log(1 + Σ_{y_ij > y_kl} exp((cos(x_k, x_l) − cos(x_i, x_j)) / τ_cos));
* ``L_ibn`` — the in-batch negative objective (Eq. 4) over the pairs whose gold score is at least
  ``ibn_min_score``: each such a_i must pick its own b_i among every b_j of the batch,
  −1/m Σ_i log softmax_j(cos(a_i, b_j) / τ_ibn)[i];
* ``L_angle`` — the angle objective (Eq. 5–7): each embedding is read as a complex vector (first
  half real, second half imaginary); z = a / b element-wise, rescaled by |b| / |a|; the pair's
  angle similarity is s = |Σ_k (Re z_k + Im z_k)| (large when the two vectors point the same way
  in every complex plane), and the CoSENT ranking is applied to s · scale_angle:
  log(1 + Σ_{y_ij > y_kl} exp(s_kl − s_ij)).

Defaults: the three weights 1 and τ_cos = τ_ibn = 0.05 (scale 20) as in the paper's setting; the
angle term unscaled (scale 1) as in its reference implementation. The angle objective is the one
that does not saturate where cosine is flat (near ±1), which is AnglE's point.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext, LossParams
from embed_core.losses.cosent import cosent, rank_pairs


def angle_similarity(a: Tensor, b: Tensor) -> Tensor:
    """AnglE's similarity of pairs (a_i, b_i) read as complex vectors: |Σ_k Re z_k + Im z_k| with
    z = (a / b) · |b| / |a| element-wise (Eq. 6–7)."""
    ar, ai = torch.chunk(a, 2, dim=-1)
    br, bi = torch.chunk(b, 2, dim=-1)
    denom = (br ** 2 + bi ** 2).sum(dim=-1, keepdim=True)
    re = (ar * br + ai * bi) / denom
    im = (ai * br - ar * bi) / denom
    norm_a = (ar ** 2 + ai ** 2).sum(dim=-1, keepdim=True).sqrt()
    norm_b = denom.sqrt()
    scale = norm_b / norm_a
    return torch.abs((re * scale).sum(dim=-1) + (im * scale).sum(dim=-1))


def in_batch_negatives(a: Tensor, b: Tensor, positive: Tensor, *, tau: float) -> Tensor:
    """Mean over the positive pairs i of −log softmax_j(cos(a_i, b_j) / τ)[i]; 0 without positives."""
    if not bool(positive.any()):
        return a.sum() * 0.0
    logits = a @ b.T / tau
    target = torch.arange(a.shape[0], device=a.device)
    return torch.nn.functional.cross_entropy(logits[positive], target[positive])


def angle_loss(a: Tensor, b: Tensor, scores: Tensor, *, w_cos: float = 1.0, w_ibn: float = 1.0, w_angle: float = 1.0,
               tau_cos: float = 0.05, tau_ibn: float = 0.05, scale_angle: float = 1.0,
               ibn_min_score: float = 4.0) -> Tensor:
    total = a.sum() * 0.0
    if w_cos:
        total = total + w_cos * cosent(a, b, scores, tau=tau_cos)
    if w_ibn:
        total = total + w_ibn * in_batch_negatives(a, b, scores >= ibn_min_score, tau=tau_ibn)
    if w_angle:
        total = total + w_angle * rank_pairs(angle_similarity(a, b) * scale_angle, scores)
    return total


class AnglE(Loss):
    """AnglE: cosine + in-batch negative + angle objectives (per-rank)."""

    name = "angle"
    tasks = ("sts", "nli", "pair_classification")
    default_for = ()

    class Params(LossParams):
        w_cos: float = Field(1.0, ge=0, description="Weight of the cosine (CoSENT) objective.")
        w_ibn: float = Field(1.0, ge=0, description="Weight of the in-batch negative objective.")
        w_angle: float = Field(1.0, ge=0, description="Weight of the angle objective.")
        tau_cos: float = Field(0.05, gt=0, description="Temperature of the cosine objective (0.05 = scale 20).")
        tau_ibn: float = Field(0.05, gt=0, description="Temperature of the in-batch negative objective.")
        scale_angle: float = Field(1.0, gt=0, description="Multiplier of the angle similarity before ranking.")
        ibn_min_score: float = Field(4.0, description="Pairs scored at least this are positives of the in-batch "
                                     "objective (STS-B 0-5: 4 = mostly equivalent; 1 for 0/1 labels).")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        scores = torch.tensor(batch.scores, device=emb["a"].device, dtype=torch.float32)
        p = self.params
        return angle_loss(emb["a"], emb["b"], scores, w_cos=p.w_cos, w_ibn=p.w_ibn, w_angle=p.w_angle,
                          tau_cos=p.tau_cos, tau_ibn=p.tau_ibn, scale_angle=p.scale_angle,
                          ibn_min_score=p.ibn_min_score)

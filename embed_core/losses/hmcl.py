"""HMCL: three-level contrastive training (HMCL paper, Eqs. 11–17; method notes §1.2).

Each query q_i has a positive p_i, a weak-positive w_i and optionally a hard negative n_i.
With s = cosine similarity and e(x, y) = exp(s(x, y)/τ), τ = 0.05:

    Loss = μ_c·L_c + μ_l·L_l + μ_e·L_e,   μ = (2.0, 1.0, 0.2), μ_{e,d} = 0.1          (Eq. 11)

L_c (Eqs. 15–16), InfoNCE without weak-positives:
    L_c = −(1/n) Σ_i log( e(q_i,p_i) / Z_2 ),
    Z_2 = e(q_i,n_i) + Σ_{j≠i} e(q_i,q_j) + Σ_j e(q_i,p_j)

L_l (Eqs. 13–14), ListMLE for the order positive > weak-positive > negatives (negatives tied):
    L_l = −(1/n) Σ_i log( e(q_i,p_i)/(e(q_i,p_i) + Z_1) · e(q_i,w_i)/Z_1 ),
    Z_1 = e(q_i,w_i) + e(q_i,n_i) + Σ_{j≠i} [ e(q_i,q_j) + e(q_i,p_j) + e(q_i,w_j) + e(p_i,p_j) ]
  Choice (the printed Eq. 14 is garbled): Z_1 includes the query's own weak-positive, as the
  prose says and as a probability needs; the last term is anchored on the positive, as in both
  Eq. 14 and Algorithm 1.

L_e (Eq. 17), 3-class pair-type cross-entropy (positive 0, weak-positive 1, negative 2):
    L_e = ( mean_{pair+} CE + mean_{pair w+} CE + μ_{e,d}·mean_{pair−} CE ) / n
  Choices (the paper leaves both open): logits are an affine map of the scaled cosine,
  z_{p,k} = w_k·s_p/τ + b_k with learnable w, b ∈ R³ (HMCLHead; keeps the objective tied to the
  score used at inference); negative pairs are the own hard negatives plus the in-batch pairs
  (q_i, p_j), j ≠ i, so a batch without hard negatives still has them. The division by n after
  the per-level means is the paper's, kept as printed.
A missing hard negative (``neg_mask`` False) drops its terms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from embed_core.losses.base import Loss, LossContext, LossParams

POSITIVE, WEAK_POSITIVE, NEGATIVE = 0, 1, 2


def listmle(scores: Tensor) -> Tensor:
    """ListMLE (Xia et al. 2008; HMCL Eq. 12): −log Π_k exp(s_k) / Σ_{l≥k} exp(s_l) for lists
    already in their target order. scores: [n, m]; returns the mean over the n lists."""
    rev_lse = torch.logcumsumexp(scores.flip(-1), dim=-1).flip(-1)  # log Σ_{l≥k} exp(s_l)
    return (rev_lse - scores).sum(-1).mean()


class HMCLHead(nn.Module):
    """Pair-type logits z_k = w_k·(s/τ) + b_k for k ∈ (positive, weak-positive, negative)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, 0.0, -1.0]))
        self.bias = nn.Parameter(torch.zeros(3))

    def forward(self, scaled_sim: Tensor) -> Tensor:
        return scaled_sim[:, None] * self.weight + self.bias


def _masked_lse(x: Tensor, keep: Tensor) -> Tensor:
    return torch.logsumexp(x.masked_fill(~keep, float("-inf")), dim=-1)


def hmcl(q: Tensor, p: Tensor, w: Tensor, n: Tensor | None = None, neg_mask: Tensor | None = None, *,
         head: HMCLHead, tau: float = 0.05, mu_c: float = 2.0, mu_l: float = 1.0, mu_e: float = 0.2,
         mu_ed: float = 0.1) -> dict[str, Tensor]:
    """q, p, w: [b, d] L2-normalised; n: [b, d] hard negatives (rows where ``neg_mask`` is False
    are ignored) or None. Returns {"loss", "L_c", "L_l", "L_e"}."""
    b = q.size(0)
    eye = torch.eye(b, dtype=torch.bool, device=q.device)
    off = ~eye
    s_qp, s_qq, s_qw, s_pp = q @ p.T / tau, q @ q.T / tau, q @ w.T / tau, p @ p.T / tau
    pos = s_qp.diagonal()
    weak = s_qw.diagonal()
    if n is None:
        s_qn = torch.full((b,), float("-inf"), device=q.device, dtype=q.dtype)
        has_neg = torch.zeros(b, dtype=torch.bool, device=q.device)
    else:
        has_neg = neg_mask if neg_mask is not None else torch.ones(b, dtype=torch.bool, device=q.device)
        s_qn = ((q * n).sum(-1) / tau).masked_fill(~has_neg, float("-inf"))

    # L_c: Z_2 = e(q,n_i) + Σ_{j≠i} e(q_i,q_j) + Σ_j e(q_i,p_j)
    log_z2 = torch.logsumexp(torch.stack([s_qn, _masked_lse(s_qq, off), torch.logsumexp(s_qp, dim=-1)]), dim=0)
    l_c = (log_z2 - pos).mean()

    # L_l: Z_1 = e(q_i,w_i) + e(q_i,n_i) + Σ_{j≠i}[e(q_i,q_j) + e(q_i,p_j) + e(q_i,w_j) + e(p_i,p_j)]
    log_z1 = torch.logsumexp(torch.stack([weak, s_qn, _masked_lse(s_qq, off), _masked_lse(s_qp, off),
                                          _masked_lse(s_qw, off), _masked_lse(s_pp, off)]), dim=0)
    l_l = (torch.logaddexp(pos, log_z1) - pos + log_z1 - weak).mean()

    # L_e: pair-type classification
    def ce(scaled: Tensor, level: int) -> Tensor:
        if scaled.numel() == 0:
            return scaled.new_zeros(())
        return F.cross_entropy(head(scaled), torch.full((scaled.numel(),), level, device=scaled.device))

    negatives = torch.cat([s_qn[has_neg], s_qp[off]])
    l_e = (ce(pos, POSITIVE) + ce(weak, WEAK_POSITIVE) + mu_ed * ce(negatives, NEGATIVE)) / b
    return {"loss": mu_c * l_c + mu_l * l_l + mu_e * l_e, "L_c": l_c, "L_l": l_l, "L_e": l_e}


class HMCL(Loss):
    """HMCL (Eq. 11 standard mode) on (query, positive, weak positive, optional negative) batches."""

    name = "hmcl"
    tasks = ("retrieval",) + ("sts", "nli", "pair_classification")
    layout = "hmcl"

    class Params(LossParams):
        tau: float = Field(0.05, gt=0, description="Temperature of all components.")
        mu_c: float = Field(2.0, ge=0, description="Weight μ_c of the contrastive term L_c.")
        mu_l: float = Field(1.0, ge=0, description="Weight μ_l of the ListMLE term L_l.")
        mu_e: float = Field(0.2, ge=0, description="Weight μ_e of the pair-type term L_e.")
        mu_ed: float = Field(0.1, ge=0, description="Weight μ_e,d of L_e's negative class.")
        levels: tuple[float, float] = Field((0.8, 0.4), description="Levels of scored pairs, as fractions of the "
                                            "dataset's highest score: >= first positive, >= second weak-positive, "
                                            "else negative (STS 0–5: 4 and 2; entailment 2/1/0).")

    def __init__(self, params: LossParams | None = None):
        super().__init__(params)
        self.head = HMCLHead()

    def batch_options(self) -> dict:
        return {"hmcl_levels": self.params.levels}

    def trainable_module(self) -> nn.Module:
        return self.head

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        p = self.params
        q, pos, weak = emb["query"], emb["positive"], emb["weak"]
        n = mask = None
        if batch.negative_rows:
            rows = torch.tensor(batch.negative_rows, device=q.device)
            n = q.new_zeros(q.shape).index_copy(0, rows, emb["negative"].to(q.dtype))
            mask = torch.zeros(q.size(0), dtype=torch.bool, device=q.device).index_fill(0, rows, True)
        return hmcl(q, pos, weak, n, mask, head=self.head, tau=p.tau, mu_c=p.mu_c, mu_l=p.mu_l, mu_e=p.mu_e,
                    mu_ed=p.mu_ed)["loss"]

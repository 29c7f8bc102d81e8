"""Multi-positive, hard-negative InfoNCE for retrieval (CoDiEmb Eq. 2, "L_ENCE").

Query i has K+ positives d_ic+ and K− hard negatives (drawn from its record, with replacement
when it has fewer). With cos the cosine similarity:

    Z_i+ = Σ_{j≠i} Σ_k exp(cos(q_i, d_jk+)/τ)      other queries' positives
    Z_i− = Σ_j Σ_k exp(cos(q_i, d_jk−)/τ)          every hard negative of the batch, own included
    L_IR = −(1/N) Σ_i Σ_c log( exp(cos(q_i, d_ic+)/τ) / (exp(cos(q_i, d_ic+)/τ) + Z_i+ + Z_i−) )

Each positive gets its own softmax term and the query's other positives are in no denominator
(they are not negatives). The paper takes the expectation of the sum over i and c; here the sum
over c is kept and the mean is over queries (N). The authors' code differs (one positive slot
of every other query per term, mean over c); the paper's form is implemented. τ = 0.02 (the
authors' scripts; the paper does not state it).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext, LossParams


def multi_positive_infonce(q: Tensor, pos: Tensor, neg: Tensor | None = None, *, tau: float = 0.02) -> Tensor:
    """q: [N, d]; pos: [N, K+, d]; neg: [N, K−, d] or flat [M, d] (the batch's hard negatives) or None."""
    n, kp, d = pos.shape
    pos_flat = pos.reshape(n * kp, d)
    s_pos = q @ pos_flat.T / tau  # [N, N*K+]; column j*K+ + c is d_jc+
    owner = torch.arange(n, device=q.device).repeat_interleave(kp)  # query each positive belongs to
    own = owner[None, :] == torch.arange(n, device=q.device)[:, None]  # [N, N*K+]
    others = s_pos.masked_fill(own, float("-inf"))  # Z_i+ terms only
    terms = [torch.logsumexp(others, dim=-1)]
    if neg is not None and neg.numel():
        terms.append(torch.logsumexp(q @ neg.reshape(-1, d).T / tau, dim=-1))  # Z_i−
    log_z = torch.logsumexp(torch.stack(terms), dim=0)  # log(Z_i+ + Z_i−), [N]
    own_scores = s_pos[own].view(n, kp)  # cos(q_i, d_ic+)/τ
    loss = torch.logaddexp(own_scores, log_z[:, None]) - own_scores  # −log(e^s / (e^s + Z))
    return loss.sum(dim=1).mean()


class MultiPositiveInfoNCE(Loss):
    """CoDiEmb's retrieval loss: K+ positives per query; gathered across ranks (CoDiEmb A.5)."""

    name = "codiemb_ir"
    tasks = ("retrieval",)
    layout = "multi_positive"

    class Params(LossParams):
        tau: float = Field(0.02, gt=0, description="Temperature τ.")
        num_positives: int = Field(2, ge=1, description="Positives per query K+ (CoDiEmb: 2; drawn with replacement "
                                   "when a record has fewer, as are the stage's num_hard_negatives K−).")

    def batch_options(self) -> dict:
        return {"num_positives": self.params.num_positives}

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        q, pos, neg = ctx.gather(emb["query"]), ctx.gather(emb["positive"]), ctx.gather_negatives(emb)
        return multi_positive_infonce(q, pos.view(q.size(0), self.params.num_positives, -1), neg, tau=self.params.tau)

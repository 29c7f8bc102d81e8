"""AutoRegEmbed's losses (autoregembed.txt §3.2–3.3; methods notes part B §1.3–1.5).

Information compression (stage 1): the frozen decoder must reconstruct the target d from the k
compressed vectors alone,

    L_IC = −(1/N) Σ_t log p(d_t | d_<t, e_c1 … e_ck; θ_D)          (next-token NLL, only θ_E trains)

averaged over all target tokens of the batch (the authors' ``CrossEntropyLoss(ignore_index=-100)``).

Conditional distribution alignment (stage 2, Eq. 2), log-probabilities summed over target tokens:

    S₁(q, d⁺)      = −g( β·| log p(d⁺ | e_{q,I_next}) − log p(d⁺ | e_{d⁺,I_self}) | )
    S₂(d⁺, dᵢ⁻; q) = −g( β·[ (log p(d⁺|e_q) − log p(dᵢ⁻|e_q)) − (log p_ref(d⁺|e_q) − log p_ref(dᵢ⁻|e_q)) ] )
    L_CDA          = mean over the batch of −log( e^{S₁/τ} / (e^{S₁/τ} + Σᵢ e^{S₂ᵢ/τ}) )

g = σ in the paper (bounds the logits: S₁ ∈ (−1, −0.5], S₂ ∈ (−1, 0)); Appendix B/C's variants
tanh and log σ are ``squash``. p_ref is the stage-1 (pre-CDA) model, precomputed. No in-batch
negatives: an example's own negatives only. ``reference_sign="repo"`` reproduces the authors' code,
which *adds* the reference gap instead of subtracting it (a discrepancy the notes record).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SQUASHES = ("sigmoid", "tanh", "logsigmoid")


def _squash(x: Tensor, squash: str) -> Tensor:
    if squash == "sigmoid":
        return torch.sigmoid(x)
    if squash == "tanh":
        return torch.tanh(x)
    return F.logsigmoid(x)


def ic_loss(token_logprobs: Tensor, target_mask: Tensor) -> Tensor:
    """L_IC from per-token log-probabilities [B, T] (0 at padding) and the target mask [B, T]."""
    return -token_logprobs.sum() / target_mask.sum().clamp(min=1)


def cda_scores(lp_q_pos: Tensor, lp_self_pos: Tensor, lp_q_neg: Tensor, ref_pos: Tensor, ref_neg: Tensor, *,
               beta: float = 0.1, squash: str = "sigmoid", reference_sign: str = "paper") -> tuple[Tensor, Tensor]:
    """(S₁ [B], S₂ [B, K]) of Eq. 2. lp_*: summed log-probs; lp_q_neg, ref_neg: [B, K]."""
    s1 = -_squash(beta * (lp_q_pos - lp_self_pos).abs(), squash)
    ref_gap = ref_pos.unsqueeze(1) - ref_neg
    sign = -1.0 if reference_sign == "paper" else 1.0
    s2 = -_squash(beta * ((lp_q_pos.unsqueeze(1) - lp_q_neg) + sign * ref_gap), squash)
    return s1, s2


def cda_loss(lp_q_pos: Tensor, lp_self_pos: Tensor, lp_q_neg: Tensor, ref_pos: Tensor, ref_neg: Tensor, *,
             beta: float = 0.1, tau: float = 0.05, squash: str = "sigmoid", reference_sign: str = "paper") -> Tensor:
    """L_CDA (Eq. 2): cross-entropy with S₁ as the positive logit and the S₂ᵢ as negatives, over τ."""
    s1, s2 = cda_scores(lp_q_pos, lp_self_pos, lp_q_neg, ref_pos, ref_neg, beta=beta, squash=squash,
                        reference_sign=reference_sign)
    logits = torch.cat([s1.unsqueeze(1), s2], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(logits.size(0), dtype=torch.long, device=logits.device))


class CDALoss(nn.Module):
    def __init__(self, beta: float = 0.1, tau: float = 0.05, squash: str = "sigmoid", reference_sign: str = "paper"):
        super().__init__()
        if not beta > 0 or not tau > 0:
            raise ValueError(f"beta and tau must be > 0, got beta={beta}, tau={tau}")
        if squash not in SQUASHES:
            raise ValueError(f"squash must be one of {SQUASHES}, got {squash!r}")
        if reference_sign not in ("paper", "repo"):
            raise ValueError(f"reference_sign must be 'paper' or 'repo', got {reference_sign!r}")
        self.beta, self.tau, self.squash, self.reference_sign = beta, tau, squash, reference_sign

    def forward(self, lp_q_pos: Tensor, lp_self_pos: Tensor, lp_q_neg: Tensor, ref_pos: Tensor, ref_neg: Tensor) -> Tensor:
        return cda_loss(lp_q_pos, lp_self_pos, lp_q_neg, ref_pos, ref_neg, beta=self.beta, tau=self.tau,
                        squash=self.squash, reference_sign=self.reference_sign)

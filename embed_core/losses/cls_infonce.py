"""Classification InfoNCE with the label mask (QZhou-Embedding Eq. 3).

    L = -1/n Σ_i log( e^{s(t_i,t_i+)/τ} / Z_i )
    Z_i = e^{s(t_i,t_i+)/τ} + Σ_n M(t_i,t_{i,n}−) e^{s(t_i,t_{i,n}−)/τ}
          + Σ_{j≠i} M(t_i,t_j) e^{s(t_i,t_j)/τ} + Σ_{j≠i} Σ_n M(t_i,t_{j,n}−) e^{s(t_i,t_{j,n}−)/τ}

Classification data is example-based: t_i+ is another text of t_i's class, t_{i,n}− texts of other
classes. M(t_i, x) is 0 when x has t_i's class label (it would be a false negative) and 1 otherwise,
so in-batch texts of the same class never push each other apart. Labels of negatives come from the
record's ``negative_labels``; a negative without a label is never masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext, LossParams


def classification_infonce(t: Tensor, pos: Tensor, neg: Tensor, labels: Tensor, neg_labels: Tensor, *,
                           tau: float = 0.02) -> Tensor:
    """t, pos: [n, d]; labels: [n] int class ids; neg: the batch's negatives, [n, k, d] or flat
    [m, d], with neg_labels [n, k] or [m] (-1 = unknown, never masked). Every negative in the batch
    is in every text's denominator unless it has the text's class (own and other rows' negatives
    are treated alike in Eq. 3, so rows may contribute different numbers of negatives)."""
    n, d = t.shape
    neg_flat = neg.reshape(-1, d)
    pos_logit = (t * pos).sum(-1, keepdim=True) / tau  # [n, 1]
    neg_logits = t @ neg_flat.T / tau  # [n, m]
    neg_mask = labels[:, None] == neg_labels.reshape(1, -1)  # same class -> masked out
    qq_logits = t @ t.T / tau
    qq_mask = (labels[:, None] == labels[None, :]) | torch.eye(n, dtype=torch.bool, device=t.device)
    logits = torch.cat([pos_logit, neg_logits.masked_fill(neg_mask, float("-inf")),
                        qq_logits.masked_fill(qq_mask, float("-inf"))], dim=1)
    return F.cross_entropy(logits, torch.zeros(n, dtype=torch.long, device=t.device))


class ClassificationInfoNCE(Loss):
    """QZhou's classification loss (per-rank: labels are dataset-local)."""

    name = "cls_infonce"
    tasks = ("classification",)
    default_for = ("classification",)

    class Params(LossParams):
        tau: float = Field(0.02, gt=0, description="Temperature τ (QZhou: 0.02).")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        t, pos = emb["query"], emb["positive"]
        neg = emb["negative"] if batch.num_negatives else t.new_zeros(0, t.size(1))
        labels = torch.tensor(batch.labels, device=t.device)
        neg_labels = torch.tensor(batch.negative_labels, device=t.device, dtype=torch.long)
        return classification_infonce(t, pos, neg, labels, neg_labels, tau=self.params.tau)

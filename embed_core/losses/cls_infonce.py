"""Classification InfoNCE with the label mask (QZhou-Embedding Eq. 3).

    L = -1/n Σ_i log( e^{s(t_i,t_i+)/τ} / Z_i )
    Z_i = e^{s(t_i,t_i+)/τ} + Σ_n M(t_i,t_{i,n}−) e^{s(t_i,t_{i,n}−)/τ}
          + Σ_{j≠i} M(t_i,t_j) e^{s(t_i,t_j)/τ} + Σ_{j≠i} Σ_n M(t_i,t_{j,n}−) e^{s(t_i,t_{j,n}−)/τ}

Classification data is example-based: t_i+ is another text of t_i's class, t_{i,n}− texts of other
classes. M(t_i, x) is 0 when x has t_i's class label (it would be a false negative) and 1 otherwise,
so in-batch texts of the same class never push each other apart. Labels of negatives come from the
record's ``negative_labels``; a negative without a label is never masked by label. M is also 0 for
a false negative (``embed_core.losses.false_negatives``): a candidate whose text equals t_i+ or t_i,
with ``false_negative_margin`` m, one with s(t_i, ·) > s(t_i, t_i+) + m; with a ``guide_model`` g, one
with g(t_i, ·) > g(t_i, t_i+) − m_g.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext
from embed_core.losses.false_negatives import FalseNegativeParams, FalseNegatives


def classification_infonce(t: Tensor, pos: Tensor, neg: Tensor, labels: Tensor, neg_labels: Tensor, *,
                           tau: float = 0.02, false_negatives: FalseNegatives | None = None) -> Tensor:
    """t, pos: [n, d]; labels: [n] int class ids; neg: the batch's negatives, [n, k, d] or flat
    [m, d], with neg_labels [n, k] or [m] (-1 = unknown, never masked). Every negative in the batch
    is in every text's denominator unless it has the text's class (own and other rows' negatives
    are treated alike in Eq. 3, so rows may contribute different numbers of negatives);
    false_negatives: the masks by text, margin and guide model."""
    n, d = t.shape
    neg_flat = neg.reshape(-1, d)
    pos_score = (t * pos).sum(-1, keepdim=True)  # [n, 1]
    scores = torch.cat([t @ neg_flat.T, t @ t.T], dim=1)  # [n, m + n]: negatives, then the other texts
    eye = torch.eye(n, dtype=torch.bool, device=t.device)
    label_mask = torch.cat([labels[:, None] == neg_labels.reshape(1, -1),  # same class -> masked out
                            (labels[:, None] == labels[None, :]) | eye], dim=1)
    fn = false_negatives
    if fn is not None and fn.active:
        own = torch.cat([eye.new_zeros(n, neg_flat.size(0)), eye], dim=1)
        by_text = fn.ids("query") is not None
        cand = torch.cat([fn.ids("negative"), fn.ids("query")]) if by_text else None
        guide = None
        if fn.guide("query") is not None:
            gt, gp, gn = fn.guide("query"), fn.guide("positive"), fn.guide("negative")
            guide = (torch.cat([gt @ gn.T, gt @ gt.T], dim=1), (gt * gp).sum(-1, keepdim=True))
        label_mask = label_mask | fn.mask(scores, pos_score, cand, own | label_mask,
                                          fn.ids("positive")[:, None] if by_text else None,
                                          fn.ids("query") if by_text else None, guide)[:, 0]
    logits = torch.cat([pos_score, scores.masked_fill(label_mask, float("-inf"))], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(n, dtype=torch.long, device=t.device))


class ClassificationInfoNCE(Loss):
    """QZhou's classification loss (per-rank: labels are dataset-local)."""

    name = "cls_infonce"
    tasks = ("classification",)
    default_for = ("classification",)

    class Params(FalseNegativeParams):
        tau: float = Field(0.02, gt=0, description="Temperature τ (QZhou: 0.02).")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        t, pos = emb["query"], emb["positive"]
        neg = emb["negative"] if batch.num_negatives else t.new_zeros(0, t.size(1))
        labels = torch.tensor(batch.labels, device=t.device)
        neg_labels = torch.tensor(batch.negative_labels, device=t.device, dtype=torch.long)
        fn = FalseNegatives(self.params, batch, ctx, gathered=False, device=t.device)
        loss = classification_infonce(t, pos, neg, labels, neg_labels, tau=self.params.tau, false_negatives=fn)
        fn.record()
        return loss

"""What the distillation losses (``margin_mse``, ``listwise_kl``) share: the teacher's scores of a
retrieval batch and the student's scores of the same pairs, and the InfoNCE term they may add.

The teacher's scores are the records' ``positive_scores`` / ``negative_scores`` as the mine stage
writes them with ``mine.teacher`` (a cross-encoder's or an embedder's; ``embed_core.mine.teacher``);
each query is scored against its drawn positive and its own hard negatives (rank-local: no gather).
With ``infonce_weight`` w > 0 the loss is ``L_distill + w · L_InfoNCE`` (QZhou's Eq. 1 with this
loss's false-negative rules); w = 0 (the default) trains on the teacher's scores alone, as
FlagEmbedding's ``kd_loss_type: kl_div`` and sentence-transformers' ``MarginMSELoss`` do.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field
from torch import Tensor

from embed_core.errors import ConfigError
from embed_core.losses.base import LossContext
from embed_core.losses.false_negatives import FalseNegativeParams, FalseNegatives
from embed_core.losses.infonce import infonce


class DistillationParams(FalseNegativeParams):
    """The InfoNCE term a distillation loss may add (its false-negative rules are the inherited ones)."""

    infonce_weight: float = Field(0.0, ge=0, description="w in L_distill + w · L_InfoNCE: 0 trains on the "
                                                         "teacher's scores alone; > 0 keeps QZhou's InfoNCE beside.")
    infonce_tau: float = Field(0.02, gt=0, description="Temperature τ of the added InfoNCE term.")


def teacher_scores(batch, name: str, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(positive [n], negatives [m], owner row of each negative [m]) of the batch's teacher scores;
    a ConfigError names the dataset when a drawn positive or negative has no stored score."""
    missing = [x for x in (*batch.positive_scores, *batch.negative_scores) if math.isnan(x)]
    if missing or len(batch.positive_scores) != batch.size:
        raise ConfigError(f"dataset {batch.dataset!r}: loss {name} needs a teacher score for every positive and "
                          f"hard negative (positive_scores / negative_scores), and {len(missing) or 'some'} drawn "
                          f"have none; mine it with mine.teacher (and only_missing: false for records that already "
                          f"had negatives)")
    pos = torch.tensor(batch.positive_scores, dtype=torch.float32, device=device)
    neg = torch.tensor(batch.negative_scores, dtype=torch.float32, device=device)
    owners = torch.tensor(batch.negative_owners, dtype=torch.long, device=device)
    return pos, neg, owners


def student_scores(emb: dict[str, Tensor], owners: Tensor) -> tuple[Tensor, Tensor]:
    """(cos(q_i, d_i+) [n], cos(q_owner(j), d_j−) [m]): each query with its positive and its own negatives."""
    q, pos = emb["query"], emb["positive"]
    neg = emb.get("negative")
    neg_scores = (q.index_select(0, owners) * neg).sum(-1) if neg is not None and owners.numel() else q.new_zeros(0)
    return (q * pos).sum(-1), neg_scores


def padded_lists(pos: Tensor, neg: Tensor, owners: Tensor) -> tuple[Tensor, Tensor]:
    """Each query's list [positive, own negatives...] as rows of a ``[n, 1 + k_max]`` matrix, and
    the mask of the filled slots (rows may have fewer negatives than others)."""
    n = pos.size(0)
    slot = torch.zeros_like(owners)
    if owners.numel():  # the negative's position among its row's negatives
        first = torch.searchsorted(owners, torch.arange(n, device=owners.device))
        slot = torch.arange(owners.numel(), device=owners.device) - first[owners]
    width = 1 + (int(slot.max()) + 1 if owners.numel() else 0)
    out = pos.new_zeros(n, width)
    valid = torch.zeros(n, width, dtype=torch.bool, device=pos.device)
    out[:, 0], valid[:, 0] = pos, True
    if owners.numel():
        out = out.index_put((owners, slot + 1), neg)
        valid[owners, slot + 1] = True
    return out, valid


def with_infonce(loss: Tensor, params: DistillationParams, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
    """``loss + w · L_InfoNCE`` over the gathered batch (w = ``infonce_weight``; ``loss`` when 0)."""
    if params.infonce_weight == 0:
        return loss
    q = ctx.gather(emb["query"])
    fn = FalseNegatives(params, batch, ctx, gathered=True, device=q.device)
    term = infonce(q, ctx.gather(emb["positive"]), ctx.gather_negatives(emb), tau=params.infonce_tau,
                   false_negatives=fn)
    fn.record()
    return loss + params.infonce_weight * term

"""Listwise KL distillation: each query's softmax over its positive and hard negatives follows a
teacher's (RocketQAv2, Ren et al. 2021; FlagEmbedding's ``kd_loss_type: kl_div``).

    p_i = softmax( t(q_i, ·) / T )        q_i = softmax( s(q_i, ·) / τ )      over [d_i+, d_i1−, ..., d_ik−]
    L = 1/n Σ_i KL(p_i ‖ q_i) = 1/n Σ_i Σ_j p_ij (log p_ij − log q_ij)

s is the student's cosine similarity, t the teacher's score (``positive_scores`` /
``negative_scores``, from ``mine.teacher``), T the teacher's ``temperature`` and τ the student's
(sentence-transformers' ``DistillKLDivLoss(temperature=T)`` is τ = T, without its T² factor).
A query's list has its own negatives only (rows may have fewer). Optionally ``+ w · L_InfoNCE``
(``embed_core.losses.distillation``).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext
from embed_core.losses.distillation import (DistillationParams, padded_lists, student_scores, teacher_scores,
                                            with_infonce)


def listwise_kl(s_pos: Tensor, s_neg: Tensor, t_pos: Tensor, t_neg: Tensor, owners: Tensor, *,
                temperature: float = 1.0, tau: float = 0.05) -> Tensor:
    """s_pos, t_pos: [n]; s_neg, t_neg, owners: [m] (row of each negative, rows in order). Mean over queries."""
    student, valid = padded_lists(s_pos, s_neg, owners)
    teacher, _ = padded_lists(t_pos, t_neg, owners)
    log_q = torch.log_softmax((student / tau).masked_fill(~valid, float("-inf")), dim=-1)
    log_p = torch.log_softmax((teacher / temperature).masked_fill(~valid, float("-inf")), dim=-1)
    terms = torch.where(valid, log_p.exp() * (log_p - log_q), torch.zeros_like(log_q))
    return terms.sum(-1).mean()


class ListwiseKL(Loss):
    """Distillation of a teacher's ranking of each query's positive and hard negatives (KL of softmaxes)."""

    name = "listwise_kl"
    tasks = ("retrieval",)

    class Params(DistillationParams):
        temperature: float = Field(1.0, gt=0, description="T: the teacher's scores are divided by it before the "
                                                          "softmax (higher: softer targets).")
        tau: float = Field(0.05, gt=0, description="τ: the student's cosine scores are divided by it.")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        t_pos, t_neg, owners = teacher_scores(batch, self.name, emb["query"].device)
        s_pos, s_neg = student_scores(emb, owners)
        loss = listwise_kl(s_pos, s_neg, t_pos.to(s_pos.dtype), t_neg.to(s_pos.dtype), owners,
                           temperature=self.params.temperature, tau=self.params.tau)
        return with_infonce(loss, self.params, emb, batch, ctx)

"""MarginMSE: the student's score margins regress onto a teacher's (Hofstätter et al. 2020,
"Improving Efficient Neural Ranking Models with Cross-Architecture Knowledge Distillation").

    L = 1/|P| Σ_{(i,j) ∈ P} ( λ·(s(q_i,d_i+) − s(q_i,d_ij−)) − (t(q_i,d_i+) − t(q_i,d_ij−)) )²

P is every (query, own hard negative) pair of the batch, s the student's cosine similarity, t the
teacher's score (``positive_scores`` / ``negative_scores``, from ``mine.teacher``) and λ ``scale``:
the student's cosines live in [-1, 1], a cross-encoder's logits do not (sentence-transformers'
``MarginMSELoss`` compares dot products of unnormalised embeddings instead). Optionally
``+ w · L_InfoNCE`` (``embed_core.losses.distillation``).
"""

from __future__ import annotations

from pydantic import Field
from torch import Tensor

from embed_core.losses.base import Loss, LossContext
from embed_core.losses.distillation import DistillationParams, student_scores, teacher_scores, with_infonce


def margin_mse(s_pos: Tensor, s_neg: Tensor, t_pos: Tensor, t_neg: Tensor, owners: Tensor, *,
               scale: float = 1.0) -> Tensor:
    """s_pos, t_pos: [n]; s_neg, t_neg, owners: [m] (the row of each negative). Mean over the m pairs."""
    if owners.numel() == 0:
        return s_pos.sum() * 0.0
    student = scale * (s_pos.index_select(0, owners) - s_neg)
    teacher = t_pos.index_select(0, owners) - t_neg
    return ((student - teacher) ** 2).mean()


class MarginMSE(Loss):
    """Distillation of a teacher's score margins (positive minus each hard negative)."""

    name = "margin_mse"
    tasks = ("retrieval",)

    class Params(DistillationParams):
        scale: float = Field(1.0, gt=0, description="λ: the student's cosine margins are multiplied by it before "
                                                    "they are compared with the teacher's (1 for an embedder "
                                                    "teacher's cosines; about the logits' range for a "
                                                    "cross-encoder's).")

    def __call__(self, emb: dict[str, Tensor], batch, ctx: LossContext) -> Tensor:
        t_pos, t_neg, owners = teacher_scores(batch, self.name, emb["query"].device)
        s_pos, s_neg = student_scores(emb, owners)
        loss = margin_mse(s_pos, s_neg, t_pos.to(s_pos.dtype), t_neg.to(s_pos.dtype), owners,
                          scale=self.params.scale)
        return with_infonce(loss, self.params, emb, batch, ctx)

"""Call a registered loss the way the trainer does: (embeddings by group, batch, context)."""

from embed_core.losses import Loss, LossContext
from embed_core.losses.batch import TaskBatch


def call_loss(loss: Loss, emb: dict, *, task: str = "retrieval", ctx: LossContext | None = None, **batch_fields):
    batch = TaskBatch(task=task, dataset="d", groups={}, **batch_fields)
    return loss(emb, batch, ctx or LossContext())

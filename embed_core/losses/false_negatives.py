"""False negatives out of the contrastive denominators (shared by the InfoNCE-family losses).

An in-batch or cross-device candidate d_j is left out of query i's denominator (its term is
dropped from Z_i, as if it were not in the batch) when

* its text equals one of i's positives or i's query text (``mask_duplicate_texts``): two records
  with the same positive, a hard negative that is a copy of another record's positive, a repeated
  query. Texts are compared by a 64-bit hash (BLAKE2b), gathered across ranks like the embeddings;
* or it scores above i's positive by more than a margin m (``false_negative_margin``):

      s(q_i, d_j) > s(q_i, d_i+) + m

  Qwen3-Embedding's and GTE's improved contrastive loss (Zhang et al. 2025; Li et al. 2023)
  with m = 0.1; sentence-transformers' ``GISTEmbedLoss`` applies the same rule with a guide model's
  scores (not offered here: the rule uses the trained model's own cosine scores).

The query's own positive is never masked. The counts of masked (query, candidate) pairs go into the
step's metrics (``masked_duplicates``, ``masked_margin``; a pair masked for both reasons counts as a
duplicate).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import LossContext, LossParams

if TYPE_CHECKING:
    from embed_core.train.batches import TaskBatch


class FalseNegativeParams(LossParams):
    """The false-negative rules every InfoNCE-family loss offers (the module's docstring)."""

    mask_duplicate_texts: bool = Field(
        True, description="Leave out of each query's denominator the in-batch and gathered candidates whose text "
                          "equals one of its positives or its own query text (exact duplicates; counted in the "
                          "step metrics as masked_duplicates).")
    false_negative_margin: float | None = Field(
        None, description="Also leave out the candidates d with s(q, d) > s(q, d+) + margin (cosine scores; "
                          "Qwen3-Embedding and GTE use 0.1; counted as masked_margin). None: off.")


def text_ids(texts: Sequence[str]) -> Tensor:
    """One int64 per text: the first 8 bytes of its BLAKE2b hash (equal texts, equal ids)."""
    return torch.tensor([int.from_bytes(hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                                        "little", signed=True) for t in texts], dtype=torch.long)


class FalseNegatives:
    """The masks of one loss call: built from the batch's texts (gathered across ranks where the
    loss gathers its embeddings), applied per candidate block, counted into ``ctx``."""

    def __init__(self, params: FalseNegativeParams, batch: "TaskBatch", ctx: LossContext, *, gathered: bool,
                 device: torch.device):
        self.margin = params.false_negative_margin
        self.ctx, self.gathered, self.device = ctx, gathered, device
        self.duplicates = self.above_margin = 0
        groups = batch.groups
        # a batch that carries no texts (a loss called outside the trainer) is masked by score only;
        # every rank's batch has the same groups, so the ranks' collectives stay in step
        self.by_text = params.mask_duplicate_texts and "query" in groups and "positive" in groups
        self._ids: dict[str, Tensor] = {}
        if self.by_text:
            for name in ("query", "positive", "negative"):
                ids = text_ids(groups[name].texts) if name in groups else torch.zeros(0, dtype=torch.long)
                ids = ids.to(device)  # collectives (nccl) want the embeddings' device
                self._ids[name] = ctx.gather(ids) if gathered else ids

    @property
    def active(self) -> bool:
        return self.by_text or self.margin is not None

    def ids(self, name: str) -> Tensor | None:
        """The (gathered) text ids of group ``name``, or None when texts are not compared."""
        return self._ids.get(name)

    def mask(self, scores: Tensor, pos_scores: Tensor, cand_ids: Tensor | None, own: Tensor | None = None,
             pos_ids: Tensor | None = None, query_ids: Tensor | None = None) -> Tensor:
        """``[n, K, m]``: True where candidate j leaves the denominator of query i's term k.

        scores: ``[n, m]`` cosine scores of the candidates; pos_scores: ``[n, K]`` the query's
        positives' scores (one term each); cand_ids ``[m]``, pos_ids ``[n, K]``, query_ids ``[n]``:
        text ids (None: not compared); own: ``[n, m]`` the query's own positives and itself, never
        masked here (the loss handles them)."""
        n, m = scores.shape
        keep = ~own if own is not None else torch.ones(n, m, dtype=torch.bool, device=scores.device)
        dup = torch.zeros(n, m, dtype=torch.bool, device=scores.device)
        if self.by_text and cand_ids is not None and pos_ids is not None:
            cand = cand_ids.to(scores.device)
            dup = (cand[None, None, :] == pos_ids.to(scores.device)[:, :, None]).any(1)
            if query_ids is not None:
                dup |= cand[None, :] == query_ids.to(scores.device)[:, None]
            dup &= keep
        out = dup[:, None, :].expand(n, pos_scores.size(1), m)
        self.duplicates += int(dup.sum())
        if self.margin is not None:
            above = (scores[:, None, :] > pos_scores[:, :, None] + self.margin) & keep[:, None, :]
            self.above_margin += int((above.any(1) & ~dup).sum())
            out = out | above
        return out

    def record(self) -> None:
        """Add this call's counts to the context (summed over ranks when the loss is rank-local)."""
        counts = torch.tensor([float(self.duplicates), float(self.above_margin)], device=self.device)
        if not self.gathered:
            counts = self.ctx.gather(counts.view(1, 2)).sum(0)
        self.ctx.count("masked_duplicates", int(counts[0]))
        self.ctx.count("masked_margin", int(counts[1]))

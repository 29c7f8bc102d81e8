"""False negatives out of the contrastive denominators (shared by the InfoNCE-family losses).

An in-batch or cross-device candidate d_j is left out of query i's denominator (its term is
dropped from Z_i, as if it were not in the batch) when

* its text equals one of i's positives or i's query text (``mask_duplicate_texts``): two records
  with the same positive, a hard negative that is a copy of another record's positive, a repeated
  query. Texts are compared by a 64-bit hash (BLAKE2b), gathered across ranks like the embeddings;
* or it scores above i's positive by more than a margin m (``false_negative_margin``):

      s(q_i, d_j) > s(q_i, d_i+) + m

  Qwen3-Embedding's and GTE's improved contrastive loss (Zhang et al. 2025; Li et al. 2023)
  with m = 0.1;
* or a frozen guide model g scores it above the positive, less a margin m_g (``guide_model``,
  ``guide_margin``; sentence-transformers' ``GISTEmbedLoss``, Solatorio 2024, absolute margin):

      g(q_i, d_j) > g(q_i, d_i+) − m_g

  The guide encodes the batch's texts (as they are, without instructions) in every micro-batch,
  on the trainer's device, without gradients; its embeddings are gathered like the trained ones.

The query's own positive is never masked. The counts of masked (query, candidate) pairs go into the
step's metrics (``masked_duplicates``, ``masked_margin``, ``masked_guide``; a pair masked for
several reasons counts once, under the first of these).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field
from torch import Tensor

from embed_core.losses.base import LossContext, LossParams

if TYPE_CHECKING:
    from embed_core.losses.batch import TaskBatch


class FalseNegativeParams(LossParams):
    """The false-negative rules every InfoNCE-family loss offers (the module's docstring)."""

    mask_duplicate_texts: bool = Field(
        True, description="Leave out of each query's denominator the in-batch and gathered candidates whose text "
                          "equals one of its positives or its own query text (exact duplicates; counted in the "
                          "step metrics as masked_duplicates).")
    false_negative_margin: float | None = Field(
        None, description="Also leave out the candidates d with s(q, d) > s(q, d+) + margin (cosine scores; "
                          "Qwen3-Embedding and GTE use 0.1; counted as masked_margin). None: off.")
    guide_model: str | None = Field(
        None, description="A local embedding model directory (or 'default') that judges the candidates, as "
                          "sentence-transformers' GISTEmbedLoss: one it scores above the positive, less "
                          "guide_margin, is left out (counted as masked_guide). It encodes the batch's texts "
                          "every micro-batch, frozen. None: off.")
    guide_pooling: Literal["mean", "cls", "last_token"] = Field("mean", description="Pooling of the guide model.")
    guide_margin: float = Field(0.0, ge=0, description="m_g: the guide leaves out a candidate d with "
                                                       "g(q, d) > g(q, d+) − m_g.")


def text_ids(texts: Sequence[str]) -> Tensor:
    """One int64 per text: the first 8 bytes of its BLAKE2b hash (equal texts, equal ids)."""
    return torch.tensor([int.from_bytes(hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                                        "little", signed=True) for t in texts], dtype=torch.long)


@functools.cache
def guide_encoder(path: str, pooling: str):
    """The guide model, loaded once per process (``embed_core.model.encoder.Encoder``)."""
    from embed_core.model.encoder import Encoder

    return Encoder(path, pooling=pooling, max_length=512)


class FalseNegatives:
    """The masks of one loss call: built from the batch's texts (gathered across ranks where the
    loss gathers its embeddings), applied per candidate block, counted into ``ctx``."""

    def __init__(self, params: FalseNegativeParams, batch: "TaskBatch", ctx: LossContext, *, gathered: bool,
                 device: torch.device):
        self.margin = params.false_negative_margin
        self.ctx, self.gathered, self.device = ctx, gathered, device
        self.duplicates = self.above_margin = self.above_guide = 0
        self.guide_margin = params.guide_margin
        groups = batch.groups
        # a batch that carries no texts (a loss called outside the trainer) is masked by score only;
        # every rank's batch has the same groups, so the ranks' collectives stay in step
        texts = "query" in groups and "positive" in groups
        self.by_text = params.mask_duplicate_texts and texts
        # computed once per batch (a loss applied several times to one batch, e.g. at several
        # Matryoshka dimensions, neither hashes, encodes nor gathers them again)
        self._ids = self._once(batch, ("ids", gathered), lambda: self._gathered(
            lambda ts: text_ids(ts), lambda: torch.zeros(0, dtype=torch.long), groups)) if self.by_text else {}
        self._guide: dict[str, Tensor] = {}
        if params.guide_model is not None and texts:
            encoder = guide_encoder(params.guide_model, params.guide_pooling)
            self._guide = self._once(batch, ("guide", gathered, params.guide_model, params.guide_pooling),
                                     lambda: self._gathered(lambda ts: torch.from_numpy(encoder.encode(ts)).float(),
                                                            lambda: torch.zeros(0, encoder.dim), groups))

    @staticmethod
    def _once(batch: "TaskBatch", key: tuple, make) -> dict[str, Tensor]:
        derived = batch.derived
        if key not in derived:
            derived[key] = make()
        return derived[key]

    def _gathered(self, of_texts, empty, groups) -> dict[str, Tensor]:
        """``of_texts(texts)`` of the query, positive and negative groups, on the embeddings' device
        (collectives such as nccl want it), gathered across ranks where the loss gathers."""
        out = {}
        for name in ("query", "positive", "negative"):
            value = (of_texts(groups[name].texts) if name in groups and groups[name].texts else empty()).to(self.device)
            out[name] = self.ctx.gather(value) if self.gathered else value
        return out

    @property
    def active(self) -> bool:
        return self.by_text or self.margin is not None or bool(self._guide)

    def ids(self, name: str) -> Tensor | None:
        """The (gathered) text ids of group ``name``, or None when texts are not compared."""
        return self._ids.get(name)

    def guide(self, name: str) -> Tensor | None:
        """The guide model's (gathered) embeddings of group ``name``, or None without a guide."""
        return self._guide.get(name)

    def mask(self, scores: Tensor, pos_scores: Tensor, cand_ids: Tensor | None, own: Tensor | None = None,
             pos_ids: Tensor | None = None, query_ids: Tensor | None = None,
             guide: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``[n, K, m]``: True where candidate j leaves the denominator of query i's term k.

        scores: ``[n, m]`` cosine scores of the candidates; pos_scores: ``[n, K]`` the query's
        positives' scores (one term each); cand_ids ``[m]``, pos_ids ``[n, K]``, query_ids ``[n]``:
        text ids (None: not compared); own: ``[n, m]`` the query's own positives and itself, never
        masked here (the loss handles them); guide: the guide model's (scores, pos_scores), same shapes."""
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
        counted = dup
        if self.margin is not None:
            above = (scores[:, None, :] > pos_scores[:, :, None] + self.margin) & keep[:, None, :]
            self.above_margin += int((above.any(1) & ~counted).sum())
            counted, out = counted | above.any(1), out | above
        if guide is not None:
            g_scores, g_pos = guide
            above = (g_scores[:, None, :] > g_pos[:, :, None] - self.guide_margin) & keep[:, None, :]
            self.above_guide += int((above.any(1) & ~counted).sum())
            out = out | above
        return out

    def record(self) -> None:
        """Add this call's counts to the context (summed over ranks when the loss is rank-local)."""
        counts = torch.tensor([float(self.duplicates), float(self.above_margin), float(self.above_guide)],
                              device=self.device)
        if not self.gathered:
            counts = self.ctx.gather(counts.view(1, 3)).sum(0)
        for name, value in zip(("masked_duplicates", "masked_margin", "masked_guide"), counts.tolist()):
            self.ctx.count(name, int(value))

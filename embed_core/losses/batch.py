"""What a loss is given: a batch of one task's texts in named groups (``TextGroup``: queries,
positives, negatives, ...) with the scores, labels and weights its loss reads (``TaskBatch``). The
train engine builds them from sampled records (``embed_core.train.engine.batches``); the losses
read them, so the type lives here, below both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass
class TextGroup:
    texts: list[str]
    instructions: list[str | None]
    max_length: int
    # the texts tokenized (``Embedder.tokenize``), when the batch source has done it ahead
    features: dict | None = field(default=None, repr=False, compare=False)


@dataclass
class TaskBatch:
    task: str
    dataset: str
    groups: dict[str, TextGroup]  # name -> texts to embed
    num_negatives: int = 0  # hard negatives in the whole batch (flat)
    scores: list[float] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    negative_labels: list[int] = field(default_factory=list)  # one per flat negative
    layout: str = "standard"
    negative_rows: list[int] = field(default_factory=list)  # hmcl: rows whose hard negative is in "negative"
    # retrieval, standard layout: the row each flat negative belongs to, and the stored scores of the
    # drawn positive and of each negative (a teacher's, ``mine.teacher``; NaN where none is stored):
    # the distillation losses' targets
    negative_owners: list[int] = field(default_factory=list)
    positive_scores: list[float] = field(default_factory=list)
    negative_scores: list[float] = field(default_factory=list)
    max_score: float = 1.0  # highest score in the dataset (R of the graded targets)
    # what a loss derives once from the batch's texts (text ids, a guide model's embeddings), by key
    derived: dict = field(default_factory=dict, repr=False, compare=False)
    # per-example loss weights (the stage's origin_weight of each row's origin); empty: all 1
    weights: list[float] = field(default_factory=list)
    # the dataset positions of the whole micro-batch, all ranks' slices (lineage); set by the trainer
    positions: np.ndarray | None = field(default=None, repr=False, compare=False)
    # this rank's encoder passes, planned with the batch off the step (``Passes.local_plan`` on the
    # batch source's thread): length buckets, packing and features cost host time the step then saves
    passes: list | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(next(iter(self.groups.values())).texts)

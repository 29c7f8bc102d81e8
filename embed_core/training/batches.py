"""Turn sampled records into the tensors each task's loss needs.

Per task (QZhou §3.2–3.3):
* retrieval — (query, one positive, k hard negatives) → InfoNCE (Eq. 1); instruction on the query;
* classification — (text, same-class text, k other-class texts with labels) → CLS InfoNCE (Eq. 3);
  instruction on both sides (symmetric);
* sts / nli / pair_classification — (text1, text2, score) → CoSENT (Eq. 2); instruction on both sides.

Which positive and which negatives a record contributes at a step is drawn from a generator
seeded by (seed, step), so a resumed run builds the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

INFONCE_TASKS = ("retrieval",)
CLS_TASKS = ("classification",)
PAIR_TASKS = ("sts", "nli", "pair_classification")
TRAINABLE_TASKS = INFONCE_TASKS + CLS_TASKS + PAIR_TASKS


@dataclass
class TextGroup:
    texts: list[str]
    instructions: list[str | None]
    max_length: int


@dataclass
class TaskBatch:
    task: str
    dataset: str
    groups: dict[str, TextGroup]  # name -> texts to embed
    num_negatives: int = 0  # hard negatives in the whole batch (flat)
    scores: list[float] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    negative_labels: list[int] = field(default_factory=list)  # one per flat negative

    @property
    def size(self) -> int:
        return len(next(iter(self.groups.values())).texts)


class DatasetRecords:
    """One dataset's records as column lists (cheap random access by index)."""

    def __init__(self, name: str, table):
        self.name = name
        cols = table.select(["task", "instruction", "query", "positives", "positive_scores", "negatives",
                             "negative_labels", "label"]).to_pydict()
        self.task = cols["task"][0] if cols["task"] else "retrieval"
        self.cols = cols
        self.size = table.num_rows
        labels = sorted({lab for lab in cols["label"] if lab is not None} |
                        {lab for labs in cols["negative_labels"] for lab in labs if lab})
        self.label_ids = {lab: i for i, lab in enumerate(labels)}

    def instructions(self) -> set[str]:
        return {i for i in self.cols["instruction"] if i}


def build_batch(records: DatasetRecords, indices: list[int], *, step: int, seed: int, num_negatives: int,
                query_max_length: int, passage_max_length: int, use_instructions: bool) -> TaskBatch:
    rng = np.random.Generator(np.random.PCG64([seed, step]))
    c = records.cols
    instr = [(c["instruction"][i] or None) if use_instructions else None for i in indices]
    queries = [c["query"][i] for i in indices]
    task = records.task
    if task in PAIR_TASKS:
        positives = [c["positives"][i][0] for i in indices]
        scores = [float(c["positive_scores"][i][0]) if c["positive_scores"][i] else 1.0 for i in indices]
        return TaskBatch(task, records.name, {
            "a": TextGroup(queries, instr, query_max_length),
            "b": TextGroup(positives, instr, query_max_length)}, scores=scores)

    positives = [c["positives"][i][int(rng.integers(len(c["positives"][i])))] for i in indices]
    negatives: list[str] = []
    negative_labels: list[int] = []
    side = instr if task in CLS_TASKS else [None] * len(indices)  # documents get no instruction
    neg_side: list[str | None] = []
    for row, i in enumerate(indices):
        # up to k per record; a record with fewer (e.g. none survived the mining margin) gives what it
        # has: the losses put every negative of the batch in every query's denominator anyway
        k = min(num_negatives, len(c["negatives"][i]))
        pick = rng.choice(len(c["negatives"][i]), size=k, replace=False).tolist() if k else []
        negatives += [c["negatives"][i][j] for j in pick]
        labs = c["negative_labels"][i]
        negative_labels += [records.label_ids.get(labs[j], -1) if j < len(labs) else -1 for j in pick]
        neg_side += [side[row]] * k
    groups = {"query": TextGroup(queries, instr, query_max_length),
              "positive": TextGroup(positives, side, passage_max_length)}
    if negatives:
        groups["negative"] = TextGroup(negatives, neg_side, passage_max_length)
    batch = TaskBatch(task, records.name, groups, num_negatives=len(negatives))
    if task in CLS_TASKS:
        batch.labels = [records.label_ids.get(c["label"][i], -2) for i in indices]  # -2 never equals a negative's -1
        batch.negative_labels = negative_labels
    return batch

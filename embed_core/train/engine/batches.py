"""Turn sampled records into the tensors each task's loss needs.

Per task (QZhou §3.2–3.3):
* retrieval — (query, one positive, k hard negatives) → InfoNCE (Eq. 1); instruction on the query;
* classification — (text, same-class text, k other-class texts with labels) → CLS InfoNCE (Eq. 3);
  instruction on both sides (symmetric);
* sts / nli / pair_classification — (text1, text2, score) → CoSENT (Eq. 2); instruction on both sides.

The layout a loss asks for (``Loss.layout``, ``embed_core.losses``):
* ``standard`` — the above; a retrieval batch also carries the relevance of each drawn positive
  (``scores``: graded BCE targets);
* ``multi_positive`` — K+ positives and K− hard negatives per query, drawn with replacement when
  the record has fewer (CoDiEmb Eq. 2);
* ``hmcl`` — (query, positive, weak-positive, optional hard negative). Retrieval: the record's
  positive and hard negative; its weak-positive from ``weak_positives``, else made by the HMCL
  supplier from the positive (``embed_core.train.engine.edits``). Scored pairs: the pair's second text takes
  the level its score gives (``hmcl_levels``), the missing positive / weak-positive are made by
  the supplier (HMCL Algorithm 1), a missing negative stays missing (masked).

Which positive and which negatives a record contributes at a step is drawn from a generator
seeded by (seed, step, the record's position in its dataset): a resumed run builds the same batches,
and a record's draw does not depend on which rank's slice it is in, so N processes train on exactly
the texts one process does with the same global batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from embed_core.losses.batch import TaskBatch, TextGroup
from embed_core.schema import CLS_TASKS, INFONCE_TASKS, PAIR_TASKS
from embed_core.train.engine.edits import generate_positive, generate_weak_positive


@dataclass(frozen=True)
class GroupShape:
    """One text group of a batch layout: at most ``per_record`` texts per record, padded to at most
    ``max_length`` tokens."""

    per_record: int
    max_length: int


def batch_layout(task: str, layout: str, *, num_negatives: int, num_positives: int, query_max_length: int,
                 passage_max_length: int) -> dict[str, GroupShape]:
    """The text groups a batch of ``task`` embeds under the loss's ``layout``, in embedding order
    (worst case: every record has its hard negatives). ``build_batch`` fills these groups and
    ``embedpipe plan`` sizes memory from them: the one definition of a batch's shape."""
    ql, pl = query_max_length, passage_max_length
    if layout == "hmcl":  # symmetric tasks compare texts of the query's kind
        length = ql if task in PAIR_TASKS else pl
        return {"query": GroupShape(1, ql), **{g: GroupShape(1, length) for g in ("positive", "weak", "negative")}}
    if layout == "multi_positive":
        groups = {"query": GroupShape(1, ql), "positive": GroupShape(num_positives, pl)}
    elif task in PAIR_TASKS:
        return {"a": GroupShape(1, ql), "b": GroupShape(1, ql)}
    else:
        groups = {"query": GroupShape(1, ql), "positive": GroupShape(1, pl)}
    return groups | ({"negative": GroupShape(num_negatives, pl)} if num_negatives else {})


RECORD_COLUMNS = ("task", "instruction", "query", "positives", "positive_scores", "negatives", "negative_scores",
                  "negative_labels", "weak_positives", "label", "origin")


class ArrowColumn(Sequence):
    """One column of a record table read a value at a time (``column[i]`` is the Python value of row
    i): random access without turning the column into Python objects, so a memory-mapped table
    (``embed_core.train.records``) stays in the file's pages."""

    def __init__(self, array: pa.ChunkedArray):
        self._array = array

    def __len__(self) -> int:
        return len(self._array)

    def __getitem__(self, i):  # type: ignore[override]
        return self._array[i].as_py()

    def __iter__(self) -> Iterator:
        for chunk in self._array.chunks:
            yield from chunk.to_pylist()


@dataclass
class RecordsSummary:
    """What a dataset's batches need of all its records: its task, its labels (classification and
    labelled negatives), its highest positive score (R of the graded targets) and its instructions.
    Computed a slice at a time (``add``), so a memory-mapped dataset is summarised where it is
    converted and its ranks read the summary instead of every page of the file."""

    task: str | None = None
    labels: set[str] = field(default_factory=set)
    max_score: float | None = None
    instructions: set[str] = field(default_factory=set)

    def add(self, batch: pa.RecordBatch | pa.Table) -> None:
        import pyarrow.compute as pc

        if self.task is None and batch.num_rows:
            self.task = batch.column("task")[0].as_py()
        self.labels |= set(pc.unique(batch.column("label")).to_pylist()) - {None}
        self.labels |= set(pc.unique(pc.list_flatten(batch.column("negative_labels"))).to_pylist()) - {None, ""}
        top = pc.max(pc.list_flatten(batch.column("positive_scores"))).as_py()
        if top is not None:
            self.max_score = top if self.max_score is None else max(self.max_score, top)
        self.instructions |= set(pc.unique(batch.column("instruction")).to_pylist()) - {None, ""}

    def to_json(self) -> dict:
        return {"task": self.task, "labels": sorted(self.labels), "max_score": self.max_score,
                "instructions": sorted(self.instructions)}

    @classmethod
    def from_json(cls, data: dict) -> "RecordsSummary":
        return cls(data["task"], set(data["labels"]), data["max_score"], set(data["instructions"]))


class DatasetRecords:
    """One dataset's records as columns with random access by index (``cols[name][i]``), over an
    Arrow table that may be memory-mapped; what needs the whole dataset comes from its
    ``RecordsSummary`` (given, or computed from the table)."""

    def __init__(self, name: str, table: pa.Table, summary: RecordsSummary | None = None):
        if summary is None:
            summary = RecordsSummary()
            summary.add(table)
        self.name = name
        self.cols = {c: ArrowColumn(table.column(c)) for c in RECORD_COLUMNS}
        self.size = table.num_rows
        self.task = summary.task or "retrieval"
        self.label_ids = {lab: i for i, lab in enumerate(sorted(summary.labels))}
        self.max_score = max(summary.max_score if summary.max_score is not None else 1.0, 1e-9)
        self._instructions = set(summary.instructions)

    def instructions(self) -> set[str]:
        return set(self._instructions)


def build_batch(records: DatasetRecords, indices: list[int], *, step: int, seed: int, num_negatives: int,
                query_max_length: int, passage_max_length: int, use_instructions: bool, layout: str = "standard",
                hmcl_levels: tuple[float, float] = (0.8, 0.4), num_positives: int = 2) -> TaskBatch:
    def rng(i: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64([seed, step, i]))

    c = records.cols
    instr = [(c["instruction"][i] or None) if use_instructions else None for i in indices]
    queries = [c["query"][i] for i in indices]
    task = records.task
    shape = batch_layout(task, layout, num_negatives=num_negatives, num_positives=num_positives,
                         query_max_length=query_max_length, passage_max_length=passage_max_length)
    length = {name: g.max_length for name, g in shape.items()}
    if layout == "hmcl":
        batch = _hmcl_batch(records, indices, rng, instr, queries, length, hmcl_levels)
        batch.max_score = records.max_score
        return batch
    if layout == "multi_positive":
        return _codiemb_ir_batch(records, indices, rng, instr, queries, length, num_positives, num_negatives)
    if task in PAIR_TASKS:
        positives = [c["positives"][i][0] for i in indices]
        scores = [float(c["positive_scores"][i][0]) if c["positive_scores"][i] else 1.0 for i in indices]
        return TaskBatch(task, records.name, {
            "a": TextGroup(queries, instr, length["a"]),
            "b": TextGroup(positives, instr, length["b"])}, scores=scores, max_score=records.max_score)

    draws = [rng(i) for i in indices]
    picked_pos = [int(r.integers(len(c["positives"][i]))) for r, i in zip(draws, indices)]
    positives = [c["positives"][i][j] for i, j in zip(indices, picked_pos)]
    negatives: list[str] = []
    negative_labels: list[int] = []
    owners: list[int] = []
    negative_scores: list[float] = []
    side = instr if task in CLS_TASKS else [None] * len(indices)  # documents get no instruction
    neg_side: list[str | None] = []
    for row, i in enumerate(indices):
        # up to k per record; a record with fewer (e.g. none survived the mining margin) gives what it
        # has: the losses put every negative of the batch in every query's denominator anyway
        k = min(num_negatives, len(c["negatives"][i]))
        pick = draws[row].choice(len(c["negatives"][i]), size=k, replace=False).tolist() if k else []
        negatives += [c["negatives"][i][j] for j in pick]
        labs = c["negative_labels"][i]
        negative_labels += [records.label_ids.get(labs[j], -1) if j < len(labs) else -1 for j in pick]
        stored = c["negative_scores"][i]
        negative_scores += [float(stored[j]) if j < len(stored) else math.nan for j in pick]
        owners += [row] * k
        neg_side += [side[row]] * k
    groups = {"query": TextGroup(queries, instr, length["query"]),
              "positive": TextGroup(positives, side, length["positive"])}
    if negatives:
        groups["negative"] = TextGroup(negatives, neg_side, length["negative"])
    batch = TaskBatch(task, records.name, groups, num_negatives=len(negatives), max_score=records.max_score)
    if task in INFONCE_TASKS:  # relevance of each drawn positive (graded BCE targets, Eq. 4)
        stored = [c["positive_scores"][i] for i in indices]
        batch.positive_scores = [float(s[j]) if j < len(s) else math.nan for s, j in zip(stored, picked_pos)]
        batch.scores = [1.0 if math.isnan(x) else x for x in batch.positive_scores]
        batch.negative_owners, batch.negative_scores = owners, negative_scores
    if task in CLS_TASKS:
        batch.labels = [records.label_ids.get(c["label"][i], -2) for i in indices]  # -2 never equals a negative's -1
        batch.negative_labels = negative_labels
    return batch


def _hmcl_batch(records: DatasetRecords, indices: list[int], rng_of: Callable[[int], np.random.Generator],
                instr: list[str | None], queries: list[str], length: dict[str, int],
                levels: tuple[float, float]) -> TaskBatch:
    c = records.cols
    task = records.task
    pair_task = task in PAIR_TASKS
    side = instr if pair_task else [None] * len(indices)  # symmetric tasks: instruction on both sides
    positives, weaks, negatives, negative_rows = [], [], [], []
    for row, i in enumerate(indices):
        partner = c["positives"][indices[(row + 1) % len(indices)]][0]  # another record's text, for "mix"
        rng = rng_of(i)
        pos = weak = neg = None
        if pair_task:
            text2 = c["positives"][i][0]
            score = float(c["positive_scores"][i][0]) / records.max_score if c["positive_scores"][i] else 1.0
            if score >= levels[0]:
                pos = text2
            elif score >= levels[1]:
                weak = text2
            else:
                neg = text2
        else:
            pos = c["positives"][i][int(rng.integers(len(c["positives"][i])))]
            if c["negatives"][i]:
                neg = c["negatives"][i][int(rng.integers(len(c["negatives"][i])))]
        if c["weak_positives"][i] and weak is None:
            weak = c["weak_positives"][i][int(rng.integers(len(c["weak_positives"][i])))]
        if pos is None:
            pos, _ = generate_positive(c["query"][i], rng)
        if weak is None:
            weak, _ = generate_weak_positive(pos, partner, rng)
        positives.append(pos)
        weaks.append(weak)
        if neg is not None:
            negatives.append(neg)
            negative_rows.append(row)
    groups = {"query": TextGroup(queries, instr, length["query"]),
              "positive": TextGroup(positives, side, length["positive"]),
              "weak": TextGroup(weaks, side, length["weak"])}
    if negatives:
        groups["negative"] = TextGroup(negatives, [side[r] for r in negative_rows], length["negative"])
    return TaskBatch(task, records.name, groups, num_negatives=len(negatives), layout="hmcl",
                     negative_rows=negative_rows)


def _codiemb_ir_batch(records: DatasetRecords, indices: list[int], rng_of: Callable[[int], np.random.Generator],
                      instr: list[str | None], queries: list[str], length: dict[str, int], k_pos: int,
                      k_neg: int) -> TaskBatch:
    c = records.cols
    positives: list[str] = []
    negatives: list[str] = []
    for i in indices:
        rng = rng_of(i)
        pos = c["positives"][i]
        # all of them when there are enough, else with replacement (CoDiEmb §2.2)
        pick = rng.choice(len(pos), size=k_pos, replace=len(pos) < k_pos)
        positives += [pos[j] for j in pick]
        neg = c["negatives"][i]
        if neg and k_neg:
            negatives += [neg[j] for j in rng.choice(len(neg), size=k_neg, replace=len(neg) < k_neg)]
    groups = {"query": TextGroup(queries, instr, length["query"]),
              "positive": TextGroup(positives, [None] * len(positives), length["positive"])}
    if negatives:
        groups["negative"] = TextGroup(negatives, [None] * len(negatives), length["negative"])
    return TaskBatch(records.task, records.name, groups, num_negatives=len(negatives), layout="multi_positive",
                     max_score=records.max_score)

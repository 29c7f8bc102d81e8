"""Error-driven synthesis (issue 36, item 2): what the model gets wrong on dev decides what the LLM
writes more of.

Before a training stage with ``targeted_synthesis``, the model that stage starts from scores the
dev records prepare set aside (never a test set) and the worst are kept per dataset:

* retrieval — a dev query fails when its first positive ranks at ``retrieval_k`` or below among
  every dev passage of the dataset; worse = lower rank;
* sts and pair tasks (records with gold scores) — the pairs whose cosine is furthest from the gold
  score scaled to 0..1 over the dataset's dev pairs;
* classification — texts whose nearest label centroid (of the training texts) is another label;
  worse = a larger margin for the wrong label.

Each failure then picks the ``neighbours`` training records of its dataset nearest to it (by the
query's or text's embedding under the same model), one neighbour each per round, until
``max_records``: those are the records the synthesize machinery writes paraphrases and
hard negatives for (``embed_core.synthesize.run.synthesize_into``); the datasets take turns. Dev records are never training
records (prepare keeps them apart), and a training record whose rewritten text (query; a retrieval
record's first positive) equals a dev text after normalisation is never selected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embed_core.prepare.cleaning import normalize_text
from embed_core.schema import PAIR_TASKS, Record
from embed_core.synthesize.config import TargetedConfig

Embed = Callable[[list[str]], np.ndarray]


@dataclass(frozen=True)
class Failure:
    """A dev record the model gets wrong: its text (what training neighbours are found by), how
    badly (higher = worse) and in what way."""

    dataset: str
    task: str
    dev_id: str
    text: str
    severity: float
    detail: str


def retrieval_failures(dataset: str, dev: list[Record], embed: Embed, k: int,
                       embed_docs: Embed | None = None) -> list[Failure]:
    """Dev queries whose first positive ranks at ``k`` or below (0-based rank ≥ k) among every
    positive and negative passage of the dataset's dev records (``embed_docs`` encodes those,
    ``embed`` the queries: ``instructed``)."""
    queries = [r for r in dev if r.positives]
    passages = list(dict.fromkeys(t for r in queries for t in (*r.positives, *r.negatives)))
    if not queries or not passages:
        return []
    where = {t: i for i, t in enumerate(passages)}
    scores = embed([r.query for r in queries]) @ (embed_docs or embed)(passages).T
    out = []
    for rec, row in zip(queries, scores):
        best = max(row[where[p]] for p in rec.positives)
        rank = int((row > best).sum())
        if rank >= k:
            out.append(Failure(dataset, rec.task, rec.id, rec.query, float(rank), f"first positive at rank {rank + 1}"))
    return out


def pair_failures(dataset: str, dev: list[Record], embed: Embed, embed_docs: Embed | None = None) -> list[Failure]:
    """Every scored dev pair with its error |cos − gold scaled to 0..1| as severity (``embed`` the
    first texts, ``embed_docs`` the second)."""
    pairs = [r for r in dev if r.positives and r.positive_scores]
    if not pairs:
        return []
    gold = np.array([r.positive_scores[0] for r in pairs], dtype=np.float64)
    span = gold.max() - gold.min()
    scaled = (gold - gold.min()) / span if span > 0 else np.ones_like(gold)
    cos = (embed([r.query for r in pairs]) * (embed_docs or embed)([r.positives[0] for r in pairs])).sum(axis=1)
    return [Failure(dataset, r.task, r.id, r.query, float(abs(c - g)), f"cosine {c:.3f}, gold {g:.3f} (scaled)")
            for r, c, g in zip(pairs, cos, scaled)]


def classification_failures(dataset: str, dev: list[Record], train: list[Record], embed: Embed) -> list[Failure]:
    """Dev texts whose nearest centroid of the training texts' labels is another label."""
    labelled = [r for r in train if r.label is not None]
    labels = sorted({r.label for r in labelled})
    dev = [r for r in dev if r.label in labels]
    if len(labels) < 2 or not dev:
        return []
    vecs = embed([r.query for r in labelled])
    centroids = np.stack([vecs[[r.label == lab for r in labelled]].mean(axis=0) for lab in labels])
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True).clip(min=1e-12)
    scores = embed([r.query for r in dev]) @ centroids.T
    out = []
    for rec, row in zip(dev, scores):
        guess = int(row.argmax())
        if labels[guess] != rec.label:
            margin = float(row[guess] - row[labels.index(rec.label)])
            out.append(Failure(dataset, rec.task, rec.id, rec.query, margin,
                               f"labelled {rec.label}, nearest centroid {labels[guess]}"))
    return out


def failures_of(dataset: str, dev: list[Record], train: list[Record], embed: Embed,
                cfg: TargetedConfig, embed_docs: Embed | None = None) -> list[Failure]:
    """The dataset's ``cfg.failures`` worst dev records (worst first), by its dev records' task
    (``embed`` encodes queries and ``embed_docs`` documents, as the model was trained: ``instructed``)."""
    task = dev[0].task if dev else None
    if task == "retrieval":
        found = retrieval_failures(dataset, dev, embed, cfg.retrieval_k, embed_docs)
    elif task in PAIR_TASKS:
        found = pair_failures(dataset, dev, embed, embed_docs)
    elif task == "classification":
        found = classification_failures(dataset, dev, train, embed)
    else:
        found = []
    return sorted(found, key=lambda f: (-f.severity, f.dev_id))[: cfg.failures]


def _rewritten(record: Record) -> list[str]:
    """The texts of a record that synthesis rewrites: its query, and a retrieval record's first positive."""
    return [record.query, *record.positives[:1]] if record.task == "retrieval" else [record.query]


def select_records(failures: list[Failure], train: dict[str, list[Record]], dev_texts: set[str], embed: Embed,
                   cfg: TargetedConfig) -> list[tuple[Failure, Record]]:
    """(failure, training record) pairs: each failure's nearest training records of its dataset,
    one neighbour each per round, the datasets' worst failures first (``failures`` is each
    dataset's failures worst first), until ``cfg.max_records`` records."""
    nearest: dict[int, list[Record]] = {}
    for dataset in dict.fromkeys(f.dataset for f in failures):
        pool = [r for r in train.get(dataset, []) if not any(normalize_text(t) in dev_texts for t in _rewritten(r))]
        mine = [i for i, f in enumerate(failures) if f.dataset == dataset]
        if not pool or not mine:
            continue
        sims = embed([failures[i].text for i in mine]) @ embed([r.query for r in pool]).T
        for i, row in zip(mine, sims):
            nearest[i] = [pool[j] for j in np.argsort(-row, kind="stable")[: cfg.neighbours]]
    # the worst failure of every dataset, then the second worst of every dataset, ... (severities of
    # different tasks are on different scales)
    place = {i: sum(1 for j in range(i) if failures[j].dataset == failures[i].dataset) for i in nearest}
    order = sorted(nearest, key=lambda i: (place[i], failures[i].dataset))
    chosen: list[tuple[Failure, Record]] = []
    taken: set[str] = set()
    for round_ in range(cfg.neighbours):
        for i in order:
            if len(taken) >= cfg.max_records:
                return chosen
            if round_ < len(nearest[i]) and nearest[i][round_].id not in taken:
                taken.add(nearest[i][round_].id)
                chosen.append((failures[i], nearest[i][round_]))
    return chosen

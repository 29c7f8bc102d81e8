"""Positive-aware hard-negative mining with FAISS.

For each eligible record: retrieve the top ``range_max`` candidates (plus room for the
positives) by cosine similarity; drop the query itself, its positives and any exact or normalised
duplicate (and, for classification, every candidate carrying the record's own label — consistent
with the CLS loss mask of QZhou Eq. 3); drop candidates that score too close to the positives
(NV-Retriever's TopK-PercPos: keep only ``score < relative_margin × lowest positive score``,
default 0.95; optionally ``score < lowest positive score − absolute_margin``); then take the rank
window ``[range_min, range_max)`` of the survivors (QZhou §6.1: ranks 10–30). Filtering before the
window is NV-Retriever's order and the one sentence-transformers' ``mine_hard_negatives`` uses, so
both select the same negatives. The first ``num_negatives`` of the window (or a seeded random
sample) are appended with their scores in ``negative_scores``.
Records that end with fewer are reported, never silently padded unless ``pad_random`` is set.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import faiss
import numpy as np

from embed_core.config import MineConfig
from embed_core.prepare.cleaning import normalize_text
from embed_core.schema import Record

Embed = Callable[[list[str]], np.ndarray]


@dataclass
class MineSettings:
    """The knobs of ``mine_records`` (a ``MineConfig`` without model and I/O settings)."""

    range_min: int = 10
    range_max: int = 30
    num_negatives: int = 4
    relative_margin: float | None = 0.95
    absolute_margin: float | None = None
    sampling: str = "top"
    only_missing: bool = True
    pad_random: bool = False
    tasks: tuple[str, ...] = ("retrieval", "classification")
    index_type: str = "flat"
    nlist: int = 1024
    nprobe: int = 32
    hnsw_m: int = 32
    ef_search: int = 128
    query_chunk_size: int = 2048
    seed: int = 42

    @classmethod
    def from_config(cls, cfg: MineConfig, seed: int) -> "MineSettings":
        return cls(range_min=cfg.range_min, range_max=cfg.range_max, num_negatives=cfg.num_negatives,
                   relative_margin=cfg.relative_margin, absolute_margin=cfg.absolute_margin,
                   sampling=cfg.sampling, only_missing=cfg.only_missing, pad_random=cfg.pad_random,
                   tasks=tuple(cfg.tasks), index_type=cfg.index.type, nlist=cfg.index.nlist,
                   nprobe=cfg.index.nprobe, hnsw_m=cfg.index.hnsw_m, ef_search=cfg.index.ef_search,
                   query_chunk_size=cfg.query_chunk_size, seed=seed)


@dataclass
class MineStats:
    queries: int = 0
    negatives_added: int = 0
    too_few: int = 0
    too_few_examples: list[str] = field(default_factory=list)
    padded: int = 0
    positive_scores: list[float] = field(default_factory=list)
    kept_scores: list[float] = field(default_factory=list)
    filtered_scores: list[float] = field(default_factory=list)  # in the window, removed by the margin
    index: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def q(xs):
            return {k: round(float(v), 4) for k, v in zip(("p10", "p50", "p90"), np.percentile(xs, [10, 50, 90]))} if xs else {}

        return {"queries": self.queries, "negatives_added": self.negatives_added, "too_few": self.too_few,
                "too_few_examples": self.too_few_examples, "padded": self.padded, "index": self.index,
                "filtered_by_margin": len(self.filtered_scores), "positive_score": q(self.positive_scores),
                "kept_score": q(self.kept_scores), "filtered_score": q(self.filtered_scores)}


def build_index(vectors: np.ndarray, s: MineSettings) -> tuple[faiss.Index, dict[str, Any]]:
    """Inner-product index over L2-normalised vectors (= cosine). Flat unless configured."""
    dim = vectors.shape[1]
    if s.index_type == "flat" or len(vectors) < 10_000:
        index, info = faiss.IndexFlatIP(dim), {"type": "flat"}
        if s.index_type != "flat":
            info["note"] = f"{s.index_type} requested, flat used for a pool of {len(vectors)}"
    elif s.index_type == "ivf":
        nlist = max(1, min(s.nlist, len(vectors) // 39))  # faiss wants >= 39 points per centroid
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
        index.nprobe = min(s.nprobe, nlist)
        info = {"type": "ivf", "nlist": nlist, "nprobe": index.nprobe}
    else:
        index = faiss.IndexHNSWFlat(dim, s.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = max(s.ef_search, s.range_max * 2)
        info = {"type": "hnsw", "m": s.hnsw_m, "ef_search": index.hnsw.efSearch}
    index.add(vectors)
    info["size"] = int(index.ntotal)
    return index, info


def eligible(record: Record, s: MineSettings) -> bool:
    if record.task not in s.tasks:
        return False
    return not (s.only_missing and len(record.negatives) >= s.num_negatives)


def mine_records(records: list[Record], embed: Embed, s: MineSettings,
                 corpus: list[str] | None = None) -> tuple[list[Record], MineStats]:
    """Return ``records`` with mined negatives added to the eligible ones, and the statistics."""
    stats = MineStats()
    todo = [i for i, r in enumerate(records) if eligible(r, s)]
    if not todo:
        return list(records), stats

    # Candidate pool: the configured corpus, or every text the dataset offers as a document.
    labels: dict[str, set[str]] = defaultdict(set)
    if corpus is None:
        pool_set: dict[str, None] = {}
        for r in records:
            for t in r.positives:
                pool_set.setdefault(t)
            for t in r.negatives:
                pool_set.setdefault(t)
            if r.task == "classification":
                pool_set.setdefault(r.query)
        pool = list(pool_set)
    else:
        pool = list(dict.fromkeys(corpus))
    for r in records:  # labels of texts, for label-aware selection
        if r.label is not None:
            labels[r.query].add(r.label)
            for t in r.positives:
                labels[t].add(r.label)
        for t, lab in zip(r.negatives, r.negative_labels):
            labels[t].add(lab)
    pool_norm = [normalize_text(t) for t in pool]
    pool_vecs = embed(pool)
    index, stats.index = build_index(pool_vecs, s)

    queries = [records[i].query for i in todo]
    query_vecs = embed(queries)
    pos_texts = sorted({t for i in todo for t in records[i].positives})
    pos_vecs = dict(zip(pos_texts, embed(pos_texts)))
    old_neg_texts = sorted({t for i in todo for t in records[i].negatives if not records[i].negative_scores})
    old_neg_vecs = dict(zip(old_neg_texts, embed(old_neg_texts))) if old_neg_texts else {}

    rng = random.Random(s.seed)
    out = list(records)
    max_pos = max(len(records[i].positives) for i in todo)
    widen = 4 if any(records[i].task == "classification" for i in todo) else 1
    # Candidates considered per query: the top range_max retrieved, plus room for the positives
    # (as NV-Retriever and sentence-transformers do); classification looks 4x deeper because
    # same-label neighbours are removed.
    budget = (s.range_max + max_pos) * widen
    k = min(len(pool), budget + 32)  # slack for the query itself and duplicates, which use no budget
    for start in range(0, len(todo), s.query_chunk_size):
        chunk = todo[start:start + s.query_chunk_size]
        scores, ids = index.search(query_vecs[start:start + len(chunk)], k)
        for row, rec_i in enumerate(chunk):
            rec = records[rec_i]
            qv = query_vecs[start + row]
            pos_scores = [float(qv @ pos_vecs[p]) for p in rec.positives]
            stats.positive_scores.extend(pos_scores)
            floor = min(pos_scores)
            positives_norm = {normalize_text(p) for p in rec.positives}
            seen = {normalize_text(rec.query), *(normalize_text(n) for n in rec.negatives)}
            considered = 0
            survivors: list[tuple[int, float]] = []
            for score, j in zip(scores[row], ids[row]):
                if j < 0 or pool_norm[j] in seen:
                    continue  # the query itself, a current negative, or a duplicate already considered
                if considered >= budget:
                    break
                considered += 1
                if pool_norm[j] in positives_norm:
                    continue
                seen.add(pool_norm[j])
                if rec.task == "classification" and (rec.label in labels.get(pool[j], ()) or not labels.get(pool[j])):
                    continue
                score = float(score)
                if (s.relative_margin is not None and score >= s.relative_margin * floor) or \
                        (s.absolute_margin is not None and score >= floor - s.absolute_margin):
                    stats.filtered_scores.append(score)
                    continue
                survivors.append((int(j), score))
            kept = survivors[s.range_min:s.range_max]
            chosen = kept[: s.num_negatives] if s.sampling == "top" else rng.sample(kept, min(len(kept), s.num_negatives))
            need = s.num_negatives - len(chosen)
            if need > 0 and s.pad_random:
                taken = {j for j, _ in chosen}
                fill = [j for j in rng.sample(range(len(pool)), min(len(pool), need * 4 + 8))
                        if j not in taken and pool_norm[j] not in seen and pool_norm[j] not in positives_norm][:need]
                chosen += [(j, float(qv @ pool_vecs[j])) for j in fill]
                stats.padded += len(fill)
            if len(chosen) < s.num_negatives:
                stats.too_few += 1
                if len(stats.too_few_examples) < 5:
                    stats.too_few_examples.append(f"{rec.id} ({len(chosen)} of {s.num_negatives})")
            stats.queries += 1
            stats.negatives_added += len(chosen)
            stats.kept_scores.extend(score for _, score in chosen)
            old_scores = list(rec.negative_scores) or [float(qv @ old_neg_vecs[t]) for t in rec.negatives]
            new_labels = list(rec.negative_labels)
            if rec.task == "classification":
                new_labels += [sorted(labels[pool[j]])[0] for j, _ in chosen]
            out[rec_i] = replace(rec, negatives=[*rec.negatives, *(pool[j] for j, _ in chosen)],
                                 negative_scores=[*old_scores, *(round(sc, 6) for _, sc in chosen)],
                                 negative_labels=new_labels)
    return out, stats

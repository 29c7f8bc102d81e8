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
With ``mine.teacher`` a stronger model rescores each query chunk's window candidates in one batched
call (``embed_core.mine.teacher``): those it scores at or above the record's lowest positive (less
``teacher.margin``) are dropped before the negatives are chosen, and the record keeps the teacher's
scores of its positives and negatives (the distillation losses' targets).
"""

from __future__ import annotations

import hashlib
import os
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from embed_core.mine.config import MineConfig
from embed_core.errors import ConfigError
from embed_core.model.settings import ModelSettings, instructed
from embed_core.prepare.cleaning import normalize_text
from embed_core.schema import Record

Embed = Callable[[list[str]], np.ndarray]
PairScorer = Callable[[list[tuple[str, str]]], np.ndarray]  # (query, text) pairs -> a teacher's scores
Scores = Callable[[str, str], float]  # (query, text) -> its score (one chunk's, looked up)


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
    teacher_dropped: int = 0  # window candidates the teacher scored at or above the positive
    teacher_dropped_examples: list[str] = field(default_factory=list)
    index: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def q(xs):
            return {k: round(float(v), 4) for k, v in zip(("p10", "p50", "p90"), np.percentile(xs, [10, 50, 90]))} if xs else {}

        return {"queries": self.queries, "negatives_added": self.negatives_added, "too_few": self.too_few,
                "too_few_examples": self.too_few_examples, "padded": self.padded, "index": self.index,
                "filtered_by_margin": len(self.filtered_scores), "dropped_by_teacher": self.teacher_dropped,
                "dropped_by_teacher_examples": self.teacher_dropped_examples, "positive_score": q(self.positive_scores),
                "kept_score": q(self.kept_scores), "filtered_score": q(self.filtered_scores)}


def new_index(dim: int, factory: str) -> faiss.Index:
    """An empty inner-product index from a ``faiss.index_factory`` string (a ConfigError names a bad one)."""
    try:
        return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        lines = [x for x in str(exc).strip().splitlines() if x.strip()]
        reason = lines[-1].strip() if lines else "not understood"
        raise ConfigError(f"mine.index.factory: faiss.index_factory cannot build {factory!r} for "
                          f"{dim}-d vectors ({reason[:200]})") from None


def build_index(pool: list[str], embed: Embed, cfg: MineConfig, seed: int,
                index_dir: Path | None = None) -> tuple[faiss.Index, dict[str, Any]]:
    """The pool's index, filled ``add_chunk_size`` texts at a time: the pool's embeddings are never
    all in memory outside the index (with the embedding cache, a chunk is encoded once and read
    back from its memory-mapped shards). Indexes that need training (IVF, PQ) are trained first on
    a seeded sample of ``train_size`` pool vectors; IVF's clusters are capped at sample / 39.
    ``on_disk`` (IVF only): the inverted lists go to a memory-mapped file in ``index_dir``
    (``fill_on_disk``), so not even the index needs to fit in memory. ``seed`` draws the training sample."""
    s = cfg.index
    first = embed(pool[: s.add_chunk_size])
    index = new_index(first.shape[1], s.factory)
    info: dict[str, Any] = {"factory": s.factory}
    ivf = faiss.try_extract_index_ivf(index)
    if s.on_disk and ivf is None:
        raise ConfigError(f"mine.index.on_disk: only IVF indexes keep their lists on disk; {s.factory!r} "
                          "has none (use e.g. 'IVF4096,PQ64')")
    if not index.is_trained:
        rng = np.random.default_rng(seed)
        sample = np.sort(rng.choice(len(pool), size=min(s.train_size, len(pool)), replace=False))
        vectors = embed([pool[i] for i in sample])
        if ivf is not None and ivf.nlist * 39 > len(vectors):
            raise ConfigError(f"mine.index.factory {s.factory!r}: {ivf.nlist} clusters need at least "
                              f"{ivf.nlist * 39} training vectors, the pool sample has {len(vectors)}; use fewer "
                              "clusters (about pool / 39 at most) or 'Flat' for small pools")
        index.train(vectors)
        info["trained_on"] = len(vectors)
        del vectors
    if ivf is not None:
        ivf.nprobe = min(s.nprobe, ivf.nlist)
        info.update(nlist=int(ivf.nlist), nprobe=int(ivf.nprobe))
    hnsw = getattr(faiss.downcast_index(index), "hnsw", None)
    if hnsw is not None:
        hnsw.efSearch = max(s.ef_search, cfg.range_max * 2)
        info["ef_search"] = int(hnsw.efSearch)

    def chunks(head: np.ndarray):
        """(first pool id, vectors) of every add chunk; the first one was encoded above."""
        yield 0, head
        del head
        for start in range(s.add_chunk_size, len(pool), s.add_chunk_size):
            yield start, embed(pool[start:start + s.add_chunk_size])

    pool_chunks = chunks(first)
    del first  # held by the generator until it is added
    if s.on_disk:
        if index_dir is None:
            raise ValueError("build_index: on_disk needs index_dir")
        info["on_disk"] = fill_on_disk(index, pool_chunks, Path(index_dir))
    else:
        for _, vectors in pool_chunks:
            index.add(vectors)
        if s.gpu and getattr(faiss, "get_num_gpus", lambda: 0)() > 0:  # faiss-gpu: search on every GPU
            index = faiss.index_cpu_to_all_gpus(index)
            info["gpus"] = faiss.get_num_gpus()
    info["size"] = int(index.ntotal)
    return index, info


def fill_on_disk(index: faiss.Index, chunks, index_dir: Path) -> dict[str, Any]:
    """Fill a trained, empty IVF ``index`` from ``(first pool id, vectors)`` chunks the way faiss
    documents for indexes larger than memory: each chunk goes into a copy of the empty index under
    its pool ids and is written as a shard, then the shards' lists (memory-mapped, never loaded) are
    merged into one ``OnDiskInvertedLists`` file that the index maps: only the centroids are
    anonymous memory, the lists are file pages the kernel can drop. (faiss.contrib.ondisk's
    ``merge_ondisk`` does the same merge but never frees the shards' mappings.)"""
    index_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for start, vectors in chunks:
        shard = faiss.clone_index(index)
        shard.add_with_ids(vectors, np.arange(start, start + len(vectors), dtype=np.int64))
        paths.append(str(index_dir / f"shard-{len(paths):05d}.index"))
        faiss.write_index(shard, paths[-1])
        del shard, vectors
    shards = [faiss.read_index(p, faiss.IO_FLAG_MMAP) for p in paths]
    shard_lists = faiss.InvertedListsPtrVector()
    for shard in shards:
        shard_lists.push_back(faiss.extract_index_ivf(shard).invlists)
    ivf = faiss.extract_index_ivf(index)
    lists_path = index_dir / "lists.ivfdata"
    lists = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(lists_path))
    ivf.ntotal = index.ntotal = lists.merge_from_multiple(shard_lists.data(), shard_lists.size(), False)
    ivf.replace_invlists(lists, True)  # the index owns (and frees) the merged lists
    lists.this.disown()
    del shard_lists, shards  # unmaps the shards
    for path in paths:
        os.remove(path)
    return {"lists_file": lists_path.name, "shards": len(paths), "bytes": lists_path.stat().st_size}


def normalized_key(text: str) -> int:
    """A 64-bit key of the normalised text: duplicate checks without a second copy of the pool."""
    return int.from_bytes(hashlib.blake2b(normalize_text(text).encode("utf-8", "surrogatepass"),
                                          digest_size=8).digest(), "little")


def eligible(record: Record, cfg: MineConfig) -> bool:
    if record.task not in cfg.tasks:
        return False
    return not (cfg.only_missing and len(record.negatives) >= cfg.num_negatives)


def candidate_pool(records: list[Record], corpus: list[str] | None) -> list[str]:
    """The texts negatives are drawn from: the configured corpus, or every text the dataset offers
    as a document (positives, negatives, and classification texts), each once, in first-seen order."""
    if corpus is not None:
        return list(dict.fromkeys(corpus))
    pool: dict[str, None] = {}
    for r in records:
        for t in r.positives:
            pool.setdefault(t)
        for t in r.negatives:
            pool.setdefault(t)
        if r.task == "classification":
            pool.setdefault(r.query)
    return list(pool)


def text_labels(records: list[Record]) -> dict[str, set[str]]:
    """The labels each text carries anywhere in ``records`` (for label-aware selection)."""
    labels: dict[str, set[str]] = defaultdict(set)
    for r in records:
        if r.label is not None:
            labels[r.query].add(r.label)
            for t in r.positives:
                labels[t].add(r.label)
        for t, lab in zip(r.negatives, r.negative_labels):
            labels[t].add(lab)
    return labels


@dataclass
class _Miner:
    """One dataset's mining: the pool and its index, the rules (``cfg``) and the statistics."""

    cfg: MineConfig
    embed: Embed
    pool: list[str]
    labels: dict[str, set[str]]
    rng: random.Random
    stats: MineStats
    pool_norm: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pool_norm = [normalized_key(t) for t in self.pool]

    def survivors(self, rec: Record, scores, ids, floor: float, budget: int,
                  seen: set[int], positives_norm: set[int]) -> list[tuple[int, float]]:
        """(pool id, score) of the retrieved candidates that pass the rules, in rank order: not the
        query, a positive, a current negative or a duplicate; of another label (classification);
        below the margins under the lowest positive score. Adds what it considered to ``seen``."""
        cfg, pool_norm = self.cfg, self.pool_norm
        considered = 0
        out: list[tuple[int, float]] = []
        for score, j in zip(scores, ids):
            if j < 0 or pool_norm[j] in seen:
                continue  # the query itself, a current negative, or a duplicate already considered
            if considered >= budget:
                break
            considered += 1
            if pool_norm[j] in positives_norm:
                continue
            seen.add(pool_norm[j])
            if rec.task == "classification" and (rec.label in self.labels.get(self.pool[j], ())
                                                 or not self.labels.get(self.pool[j])):
                continue
            score = float(score)
            if (cfg.relative_margin is not None and score >= cfg.relative_margin * floor) or \
                    (cfg.absolute_margin is not None and score >= floor - cfg.absolute_margin):
                self.stats.filtered_scores.append(score)
                continue
            out.append((int(j), score))
        return out

    def choose(self, kept: list[tuple[int, float]], qv: np.ndarray, seen: set[int],
               positives_norm: set[int]) -> list[tuple[int, float]]:
        """The negatives of the window's candidates ``kept`` (top or seeded sample), padded with
        random pool texts if asked."""
        cfg, rng = self.cfg, self.rng
        chosen = kept[: cfg.num_negatives] if cfg.sampling == "top" else rng.sample(kept, min(len(kept), cfg.num_negatives))
        need = cfg.num_negatives - len(chosen)
        if need > 0 and cfg.pad_random:
            taken = {j for j, _ in chosen}
            fill = [j for j in rng.sample(range(len(self.pool)), min(len(self.pool), need * 4 + 8))
                    if j not in taken and self.pool_norm[j] not in seen and self.pool_norm[j] not in positives_norm][:need]
            if fill:
                chosen += [(j, float(qv @ v)) for j, v in zip(fill, self.embed([self.pool[j] for j in fill]))]
            self.stats.padded += len(fill)
        return chosen

    def window(self, rec: Record, qv: np.ndarray, scores, ids, budget: int,
               pos_vecs: dict[str, np.ndarray]) -> "Pending":
        """``rec``'s candidates that pass the rules, in the rank window (before any teacher)."""
        pos_scores = [float(qv @ pos_vecs[p]) for p in rec.positives]
        self.stats.positive_scores.extend(pos_scores)
        positives_norm = {normalized_key(p) for p in rec.positives}
        seen = {normalized_key(rec.query), *(normalized_key(n) for n in rec.negatives)}
        survivors = self.survivors(rec, scores, ids, min(pos_scores), budget, seen, positives_norm)
        return Pending(rec, qv, seen, positives_norm, survivors[self.cfg.range_min:self.cfg.range_max])

    def mine_one(self, p: "Pending", old_neg_vecs: dict[str, np.ndarray], teacher: "Scores | None" = None) -> Record:
        """``p.rec`` with its mined negatives (and the scores of all its negatives) added; with
        ``teacher`` ((query, text) -> score, ``embed_core.mine.teacher``) the window's candidates it
        scores at or above the lowest positive (less ``teacher.margin``) are dropped first, and the
        record's scores are the teacher's."""
        stats, num, rec = self.stats, self.cfg.num_negatives, p.rec
        kept = p.kept
        if teacher is not None:
            floor = min(teacher(rec.query, t) for t in rec.positives) - self.cfg.teacher.margin
            dropped = [(j, sc) for j, sc in kept if teacher(rec.query, self.pool[j]) >= floor]
            stats.teacher_dropped += len(dropped)
            stats.teacher_dropped_examples += [f"{rec.id}: {self.pool[j][:60]!r}" for j, _ in dropped][
                :max(0, 5 - len(stats.teacher_dropped_examples))]
            kept = [c for c in kept if c not in dropped]
        chosen = self.choose(kept, p.qv, p.seen, p.positives_norm)
        if len(chosen) < num:
            stats.too_few += 1
            if len(stats.too_few_examples) < 5:
                stats.too_few_examples.append(f"{rec.id} ({len(chosen)} of {num})")
        stats.queries += 1
        stats.negatives_added += len(chosen)
        stats.kept_scores.extend(score for _, score in chosen)
        old_scores = list(rec.negative_scores) or [float(p.qv @ old_neg_vecs[t]) for t in rec.negatives]
        new_labels = list(rec.negative_labels)
        if rec.task == "classification":
            new_labels += [sorted(self.labels[self.pool[j]])[0] for j, _ in chosen]
        out = replace(rec, negatives=[*rec.negatives, *(self.pool[j] for j, _ in chosen)],
                      negative_scores=[*old_scores, *(round(sc, 6) for _, sc in chosen)],
                      negative_labels=new_labels)
        if teacher is not None:  # the teacher's scores replace the mining model's (distillation targets)
            out = replace(out, positive_scores=[round(teacher(rec.query, t), 6) for t in out.positives],
                          negative_scores=[round(teacher(rec.query, t), 6) for t in out.negatives])
        return out


@dataclass
class Pending:
    """A record between its window (``_Miner.window``) and its negatives (``_Miner.mine_one``)."""

    rec: Record
    qv: np.ndarray
    seen: set[int]
    positives_norm: set[int]
    kept: list[tuple[int, float]]  # (pool id, score) of the window's candidates


def mine_records(records: list[Record], embed: Embed, cfg: MineConfig, corpus: list[str] | None = None,
                 index_dir: Path | None = None, *, seed: int, settings: ModelSettings | None = None,
                 teacher: "PairScorer | None" = None) -> tuple[list[Record], MineStats]:
    """Return ``records`` with mined negatives added to the eligible ones, and the statistics.
    ``index_dir``: where an ``on_disk`` index keeps its files (the caller removes them); ``seed``:
    the run's seed (index training sample, random sampling and padding); ``settings``: the mining
    model's (``read_model_settings``), so a model trained with instructions mines with them
    (``instructed``); ``teacher``: scores (query, text) pairs (``cfg.teacher``'s model,
    ``embed_core.mine.teacher``)."""
    stats = MineStats()
    todo = [i for i, r in enumerate(records) if eligible(r, cfg)]
    if not todo:
        return list(records), stats
    embed, embed_queries = instructed(records, embed, settings)
    pool = candidate_pool(records, corpus)
    miner = _Miner(cfg, embed, pool, text_labels(records), random.Random(seed), stats)
    index, stats.index = build_index(pool, embed, cfg, seed, index_dir)

    query_vecs = embed_queries([records[i].query for i in todo])
    pos_texts = sorted({t for i in todo for t in records[i].positives})
    pos_vecs = dict(zip(pos_texts, embed(pos_texts)))
    old_neg_texts = sorted({t for i in todo for t in records[i].negatives if not records[i].negative_scores})
    old_neg_vecs = dict(zip(old_neg_texts, embed(old_neg_texts))) if old_neg_texts else {}

    out = list(records)
    max_pos = max(len(records[i].positives) for i in todo)
    widen = 4 if any(records[i].task == "classification" for i in todo) else 1
    # Candidates considered per query: the top range_max retrieved, plus room for the positives
    # (as NV-Retriever and sentence-transformers do); classification looks 4x deeper because
    # same-label neighbours are removed.
    budget = (cfg.range_max + max_pos) * widen
    k = min(len(pool), budget + 32)  # slack for the query itself and duplicates, which use no budget
    for start in range(0, len(todo), cfg.query_chunk_size):
        chunk = todo[start:start + cfg.query_chunk_size]
        scores, ids = index.search(query_vecs[start:start + len(chunk)], k)
        pending = [miner.window(records[rec_i], query_vecs[start + row], scores[row], ids[row], budget, pos_vecs)
                   for row, rec_i in enumerate(chunk)]
        scored = teacher_scores(teacher, pending, pool) if teacher is not None else None
        for rec_i, p in zip(chunk, pending):
            out[rec_i] = miner.mine_one(p, old_neg_vecs, scored)
    return out, stats


def teacher_scores(teacher: "PairScorer", pending: list[Pending], pool: list[str]) -> "Scores":
    """(query, text) -> the teacher's score, for every pair the chunk's records may keep (their
    positives, current negatives and window candidates), scored in one batched call; a pair asked
    for later (a random pad) is scored then."""
    pairs = list(dict.fromkeys((p.rec.query, t) for p in pending
                               for t in (*p.rec.positives, *p.rec.negatives, *(pool[j] for j, _ in p.kept))))
    known = dict(zip(pairs, (float(x) for x in teacher(pairs))))

    def score(query: str, text: str) -> float:
        if (query, text) not in known:
            known[(query, text)] = float(teacher([(query, text)])[0])
        return known[(query, text)]

    return score


def negative_sources(before: list[Record], after: list[Record]) -> dict[str, int]:
    """Where the negatives of ``after`` (``before`` mined) come from: ``llm`` (the LLM's, first in a
    record of origin llm_negative), ``mined`` (appended by this mining) and ``original`` (the rest:
    the source data's own, or an earlier mining's)."""
    had = {r.id: len(r.negatives) for r in before}
    out = {"original": 0, "llm": 0, "mined": 0}
    for r in after:
        n = had.get(r.id, len(r.negatives))
        llm = 1 if r.origin == "llm_negative" and n else 0
        out["llm"] += llm
        out["original"] += n - llm
        out["mined"] += len(r.negatives) - n
    return out

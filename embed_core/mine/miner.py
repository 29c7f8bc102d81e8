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

from embed_core.config import MineConfig
from embed_core.errors import ConfigError
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
    index_factory: str = "Flat"
    nprobe: int = 32
    ef_search: int = 128
    train_size: int = 100_000
    add_chunk_size: int = 16384
    on_disk: bool = False
    gpu: bool = True
    query_chunk_size: int = 2048
    seed: int = 42

    @classmethod
    def from_config(cls, cfg: MineConfig, seed: int) -> "MineSettings":
        return cls(range_min=cfg.range_min, range_max=cfg.range_max, num_negatives=cfg.num_negatives,
                   relative_margin=cfg.relative_margin, absolute_margin=cfg.absolute_margin,
                   sampling=cfg.sampling, only_missing=cfg.only_missing, pad_random=cfg.pad_random,
                   tasks=tuple(cfg.tasks), index_factory=cfg.index.factory, nprobe=cfg.index.nprobe,
                   ef_search=cfg.index.ef_search, train_size=cfg.index.train_size,
                   add_chunk_size=cfg.index.add_chunk_size, on_disk=cfg.index.on_disk, gpu=cfg.index.gpu,
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


def new_index(dim: int, s: MineSettings) -> faiss.Index:
    """An empty inner-product index from ``s.index_factory`` (a ConfigError names a bad string)."""
    try:
        return faiss.index_factory(dim, s.index_factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        lines = [x for x in str(exc).strip().splitlines() if x.strip()]
        reason = lines[-1].strip() if lines else "not understood"
        raise ConfigError(f"mine.index.factory: faiss.index_factory cannot build {s.index_factory!r} for "
                          f"{dim}-d vectors ({reason[:200]})") from None


def build_index(pool: list[str], embed: Embed, s: MineSettings,
                index_dir: Path | None = None) -> tuple[faiss.Index, dict[str, Any]]:
    """The pool's index, filled ``add_chunk_size`` texts at a time: the pool's embeddings are never
    all in memory outside the index (with the embedding cache, a chunk is encoded once and read
    back from its memory-mapped shards). Indexes that need training (IVF, PQ) are trained first on
    a seeded sample of ``train_size`` pool vectors; IVF's clusters are capped at sample / 39.
    ``on_disk`` (IVF only): the inverted lists go to a memory-mapped file in ``index_dir``
    (``fill_on_disk``), so not even the index needs to fit in memory."""
    first = embed(pool[: s.add_chunk_size])
    index = new_index(first.shape[1], s)
    info: dict[str, Any] = {"factory": s.index_factory}
    ivf = faiss.try_extract_index_ivf(index)
    if s.on_disk and ivf is None:
        raise ConfigError(f"mine.index.on_disk: only IVF indexes keep their lists on disk; {s.index_factory!r} "
                          "has none (use e.g. 'IVF4096,PQ64')")
    if not index.is_trained:
        rng = np.random.default_rng(s.seed)
        sample = np.sort(rng.choice(len(pool), size=min(s.train_size, len(pool)), replace=False))
        vectors = embed([pool[i] for i in sample])
        if ivf is not None and ivf.nlist * 39 > len(vectors):
            raise ConfigError(f"mine.index.factory {s.index_factory!r}: {ivf.nlist} clusters need at least "
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
        hnsw.efSearch = max(s.ef_search, s.range_max * 2)
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


def eligible(record: Record, s: MineSettings) -> bool:
    if record.task not in s.tasks:
        return False
    return not (s.only_missing and len(record.negatives) >= s.num_negatives)


def mine_records(records: list[Record], embed: Embed, s: MineSettings, corpus: list[str] | None = None,
                 index_dir: Path | None = None) -> tuple[list[Record], MineStats]:
    """Return ``records`` with mined negatives added to the eligible ones, and the statistics.
    ``index_dir``: where an ``on_disk`` index keeps its files (the caller removes them)."""
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
    pool_norm = [normalized_key(t) for t in pool]
    index, stats.index = build_index(pool, embed, s, index_dir)

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
            positives_norm = {normalized_key(p) for p in rec.positives}
            seen = {normalized_key(rec.query), *(normalized_key(n) for n in rec.negatives)}
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
                if fill:
                    chosen += [(j, float(qv @ v)) for j, v in zip(fill, embed([pool[j] for j in fill]))]
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

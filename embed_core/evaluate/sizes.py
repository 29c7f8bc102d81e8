"""Scores by embedding size and precision (``evaluate.dims``, ``evaluate.precisions``,
``evaluate.rescore_multiplier``): what a Matryoshka cut, int8 and binary vectors cost in quality,
next to what they save in bytes.

Every variant reuses the embeddings the float32 evaluation of the same model and task made (the
text-level embedding cache: nothing is encoded again); mteb scores each variant with its own task
evaluator. Exactly what is computed:

* **size d**: the first d coordinates of each embedding, L2-normalised again (what a Matryoshka
  loss trains, ``embed_core.losses.matryoshka``); at the model's full size the embeddings as they are.
* **float32**: those vectors, scored as usual (cosine).
* **int8**: sentence-transformers' ``quantize_embeddings(precision="int8", ranges=...)`` with the
  ranges (per-dimension min and max) of the task's *corpus* embeddings at that size: the corpus
  documents for retrieval, every text the float32 evaluation encoded for the other task types
  (both sides of STS and pair pairs, the classification texts). The same ranges quantize the queries.
* **ubinary**: ``quantize_embeddings(precision="ubinary")`` (bit = coordinate > 0, packed), scored
  through its unpacked ±1 vectors: for ±1 vectors, cosine = dot / d = 1 − 2·hamming / d, so every
  ranking and correlation equals that of the Hamming distance.
* **retrieval** (``QuantizedIndex``, mteb's index backend): float32 by cosine; int8 by the inner
  product of the int8 codes (sentence-transformers' ``semantic_search_usearch``: an ``ip`` index
  over ``i8``); ubinary by Hamming distance. With ``rescore_multiplier`` k, a second row: the
  search a user deploys, ``rescore_top_k`` (n) hits from n·k candidates by the quantized score,
  rescored with the float32 query against the candidate's quantized vector as sentence-transformers
  rescores (int8 dequantized to its bucket's lower edge; ubinary as 0/1 bits). The corpus stays
  quantized: same bytes per vector. With ``rescore_with: int8`` (``float32``) the candidates are
  rescored with the documents' int8 (original float32) vectors instead, as read from disk beside a
  binary index. mteb asks for 1,000 hits: the n·k rescored candidates come first, in rescored order,
  then the rest in first-stage order (their scores only order them, below every rescored one), so
  the main score at 10 measures the deployed search, not a rescoring of the whole corpus.
* **STS, pair classification, classification**: mteb's own evaluator on the quantized vectors as
  floats (int8 codes; ±1 for ubinary), like mteb's ``CompressionWrapper`` but with ranges from the
  whole task: STS's main score is then the Spearman correlation of the codes' cosine.

Bytes per vector: float32 4·d, int8 d, ubinary ⌈d/8⌉.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.search_wrappers import SearchEncoderWrapper

from embed_core.errors import ConfigError

QUANTIZED = ("int8", "ubinary")
QUERY_CHUNK = 256  # queries scored against the whole corpus at once


def bytes_per_vector(dim: int, precision: str) -> int:
    return {"float32": 4 * dim, "int8": dim, "ubinary": math.ceil(dim / 8)}[precision]


def cut(emb: np.ndarray, dim: int) -> np.ndarray:
    """The first ``dim`` coordinates, L2-normalised again (the embeddings as they are at full size)."""
    emb = np.asarray(emb, dtype=np.float32)
    if dim >= emb.shape[1]:
        return emb
    part = emb[:, :dim]
    return part / np.maximum(np.linalg.norm(part, axis=1, keepdims=True), 1e-12)


def int8_ranges(calibration: np.ndarray) -> np.ndarray:
    """Per-dimension (min, max) of the calibration embeddings, ``[2, d]`` (sentence-transformers'
    layout for ``quantize_embeddings(ranges=...)``)."""
    return np.vstack((calibration.min(axis=0), calibration.max(axis=0)))


def quantized(emb: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """The vectors scored for ``precision``, as float32: the embeddings (float32), the int8 codes
    (int8), or the unpacked bits as ±1 (ubinary)."""
    from sentence_transformers.util import quantize_embeddings

    if precision == "float32":
        return emb
    if precision == "int8":
        return quantize_embeddings(emb, precision="int8", ranges=ranges).astype(np.float32)
    bits = np.unpackbits(quantize_embeddings(emb, precision="ubinary"), axis=1, count=emb.shape[1])
    return 2.0 * bits.astype(np.float32) - 1.0


def rescoring_vectors(emb: np.ndarray, precision: str, ranges: np.ndarray | None) -> np.ndarray:
    """A document's quantized vector as sentence-transformers rescores it against a float32 query:
    int8 codes dequantized to their bucket's lower edge, ubinary bits as 0/1."""
    if precision == "ubinary":
        return (quantized(emb, "ubinary") + 1.0) / 2.0
    steps = (ranges[1] - ranges[0]) / 255
    steps = np.where(steps == 0, 1, steps)
    return (quantized(emb, "int8", ranges) + 128.0) * steps + ranges[0]


class QuantizedIndex:
    """mteb's ``IndexEncoderSearchProtocol`` over the corpus at one precision (module docstring):
    the int8 ranges come from the documents added, so the corpus calibrates the quantizer."""

    def __init__(self, precision: str, rescore_multiplier: int = 0, rescore_with: str = "quantized",
                 rescore_top_k: int | None = None):
        self.precision, self.rescore_multiplier, self.rescore_with = precision, rescore_multiplier, rescore_with
        self.rescore_top_k = rescore_top_k
        self.docs: list[np.ndarray] = []
        self.idxs: list[str] = []

    def add_documents(self, embeddings, idxs: list[str]) -> None:
        self.docs.append(np.asarray(embeddings, dtype=np.float32))
        self.idxs.extend(idxs)

    def clear(self) -> None:
        self.docs, self.idxs = [], []

    def _prepared(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(the corpus's first-stage vectors, its int8 ranges or None, its rescoring vectors or None)."""
        docs = np.concatenate(self.docs)
        if self.precision == "float32":
            return docs, None, None
        ranges = int8_ranges(docs) if self.precision == "int8" else None
        return quantized(docs, self.precision, ranges), ranges, self._rescoring(docs, ranges)

    def _rescoring(self, docs: np.ndarray, ranges: np.ndarray | None) -> np.ndarray | None:
        """The documents' vectors the candidates are rescored with (``rescore_with``), or None."""
        if not self.rescore_multiplier:
            return None
        if self.rescore_with == "float32":
            return docs
        if self.rescore_with == "int8":
            return rescoring_vectors(docs, "int8", int8_ranges(docs) if ranges is None else ranges)
        return rescoring_vectors(docs, self.precision, ranges)

    def search(self, embeddings, top_k: int, similarity_fn: Callable | None = None, top_ranked=None,
               query_idx_to_id: dict[int, str] | None = None) -> tuple[list[list[float]], list[list[int]]]:
        queries = np.asarray(embeddings, dtype=np.float32)
        docs, ranges, rescore = self._prepared()
        coded = quantized(queries, self.precision, ranges)
        position = {doc: i for i, doc in enumerate(self.idxs)}
        values, indices = [], []
        for start in range(0, len(queries), QUERY_CHUNK):  # memory: a chunk of queries × the corpus
            first = coded[start:start + QUERY_CHUNK] @ docs.T
            for qi in range(start, min(start + QUERY_CHUNK, len(queries))):
                pool = np.arange(len(docs)) if top_ranked is None else \
                    np.array([position[d] for d in top_ranked.get(query_idx_to_id[qi], [])], dtype=np.int64)
                order, score = self._ranked(first[qi - start], pool, top_k, rescore, queries[qi])
                if top_ranked is not None:  # reranking: positions in the query's candidate list
                    local = {int(p): i for i, p in enumerate(pool)}
                    order = np.array([local[int(p)] for p in order], dtype=np.int64)
                values.append([float(x) for x in score])
                indices.append([int(i) for i in order])
        return values, indices

    def _ranked(self, first: np.ndarray, pool: np.ndarray, top_k: int, rescore: np.ndarray | None,
                query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One query's best ``top_k`` documents of ``pool`` and their scores: by the first-stage score,
        or min(top_k, rescore_top_k) × multiplier candidates (top_k × multiplier without
        rescore_top_k, as sentence-transformers) rescored with the float32 query, then the
        first-stage order below them (module docstring)."""
        order = pool[np.argsort(-first[pool], kind="stable")]
        if rescore is None:
            return order[:top_k], first[order[:top_k]]
        hits = top_k if self.rescore_top_k is None else min(top_k, self.rescore_top_k)
        n = min(hits * self.rescore_multiplier, len(order))
        head, tail = order[:n], order[n:top_k]
        score = rescore[head] @ query
        keep = np.argsort(-score, kind="stable")
        below = (score.min() if n else 0.0) - 1.0 - np.arange(len(tail))
        return np.concatenate([head[keep], tail])[:top_k], np.concatenate([score[keep], below])[:top_k]


class IndexedSearch(SearchEncoderWrapper):
    """mteb's ``SearchEncoderWrapper`` with the corpus ids read once per search. With an index
    backend, mteb looks every hit's id up in the corpus dataset's lazy ``id`` column, one dataset
    row read per hit (300 queries × 600 hits on SciFact-600: 14 of a variant's 15 s); mteb's PR
    #3518 materialised the ids the same way in its default search path only."""

    def _sort_full_corpus_results(self, *, sub_corpus_ids, **kwargs):
        return super()._sort_full_corpus_results(sub_corpus_ids=list(sub_corpus_ids), **kwargs)


class SizedModel(AbsEncoder):
    """The evaluated model's embeddings at one size and precision, for mteb: cut, then quantized
    with fixed ``ranges`` (STS, classification, pair classification) or left float for a
    ``QuantizedIndex`` to quantize (retrieval)."""

    def __init__(self, base: Any, dim: int, precision: str, ranges: np.ndarray | None = None):
        self.base, self.dim, self.precision, self.ranges = base, dim, precision, ranges
        self.model_prompts = base.model_prompts
        self.mteb_model_meta = base.mteb_model_meta.model_copy(update={
            "embed_dim": dim, "revision": f"{base.fingerprint}-{dim}-{precision}"})

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None, **kwargs: Any):
        emb = cut(self.base.encode(inputs, task_metadata=task_metadata, hf_split=hf_split, hf_subset=hf_subset,
                                   prompt_type=prompt_type), self.dim)
        return quantized(emb, self.precision, self.ranges)


def sizes_of(dims: list[int] | None, trained: list[int], full: int, label: str) -> list[int]:
    """The sizes a model is scored at, descending, its full size first: ``dims`` as configured, or
    the model's trained Matryoshka dims when ``dims`` is None; a size above ``full`` is refused."""
    wanted = trained if dims is None else dims
    too_big = [d for d in wanted if d > full]
    if too_big:
        raise ConfigError(f"evaluate.dims: {too_big} above model {label}'s embedding size {full} "
                          f"(dims must be at most {full})")
    return sorted({full, *wanted}, reverse=True)


def variants(sizes: list[int], precisions: list[str], rescore: int | None, retrieval: bool) -> list[tuple[int, str, int]]:
    """(dim, precision, rescore multiplier or 0) of every scored variant, the full float32 first."""
    out = []
    for dim in sizes:
        for precision in precisions:
            out.append((dim, precision, 0))
            if retrieval and rescore and precision in QUANTIZED:
                out.append((dim, precision, rescore))
    full = (sizes[0], "float32", 0)
    return [full] + [v for v in out if v != full]


def score_variant(model: Any, task: Any, variant: tuple[int, str, int], recorded: np.ndarray | None,
                  rescore_with: str, rescore_top_k: int) -> float:
    """The task's main score (mteb's) with ``model``'s embeddings as ``variant`` says (a rescored
    retrieval variant: ``rescore_top_k`` hits rescored with ``rescore_with``'s document vectors)."""
    import mteb

    dim, precision, rescore = variant
    if task.metadata.type == "Retrieval":
        index = QuantizedIndex(precision, rescore, rescore_with, rescore_top_k)
        search = IndexedSearch(SizedModel(model, dim, "float32"), index_backend=index)
        result = mteb.evaluate(search, task, cache=None, overwrite_strategy="always", show_progress_bar=False)
    else:
        ranges = int8_ranges(cut(recorded, dim)) if precision == "int8" else None
        result = mteb.evaluate(SizedModel(model, dim, precision, ranges), task, cache=None,
                               overwrite_strategy="always", show_progress_bar=False)
    return float(result.task_results[0].get_score())

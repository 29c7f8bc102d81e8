"""The mining teacher (``mine.teacher``): a stronger model's score of a (query, text) pair, batched
and cached like embeddings.

* ``cross_encoder``: a sentence-transformers ``CrossEncoder`` directory scores the pair jointly; its
  raw logits (no sigmoid) are the score, as the teacher scores of sentence-transformers' MarginMSE
  examples and FlagEmbedding's reranker scores are. Pairs are cached by (model fingerprint, pair
  hash) in the embedding cache's shards (one float per pair), so a rerun scores no pair twice.
* ``embedder``: any embedding model directory ('default' included) scores a pair by the cosine of
  its texts' embeddings, encoded through the same embedding cache as the mining model (with the
  instructions the teacher was trained with, ``embed_core.model.settings.instructed``).

The miner (``embed_core.mine.miner``) drops the window's candidates the teacher scores at or above
the record's lowest positive and keeps the teacher's scores in ``positive_scores`` /
``negative_scores`` (NV-Retriever's teacher filter; FlagEmbedding's and Tevatron's rescoring).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from embed_core.config import RunConfig
from embed_core.mine.config import MineConfig, TeacherConfig
from embed_core.mine.miner import PairScorer
from embed_core.model.embedding_cache import LazyCachedEmbed, open_cache
from embed_core.model.encoder import model_fingerprint, model_source, resolve_model_path
from embed_core.model.settings import instructed, read_model_settings
from embed_core.schema import Record


def teacher_fingerprint(teacher: TeacherConfig, bf16: bool) -> str:
    """The teacher's identity for the mine stage's cache key: its weights and how it scores."""
    pooling = teacher.pooling if teacher.kind == "embedder" else teacher.kind
    return model_fingerprint(teacher.path, pooling, teacher.max_length, bf16 and teacher.kind == "embedder")


def teacher_scorer(config: RunConfig, run_dir: Path, cfg: MineConfig, records: list[Record],
                   embedder_cache) -> PairScorer:
    """(query, text) pairs -> the teacher's scores for one dataset's ``records``; ``embedder_cache``:
    ``(run config, run dir, mine settings) -> LazyCachedEmbed`` (the mine stage's, for an embedder)."""
    teacher = cfg.teacher
    if teacher.kind == "embedder":
        settings = cfg.model_copy(update={"model": teacher.path, "pooling": teacher.pooling,
                                          "max_length": teacher.max_length, "batch_size": teacher.batch_size})
        documents, queries = instructed(records, embedder_cache(config, run_dir, settings),
                                        read_model_settings(model_source(teacher.path)))
        return lambda pairs: cosine_scores(pairs, documents, queries)
    path = resolve_model_path(teacher.path)
    cached = LazyCachedEmbed(
        lambda: open_cache(path, run_dir, config.embedding_cache, teacher_fingerprint(teacher, False) + "-pairs", 1,
                           "float32"),
        lambda cache: cross_encoder_scores(path, teacher))
    return lambda pairs: cached([pair_key(q, t) for q, t in pairs])[:, 0].astype(np.float64)


def cosine_scores(pairs: list[tuple[str, str]], documents, queries) -> np.ndarray:
    """The cosine of each pair's (L2-normalised) embeddings, each distinct text encoded once."""
    qs = list(dict.fromkeys(q for q, _ in pairs))
    ts = list(dict.fromkeys(t for _, t in pairs))
    qv = dict(zip(qs, queries(qs)))
    tv = dict(zip(ts, documents(ts)))
    return np.array([float(np.dot(qv[q], tv[t])) for q, t in pairs], dtype=np.float64)


def pair_key(query: str, text: str) -> str:
    """The cache's key text of a pair (unambiguous: JSON of both)."""
    return json.dumps([query, text], ensure_ascii=False)


def cross_encoder_scores(path: str, teacher: TeacherConfig):
    """pair keys -> ``[n, 1]`` raw logits of the CrossEncoder at ``path`` (loaded once, here)."""
    import torch
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(path, max_length=teacher.max_length, device="cuda" if torch.cuda.is_available() else "cpu")

    def score(keys: list[str]) -> np.ndarray:
        pairs = [tuple(json.loads(k)) for k in keys]
        logits = model.predict(pairs, batch_size=teacher.batch_size, activation_fn=torch.nn.Identity(),
                               show_progress_bar=False, convert_to_numpy=True)
        return np.asarray(logits, dtype=np.float32).reshape(len(keys), 1)

    return score

"""Round-trip consistency (Promptagator; GPL's and InPars' filters work the same way): a query
generated for a passage is kept only when that passage ranks within ``top_k`` among every passage
of its corpus for an embedding model. Ranks are exact (inner products of L2-normalised
embeddings, blocks of queries at a time); a tie with another passage counts against the query."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Embed = Callable[[list[str]], np.ndarray]


def passage_ranks(query_vecs: np.ndarray, passage_vecs: np.ndarray, targets: Sequence[int],
                  block: int = 1024) -> np.ndarray:
    """1-based rank of passage ``targets[i]`` for query i: 1 + the passages scoring at least as
    high, other than the target itself."""
    targets = np.asarray(targets, dtype=np.int64)
    ranks = np.empty(len(targets), dtype=np.int64)
    for lo in range(0, len(targets), block):
        scores = query_vecs[lo:lo + block] @ passage_vecs.T
        rows = np.arange(scores.shape[0])
        own = scores[rows, targets[lo:lo + block]]
        ranks[lo:lo + block] = (scores >= own[:, None]).sum(axis=1)  # the target itself counts once
    return ranks


def round_trip(queries: list[str], passage_of_query: list[int], passages: list[str], embed: Embed,
               top_k: int) -> tuple[list[bool], np.ndarray]:
    """(kept per query, its passage's rank) for queries against one corpus's ``passages``."""
    if not queries:
        return [], np.zeros(0, dtype=np.int64)
    ranks = passage_ranks(np.asarray(embed(queries)), np.asarray(embed(passages)), passage_of_query)
    return [bool(r <= top_k) for r in ranks], ranks

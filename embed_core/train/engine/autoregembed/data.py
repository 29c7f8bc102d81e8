"""Training examples for AutoRegEmbed's two stages, built from unified records.

* Information compression: the paper trains on PWC (context, instruction, output), which is not
  available here. We train the same objective as an auto-encoder (ICAE's pretraining task, which
  PWC fine-tunes): every distinct text of the stage's datasets is compressed with its task's
  I_self instruction and reconstructed by the frozen decoder. This is a departure from the paper,
  recorded in the README.
* Conditional distribution alignment: triplets (q, d⁺, d⁻₁…d⁻_K) with the method's instructions
  (retrieval: I_next on the query, I_self on the passage; symmetric tasks: the STS instruction on
  both). Retrieval records give (query, first positive, first K negatives — mined ones when the
  run has a mine stage); scored pairs (STS, NLI) give (text1, text2) when the score reaches
  ``positive_level`` of the dataset's highest score, with the record's negatives. Missing negatives
  are texts of other examples drawn from a seeded generator, fixed per example, so the reference
  scores precomputed for an example stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embed_core.train.config import AutoRegEmbedConfig
from embed_core.errors import ConfigError
from embed_core.schema import INFONCE_TASKS, PAIR_TASKS
from embed_core.train.engine.batches import DatasetRecords


@dataclass(frozen=True)
class ICExample:
    context: str
    instruction: str
    target: str


@dataclass(frozen=True)
class CDAExample:
    query: str
    query_instruction: str
    positive: str
    positive_instruction: str
    negatives: tuple[str, ...]


def _instructions(cfg: AutoRegEmbedConfig, task: str) -> tuple[str, str]:
    """(I_next for the query side, I_self for the document side) of a task."""
    if task in INFONCE_TASKS:
        return cfg.query_instruction, cfg.passage_instruction
    return cfg.sts_instruction, cfg.sts_instruction


def ic_examples(datasets: dict[str, DatasetRecords], cfg: AutoRegEmbedConfig) -> list[ICExample]:
    seen: set[str] = set()
    out: list[ICExample] = []
    for name in sorted(datasets):
        d = datasets[name]
        i_next, i_self = _instructions(cfg, d.task)
        for query, positives in zip(d.cols["query"], d.cols["positives"]):
            for text, instruction in ((query, i_next), *((p, i_self) for p in positives)):
                if text not in seen:
                    seen.add(text)
                    out.append(ICExample(text, instruction, text))
    if not out:
        raise ConfigError("autoregembed_ic: the stage's datasets hold no texts")
    return out


def cda_examples(datasets: dict[str, DatasetRecords], cfg: AutoRegEmbedConfig, *, positive_level: float = 0.8,
                 seed: int = 42) -> list[CDAExample]:
    drafts: list[tuple[str, str, str, str, list[str]]] = []
    for name in sorted(datasets):
        d = datasets[name]
        if d.task not in INFONCE_TASKS and d.task not in PAIR_TASKS:
            continue  # classification has no (query, document) pairs to align
        i_next, i_self = _instructions(cfg, d.task)
        c = d.cols
        for row in range(d.size):
            if not c["positives"][row]:
                continue
            if d.task in PAIR_TASKS:
                scores = c["positive_scores"][row]
                if not scores or scores[0] < positive_level * d.max_score:
                    continue
            drafts.append((c["query"][row], i_next, c["positives"][row][0], i_self,
                           list(c["negatives"][row][: cfg.num_negatives])))
    if not drafts:
        raise ConfigError("autoregembed_cda: no (query, positive) pairs in the stage's datasets "
                          "(retrieval records, or scored pairs at the positive level)")
    rng = np.random.default_rng(seed)
    pool = [d[2] for d in drafts]
    out = []
    for query, i_next, positive, i_self, negatives in drafts:
        while len(negatives) < cfg.num_negatives:
            pick = pool[int(rng.integers(len(pool)))]
            if pick not in (positive, query) and (len(pool) > 2 or pick not in negatives):
                negatives.append(pick)
        out.append(CDAExample(query, i_next, positive, i_self, tuple(negatives)))
    return out

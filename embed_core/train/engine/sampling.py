"""Dataset-grouped batch sampler with size^α weights and a global retrieval ratio η.

Every batch comes from one dataset (QZhou §5.1: mixing datasets in a batch gives easy in-batch
negatives). Dataset i with l_i records is drawn with probability (Eq. 4)

    p_i = l_i^α / Σ_j l_j^α

(each l_i^α times the dataset's ``dataset_weight``, 1 unless the stage sets one) and, when ``eta``
is set (stage 2), retrieval datasets share η and the others 1 − η (§5.2):

    p_i = η · l_i^α / S_ret            if d_i ∈ RET,   S_ret     = Σ_{j ∈ RET} l_j^α
    p_i = (1 − η) · l_i^α / S_non_ret  otherwise,      S_non_ret = Σ_{j ∉ RET} l_j^α

Within a dataset, records are taken in a seeded permutation (a new one each pass), with a
per-task batch size. The whole state — the RNG that picks datasets, each dataset's pass number
and position — is a small JSON-able dict, so a resumed run draws exactly the batches the
uninterrupted run would have (FlagEmbedding loses this state on resume).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

import numpy as np


def dataset_weights(sizes: dict[str, int], alpha: float, retrieval: set[str] | None = None,
                    eta: float | None = None, multipliers: dict[str, float] | None = None) -> dict[str, float]:
    """Sampling probability per dataset (Eq. 4, or the η equations of §5.2 when ``eta`` is given);
    ``multipliers`` scale a dataset's l^α before normalising (a user's emphasis on a dataset)."""
    if not sizes:
        raise ValueError("no datasets to sample from")
    multipliers = multipliers or {}
    powered = {name: float(n) ** alpha * multipliers.get(name, 1.0) for name, n in sizes.items() if n > 0}
    powered = {name: w for name, w in powered.items() if w > 0}
    if eta is None:
        total = sum(powered.values())
        return {name: w / total for name, w in powered.items()}
    if not 0 <= eta <= 1:
        raise ValueError(f"eta must be in [0, 1], got {eta}")
    ret = retrieval or set()
    s_ret = sum(w for n, w in powered.items() if n in ret)
    s_non = sum(w for n, w in powered.items() if n not in ret)
    if s_ret == 0 or s_non == 0:  # one side empty: η cannot be honoured, fall back to Eq. 4
        total = s_ret + s_non
        return {name: w / total for name, w in powered.items()}
    return {name: (eta * w / s_ret if name in ret else (1 - eta) * w / s_non) for name, w in powered.items()}


def origin_factors(origins: dict[str, dict[str, int]], origin_weight: dict[str, float]) -> dict[str, float]:
    """Dataset -> the mean origin weight of its records (Σ count × weight / Σ count; an origin
    without a weight counts 1): a sampling multiplier, so a dataset of synthetic records under
    ``origin_weight: {synthetic: 0.5}`` is drawn as if it were half its size^α."""
    out = {}
    for name, counts in origins.items():
        total = sum(counts.values())
        out[name] = sum(n * origin_weight.get(o, 1.0) for o, n in counts.items()) / total if total else 1.0
    return out


@dataclass
class Batch:
    dataset: str
    indices: list[int]


class GroupedBatchSampler:
    def __init__(self, sizes: dict[str, int], batch_size_of: dict[str, int], *, alpha: float = 0.5,
                 retrieval: set[str] | None = None, eta: float | None = None, seed: int = 42,
                 alternate: bool = False, multipliers: dict[str, float] | None = None):
        """``batch_size_of``: dataset -> batch size (the trainer maps each dataset's task to its size).

        ``alternate`` (CoDiEmb §2.3: "we alternate between L_IR and L_STS"): even draws take a
        retrieval dataset, odd draws another one, each chosen by its weight within its side;
        with only one side present it has no effect."""
        self.sizes = {k: v for k, v in sorted(sizes.items()) if v > 0}
        self.batch_size_of = batch_size_of
        self.weights = dataset_weights(self.sizes, alpha, retrieval, eta, multipliers)
        self.names = list(self.weights)
        self.probs = np.array([self.weights[n] for n in self.names])
        self.seed = seed
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.epoch = {n: 0 for n in self.names}
        self.position = {n: 0 for n in self.names}
        self._perm_cache: dict[str, tuple[int, np.ndarray]] = {}
        self.draws = 0
        ret = retrieval or set()
        sides = [[n for n in self.names if n in ret], [n for n in self.names if n not in ret]]
        self.sides = sides if alternate and all(sides) else None

    def _permutation(self, name: str) -> np.ndarray:
        epoch = self.epoch[name]
        cached = self._perm_cache.get(name)
        if cached is None or cached[0] != epoch:
            digest = hashlib.sha256(f"{self.seed}|{name}|{epoch}".encode()).digest()
            perm = np.random.Generator(np.random.PCG64(int.from_bytes(digest[:8], "little"))).permutation(self.sizes[name])
            self._perm_cache[name] = (epoch, perm)
        return self._perm_cache[name][1]

    def next_batch(self) -> Batch:
        if self.sides is not None:
            side = self.sides[self.draws % 2]
            p = np.array([self.weights[n] for n in side])
            name = side[int(self.rng.choice(len(side), p=p / p.sum()))]
        else:
            name = self.names[int(self.rng.choice(len(self.names), p=self.probs))]
        self.draws += 1
        size = min(self.batch_size_of[name], self.sizes[name])
        if self.position[name] + size > self.sizes[name]:  # drop the short tail, start a new pass
            self.epoch[name] += 1
            self.position[name] = 0
        perm = self._permutation(name)
        start = self.position[name]
        self.position[name] += size
        return Batch(name, perm[start:start + size].tolist())

    def restarted(self) -> "GroupedBatchSampler":
        """A copy of this sampler as it was before its first draw (the same datasets, weights and
        seed): replaying it draws again exactly what this one drew (``embed_core.train.engine.lineage``)."""
        fresh = copy.copy(self)
        fresh.rng = np.random.Generator(np.random.PCG64(self.seed))
        fresh.epoch = {n: 0 for n in self.names}
        fresh.position = {n: 0 for n in self.names}
        fresh._perm_cache = {}
        fresh.draws = 0
        return fresh

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "epoch": dict(self.epoch), "position": dict(self.position),
                "seed": self.seed, "sizes": dict(self.sizes), "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        if state["sizes"] != self.sizes or state["seed"] != self.seed:
            raise ValueError("sampler state belongs to other data (dataset sizes or seed differ)")
        self.rng.bit_generator.state = state["rng"]
        self.epoch = dict(state["epoch"])
        self.position = dict(state["position"])
        self.draws = int(state.get("draws", 0))

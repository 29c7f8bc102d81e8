"""Near-duplicate contamination exclusion (``prepare.near_duplicates``): drops a training record
one of whose texts is nearly, not exactly, an evaluation text or a dev text: a test query with a
word changed, a passage re-wrapped with a hyphen at a line break, a sentence with a typo fixed.

Shingles are character n-grams (default 5) of the normalised text (``normalize_text``: NFKC,
case-folded, punctuation and whitespace runs as one space). Characters rather than words: a query
of six words has four word 3-grams and one changed word removes three of them (Jaccard 1/7), while
its character 5-grams mostly survive; character n-grams also need no tokeniser for languages
written without spaces. ``datasketch``'s MinHash LSH (fixed seed, so every run proposes the same
candidates) only *proposes* candidates, with a band threshold below the configured one so that
pairs at the threshold are not missed; the decision is the exact Jaccard similarity of the two
shingle sets, at or above ``threshold``.

What a text is compared with mirrors the exact check (``cleaning.contaminated_field``): single
texts of ``match: text`` evaluation sets and a dataset's dev queries; text *pairs* of ``match:
pair`` sets and of dev records (query with a positive), where both texts of a training pair must be
near duplicates of the two texts of one evaluation pair (in either order).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from embed_core.prepare.cleaning import normalize_text
from embed_core.schema import Record

MINHASH_SEED = 1  # datasketch's default, fixed here: the candidates never change between runs
LSH_MARGIN = 0.8  # LSH bands are tuned for threshold * 0.8: candidates near the threshold are kept


def _datasketch() -> Any:
    """datasketch, imported on first use (only a run with near_duplicates on needs it)."""
    import datasketch

    return datasketch


def shingles(text: str, n: int) -> frozenset[str]:
    """The character ``n``-grams of the normalised text; a text shorter than ``n`` is one shingle,
    an empty one none."""
    norm = normalize_text(text)
    if len(norm) <= n:
        return frozenset([norm]) if norm else frozenset()
    return frozenset(norm[i:i + n] for i in range(len(norm) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """|a ∩ b| / |a ∪ b| (0 for two empty sets)."""
    union = len(a | b)
    return len(a & b) / union if union else 0.0


@dataclass(frozen=True)
class NearHit:
    """Why a training record is a near duplicate: its field and text, the nearest evaluation (or
    dev) text, the set that text belongs to and their Jaccard similarity (for a pair, the lower of
    its two sides)."""

    field: str
    text: str
    nearest: str
    source: str
    jaccard: float


@dataclass(frozen=True)
class _Entry:
    text: str
    shingles: frozenset[str]
    source: str
    pair: int | None  # pair id for a text of a pair, None for a single text
    side: int


class NearDuplicateIndex:
    """Evaluation texts and pairs to compare training records with (``match``)."""

    def __init__(self, threshold: float, shingle: int, num_perm: int):
        self.threshold = threshold
        self.shingle = shingle
        self.num_perm = num_perm
        self._entries: list[_Entry] = []
        self._pairs = 0
        # One set of permutations for every MinHash: drawing them per text cost 5x the hashing.
        self._template = _datasketch().MinHash(num_perm=num_perm, seed=MINHASH_SEED)
        self._lsh = _datasketch().MinHashLSH(threshold=max(0.05, threshold * LSH_MARGIN), num_perm=num_perm)
        # Training texts repeat (a BEIR document for many queries, classification positives): the
        # hits of a text are computed once while they stay in this bounded cache.
        self._hits = lru_cache(maxsize=1 << 14)(self._hits_of)

    @classmethod
    def from_config(cls, cfg: Any) -> "NearDuplicateIndex":
        return cls(cfg.threshold, cfg.shingle, cfg.num_perm)

    def __len__(self) -> int:
        return len(self._entries)

    def _minhash(self, sh: frozenset[str]) -> Any:
        mh = _datasketch().MinHash(num_perm=self.num_perm, seed=MINHASH_SEED, scheme=self._template.scheme,
                                   permutations=self._template.permutations)
        mh.update_batch([s.encode("utf-8", "surrogatepass") for s in sorted(sh)])
        return mh

    def _add(self, text: str, source: str, pair: int | None, side: int) -> None:
        sh = shingles(text, self.shingle)
        if not sh:
            return
        self._lsh.insert(len(self._entries), self._minhash(sh))
        self._entries.append(_Entry(text, sh, source, pair, side))
        self._hits.cache_clear()

    def add_text(self, text: str, source: str) -> None:
        self._add(text, source, None, 0)

    def add_pair(self, a: str, b: str, source: str) -> None:
        self._add(a, source, self._pairs, 0)
        self._add(b, source, self._pairs, 1)
        self._pairs += 1

    def _hits_of(self, text: str) -> tuple[tuple[int, float], ...]:
        """(entry, Jaccard) of every entry at or above the threshold, nearest first."""
        sh = shingles(text, self.shingle)
        if not sh or not self._entries:
            return ()
        found = [(i, jaccard(sh, self._entries[i].shingles)) for i in self._lsh.query(self._minhash(sh))]
        return tuple(sorted(((i, j) for i, j in found if j >= self.threshold), key=lambda h: (-h[1], h[0])))

    def _text_hit(self, field: str, text: str) -> NearHit | None:
        for i, j in self._hits(text):
            entry = self._entries[i]
            if entry.pair is None:
                return NearHit(field, text, entry.text, entry.source, j)
        return None

    def _pair_hit(self, field: str, query: str, text: str) -> NearHit | None:
        """A hit when ``query`` is near one side of an evaluation pair and ``text`` near the other."""
        query_sides = {(self._entries[i].pair, self._entries[i].side): j for i, j in self._hits(query)}
        best: NearHit | None = None
        for i, j in self._hits(text):
            entry = self._entries[i]
            other = query_sides.get((entry.pair, 1 - entry.side)) if entry.pair is not None else None
            if other is not None and (best is None or min(j, other) > best.jaccard):
                best = NearHit(field, text, entry.text, entry.source, min(j, other))
        return best

    def match(self, record: Record) -> NearHit | None:
        """The first field of ``record`` that is a near duplicate (query, then positives, negatives,
        weak positives; single texts before pairs), or None."""
        if not self._entries:
            return None
        fields = [("query", record.query)] + [
            (f"{name}[{i}]", text) for name in ("positives", "negatives", "weak_positives")
            for i, text in enumerate(getattr(record, name))]
        for field, text in fields:
            hit = self._text_hit(field, text)
            if hit is not None:
                return hit
        if self._pairs:
            for field, text in fields[1:]:
                hit = self._pair_hit(field, record.query, text)
                if hit is not None:
                    return hit
        return None

"""Cleaning: text normalisation, over-long handling, dedupe and contamination exclusion.

Contamination exclusion follows QZhou §6.1 ("training split ... with contamination exclusion
applied to remove samples highly similar to test sets"): a training record is dropped when any
of its texts equals, after normalisation, an evaluation query, an STS/pair test sentence or a
classification test text. A BEIR corpus shared by train and test queries (SciFact) is not
contamination: only the judged test *queries* of a BEIR set are compared.

For sets built from a shared sentence pool (SICK reuses its sentences across splits: text-level
matching drops 98 % of SICK train), an evaluation source can set ``match: pair`` so that only a
training record holding an evaluation *pair* (in either order) is excluded.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import lru_cache

from embed_core.errors import RowError
from embed_core.schema import Record

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)


@lru_cache(maxsize=1 << 18)  # dedupe and contamination normalise the same texts repeatedly
def normalize_text(text: str) -> str:
    """NFKC, case-folded, punctuation and whitespace runs collapsed to one space."""
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def _split_ref(ref: str) -> tuple[str, int | None]:
    file, _, row = ref.rpartition(":")
    return (file, int(row)) if row.isdigit() else (ref, None)


def limit_length(record: Record, max_chars: int, policy: str) -> tuple[Record, int]:
    """Truncate (or reject) texts longer than ``max_chars``; returns the record and how many texts were cut."""
    cut = 0

    def fix(text: str, field: str) -> str:
        nonlocal cut
        if len(text) <= max_chars:
            return text
        if policy == "quarantine":
            file, row = _split_ref(record.source_ref)
            raise RowError(file, row, field, "over_long", f"text has {len(text)} characters (max_chars={max_chars})")
        cut += 1
        return text[:max_chars].rstrip()

    new = replace(
        record,
        query=fix(record.query, "query"),
        positives=[fix(t, f"positives[{i}]") for i, t in enumerate(record.positives)],
        negatives=[fix(t, f"negatives[{i}]") for i, t in enumerate(record.negatives)],
        weak_positives=[fix(t, f"weak_positives[{i}]") for i, t in enumerate(record.weak_positives)],
    )
    return new, cut


def _key(record: Record, norm) -> tuple:
    return (record.task, norm(record.query), tuple(map(norm, record.positives)), tuple(record.positive_scores),
            tuple(map(norm, record.negatives)), tuple(map(norm, record.weak_positives)), record.label)


def dedupe(records: Iterable[Record], mode: str) -> tuple[list[Record], int, int]:
    """Keep the first of each duplicate. Returns (kept, exact duplicates, normalised-only duplicates)."""
    if mode == "none":
        return list(records), 0, 0
    exact_seen: set[tuple] = set()
    norm_seen: set[tuple] = set()
    kept: list[Record] = []
    n_exact = n_norm = 0
    for rec in records:
        k = _key(rec, lambda t: t)
        if k in exact_seen:
            n_exact += 1
            continue
        exact_seen.add(k)
        if mode == "normalized":
            nk = _key(rec, normalize_text)
            if nk in norm_seen:
                n_norm += 1
                continue
            norm_seen.add(nk)
        kept.append(rec)
    return kept, n_exact, n_norm


@dataclass
class EvalTexts:
    """What contamination exclusion compares against: single texts and (unordered) text pairs."""

    texts: set[str] = field(default_factory=set)
    pairs: set[tuple[str, str]] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.texts or self.pairs)


def pair_key(a: str, b: str) -> tuple[str, str]:
    na, nb = normalize_text(a), normalize_text(b)
    return (na, nb) if na <= nb else (nb, na)


def contaminated_field(record: Record, evals: EvalTexts) -> str | None:
    """Name of the first field whose text (or query–text pair) matches the evaluation sets, or None."""
    if not evals:
        return None
    if evals.texts:
        if normalize_text(record.query) in evals.texts:
            return "query"
        for name in ("positives", "negatives", "weak_positives"):
            for i, text in enumerate(getattr(record, name)):
                if normalize_text(text) in evals.texts:
                    return f"{name}[{i}]"
    if evals.pairs:
        for name in ("positives", "negatives", "weak_positives"):
            for i, text in enumerate(getattr(record, name)):
                if pair_key(record.query, text) in evals.pairs:
                    return f"{name}[{i}]"
    return None

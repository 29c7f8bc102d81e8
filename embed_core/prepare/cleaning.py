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

import hashlib
import re
import sqlite3
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from embed_core.errors import RowError
from embed_core.schema import Record

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)


# Dedupe and contamination normalise a record's texts several times in a row; a small cache catches
# that without growing with the source (prepare's memory must not).
@lru_cache(maxsize=1 << 14)
def normalize_text(text: str) -> str:
    """NFKC, case-folded, punctuation and whitespace runs collapsed to one space."""
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


# Text hygiene: what every reader does to every text it reads (``clean_text``), one place for the rule.
# Line and paragraph breaks of every convention become "\n"; invisible format characters are removed;
# other control characters become U+FFFD; what only a binary or mis-decoded file holds makes the row
# unusable.
_LINE_BREAKS = re.compile("\r\n|[\r\x0b\x0c\x85\u2028\u2029]")
# Invisible format characters a model gains nothing from: soft hyphen, Arabic letter mark, Mongolian
# vowel separator, zero-width space, LRM/RLM, bidi embeddings/overrides (U+202A-U+202E) and isolates
# (U+2066-U+2069), word joiner and invisible operators, deprecated format controls, BOM/ZWNBSP,
# interlinear annotation marks. ZWJ/ZWNJ (U+200C/U+200D) stay: they shape Indic and Persian
# words and join emoji.
_INVISIBLE = re.compile("[\u00ad\u061c\u180e\u200b\u200e\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f"
                        "\ufeff\ufff9-\ufffb]")
# Other C0 controls, DEL and C1 controls are what is left of a lost character in real data (STS-B and
# MRPC hold "Treasury\x12s" for "Treasury's", Amazon reviews \x1a SUB for an umlaut, BQ \x08): each
# becomes U+FFFD, the replacement character, so the word boundary stays and nothing reaches a
# terminal as an escape sequence.
_CONTROLS = re.compile("[\x01-\x08\x0e-\x1f\x7f-\x84\x86-\x9f]")
# Never in a text: NUL (a binary file, or UTF-16 without a byte-order mark), lone surrogates (an
# undecodable byte, or a broken "\ud800" JSON escape), noncharacters U+FFFE/U+FFFF (U+FFFE is a
# byte-swapped BOM). The row is quarantined.
_UNUSABLE = re.compile("[\x00\ud800-\udfff\ufffe\uffff]")
_SUSPECT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b\u200e\u200f\u2028-\u202e"
                      "\u2060-\u206f\ud800-\udfff\ufeff\ufff9-\ufffb\ufffe\uffff]")
ALLOWED_CONTROLS = frozenset("\t\n")  # the only control characters a cleaned text holds


class UnusableText(ValueError):
    """A text holds a character no normalisation can make good (see ``clean_text``); ``reason`` is
    the quarantine reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def is_clean(text: str) -> bool:
    """True when ``clean_text`` would return ``text`` unchanged (the common case, one regex scan)."""
    return _SUSPECT.search(text) is None


def clean_text(text: str) -> str:
    """``text`` with every line break as ``\n``, invisible format characters removed and other
    control characters as U+FFFD; raises ``UnusableText`` for NUL, a lone surrogate or a noncharacter
    (the table in docs/stages.md, "Text hygiene"). Texts with none of these come back unchanged (one
    regex scan)."""
    if _SUSPECT.search(text) is None:
        return text
    bad = _UNUSABLE.search(text)
    if bad is not None:
        ch = bad.group()
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            raise UnusableText("encoding", f"non-UTF-8 byte 0x{code - 0xDC00:02x} at character {bad.start() + 1}")
        what = ("a lone surrogate" if 0xD800 <= code <= 0xDFFF else "a noncharacter" if code >= 0xFFFE
                else "a NUL byte (a binary file, or UTF-16 without a byte-order mark?)")
        raise UnusableText("control_character", f"holds {what} (U+{code:04X}) at character {bad.start() + 1}; "
                           "remove it from the source")
    return _CONTROLS.sub("\ufffd", _INVISIBLE.sub("", _LINE_BREAKS.sub("\n", text)))


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


def _digest(parts: Iterable[str]) -> bytes:
    """16 bytes naming a sequence of strings (length-prefixed, so no two sequences share a message)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def _key_parts(record: Record, norm) -> list[str]:
    return [record.task, norm(record.query), *map(norm, record.positives), "|scores", *map(repr, record.positive_scores),
            "|negatives", *map(norm, record.negatives), "|weak", *map(norm, record.weak_positives), "|label",
            repr(record.label)]


class KeyStore:
    """Sets of keys on disk (SQLite, 16-byte digests), for dedupe and lookups over more records
    than fit in memory: the page cache is bounded, so memory stays flat however large the
    source. One store holds any number of named sets (``KeySet``)."""

    def __init__(self, path: Path | str, cache_mb: int = 32):
        self._db = sqlite3.connect(str(path), isolation_level=None)
        # A scratch index: losing it with a crash loses nothing (the stage reruns from its sources).
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute(f"PRAGMA cache_size=-{cache_mb * 1024}")
        self._db.execute("CREATE TABLE IF NOT EXISTS k (key BLOB PRIMARY KEY) WITHOUT ROWID")
        self._db.execute("BEGIN")

    def add(self, key: bytes) -> bool:
        """Insert ``key``; True when it was not there yet."""
        return self._db.execute("INSERT OR IGNORE INTO k VALUES (?)", (key,)).rowcount == 1

    def __contains__(self, key: bytes) -> bool:
        return self._db.execute("SELECT 1 FROM k WHERE key = ?", (key,)).fetchone() is not None

    def close(self) -> None:
        self._db.close()

    def set(self, name: str) -> "KeySet":
        return KeySet(self, name)


class KeySet:
    """A named set of strings or string tuples inside a ``KeyStore`` (what ``EvalTexts`` holds in
    memory, on disk): ``add``, ``in``, ``len``."""

    def __init__(self, store: KeyStore, name: str):
        self._store = store
        self._name = name
        self._len = 0

    def _key(self, item: str | tuple[str, ...]) -> bytes:
        return _digest([self._name, *((item,) if isinstance(item, str) else item)])

    def add(self, item: str | tuple[str, ...]) -> bool:
        new = self._store.add(self._key(item))
        self._len += new
        return new

    def __contains__(self, item: object) -> bool:
        return bool(self._len) and isinstance(item, (str, tuple)) and self._key(item) in self._store

    def __len__(self) -> int:
        return self._len


class Deduper:
    """``dedupe`` one record at a time over a ``KeyStore``: keeps the first of each duplicate,
    exact first, then after normalisation (``mode``: none | exact | normalized)."""

    def __init__(self, store: KeyStore, name: str, mode: str):
        self.mode = mode
        self._exact = store.set(f"{name}:exact")
        self._normalized = store.set(f"{name}:normalized")

    def verdict(self, record: Record) -> str | None:
        """None for a record to keep, else ``exact`` or ``normalized`` (the duplicate it is)."""
        if self.mode == "none":
            return None
        if not self._exact.add(tuple(_key_parts(record, str))):
            return "exact"
        if self.mode == "normalized" and not self._normalized.add(tuple(_key_parts(record, normalize_text))):
            return "normalized"
        return None


def dedupe(records: Iterable[Record], mode: str) -> tuple[list[Record], int, int]:
    """Keep the first of each duplicate. Returns (kept, exact duplicates, normalised-only duplicates)."""
    store = KeyStore(":memory:")
    deduper = Deduper(store, "dedupe", mode)
    kept: list[Record] = []
    n_exact = n_norm = 0
    for rec in records:
        verdict = deduper.verdict(rec)
        n_exact += verdict == "exact"
        n_norm += verdict == "normalized"
        if verdict is None:
            kept.append(rec)
    store.close()
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

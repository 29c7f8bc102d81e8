"""Shared pieces of the converters: column mapping and typed field access with located errors."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from embed_core.config import SourceSpec
from embed_core.errors import RowError
from embed_core.prepare.readers import RawRow, column_label
from embed_core.schema import Record, is_blank


@dataclass
class Skipped:
    """A row deliberately left out (e.g. a label mapped to 'ignore'): counted, not quarantined."""

    file: str
    row: int
    reason: str


Item = Record | RowError | Skipped
ConvertStream = Iterator[Item]

BINARY_LABELS = {"yes": 1.0, "true": 1.0, "no": 0.0, "false": 0.0}


class Columns:
    """Maps a kind's logical fields to the source's columns (names, or indexes without header)."""

    def __init__(self, spec: SourceSpec, names: dict[str, str], positions: dict[str, int],
                 optional: tuple[str, ...] = ()):
        unknown = set(spec.columns) - set(names)
        if unknown:
            from embed_core.errors import ConfigError

            raise ConfigError(f"source '{spec.name}': unknown column key(s) {sorted(unknown)} for kind "
                              f"'{spec.kind}' (expected {sorted(names)})")
        defaults: dict[str, str | int] = dict(names) if spec.header or spec.format in ("jsonl", "parquet") else dict(positions)
        self.map: dict[str, str | int] = {**defaults, **spec.columns}
        self.optional = optional

    def __getitem__(self, logical: str) -> str | int:
        return self.map[logical]

    def required(self) -> list[str | int]:
        return [c for k, c in self.map.items() if k not in self.optional]


def record_id(spec: SourceSpec, raw: RawRow, suffix: str = "") -> str:
    return f"{spec.name}:{PurePath(raw.file).name}:{raw.row}{suffix}"


def _raw_value(raw: RawRow, col: str | int) -> Any:
    if col not in raw.values:
        raise RowError(raw.file, raw.row, column_label(col), "missing_field", "missing field")
    return raw.values[col]


def get_text(raw: RawRow, col: str | int) -> str:
    value = _raw_value(raw, col)
    if not isinstance(value, str):
        raise RowError(raw.file, raw.row, column_label(col), "wrong_type", f"expected text, got {type(value).__name__}")
    value = value.strip()
    if is_blank(value):
        raise RowError(raw.file, raw.row, column_label(col), "empty_text",
                       "empty text" if not value else "text has only invisible or control characters")
    return value


def get_text_list(raw: RawRow, col: str | int, *, allow_missing: bool = False) -> list[str]:
    if allow_missing and col not in raw.values:
        return []
    value = _raw_value(raw, col)
    if value is None and allow_missing:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise RowError(raw.file, raw.row, column_label(col), "wrong_type", f"expected a list of texts, got {type(value).__name__}")
    out = []
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise RowError(raw.file, raw.row, f"{column_label(col)}[{i}]", "wrong_type", f"expected text, got {type(v).__name__}")
        if is_blank(v):
            raise RowError(raw.file, raw.row, f"{column_label(col)}[{i}]", "empty_text",
                           "empty text" if not v.strip() else "text has only invisible or control characters")
        out.append(v.strip())
    return out


def parse_score(value: Any, *, file: str, row: int, field: str,
                score_range: tuple[float, float] | None = None) -> float:
    """A numeric score, or a binary yes/no/true/false label as 1/0 (QZhou §3.2.2); outside
    ``score_range`` (inclusive) is a row error."""
    score = _parse_score(value, file=file, row=row, field=field)
    if score_range is not None and not score_range[0] <= score <= score_range[1]:
        raise RowError(file, row, field, "score_range",
                       f"score {score:g} is outside score_range [{score_range[0]:g}, {score_range[1]:g}]")
    return score


def _parse_score(value: Any, *, file: str, row: int, field: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        score = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.lower() in BINARY_LABELS:
            return BINARY_LABELS[text.lower()]
        try:
            score = float(text)
        except ValueError:
            raise RowError(file, row, field, "bad_score", f"not a number: {value!r}") from None
    else:
        raise RowError(file, row, field, "bad_score", f"not a number: {value!r}")
    if not math.isfinite(score):
        raise RowError(file, row, field, "nan_score", f"score is {score}")
    return score


def get_score(raw: RawRow, col: str | int, score_range: tuple[float, float] | None = None) -> float:
    return parse_score(_raw_value(raw, col), file=raw.file, row=raw.row, field=column_label(col),
                       score_range=score_range)


def get_score_list(raw: RawRow, col: str | int, n: int,
                   score_range: tuple[float, float] | None = None) -> list[float]:
    if col not in raw.values or raw.values[col] is None:
        return []
    value = raw.values[col]
    if not isinstance(value, list):
        raise RowError(raw.file, raw.row, column_label(col), "wrong_type", f"expected a list of numbers, got {type(value).__name__}")
    if len(value) != n:
        raise RowError(raw.file, raw.row, column_label(col), "length_mismatch", f"{len(value)} scores for {n} texts")
    return [parse_score(v, file=raw.file, row=raw.row, field=f"{column_label(col)}[{i}]", score_range=score_range)
            for i, v in enumerate(value)]


def map_label(raw: RawRow, col: str | int, mapping: dict[str, Any]) -> Any:
    """Look a raw label up case-insensitively; an unknown label is a row error naming the known ones."""
    value = _raw_value(raw, col)
    key = str(value).strip().lower() if value is not None else ""
    lowered = {str(k).strip().lower(): v for k, v in mapping.items()}
    if key not in lowered:
        known = ", ".join(sorted(repr(k) for k in lowered))
        raise RowError(raw.file, raw.row, column_label(col), "unknown_label", f"unknown label {value!r} (expected one of {known})")
    return lowered[key]

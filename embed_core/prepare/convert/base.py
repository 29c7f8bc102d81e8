"""The converter interface and the pieces converters share: column mapping and typed field
access with located errors.

A converter is one class in its own file under ``embed_core/prepare/convert/`` (found by the
package's discovery, like the losses). It declares

* ``kind`` — what a source writes (``kind: sts``), and ``task`` — the task its records get
  unless the source sets ``task``;
* ``columns`` — logical field -> default column name, in the order of the default positions
  when the file has no header (``header: false``); ``optional`` — fields a row may lack;
* ``text_fields`` — the fields whose texts a contamination check compares; ``pair`` — whether
  a row is a (text1, text2) pair, so ``match: pair`` works;
* ``Params`` — the settings only this kind has, a strict pydantic model with a description on
  every field (a source writes them under ``params:``; they are validated when the config loads);

and ``convert_row`` (one row → records) or ``convert`` (all rows → records, for kinds that
merge rows). Converters never import the config modules: a source reaches them as a
``SourceLike``, the run as a ``RunLike``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Annotated, Any, ClassVar, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from embed_core.config_base import ReadLimits
from embed_core.errors import RowError
from embed_core.prepare.readers import RawRow, column_label, excerpt, read_rows, root_for
from embed_core.schema import Record, is_blank


@dataclass
class Skipped:
    """A row deliberately left out (e.g. a label mapped to 'ignore'): counted, not quarantined."""

    file: str
    row: int
    reason: str


Item = Record | RowError | Skipped
ConvertStream = Iterator[Item]
Rows = Iterator[RawRow | RowError]

BINARY_LABELS = {"yes": 1.0, "true": 1.0, "no": 0.0, "false": 0.0}


class SourceLike(Protocol):
    """What a converter reads of a configured source (``embed_core.prepare.config.SourceSpec``)."""

    name: str
    kind: str
    path: str
    format: str | None
    delimiter: str | None
    header: bool
    quoting: str
    multiline: bool
    limits: ReadLimits
    columns: dict[str, str | int]
    task: str | None
    instruction: str
    max_rows: int | None
    dev_path: str | None
    params: Any


class RunLike(Protocol):
    """What a converter reads of the run config: where relative paths point, and the seed."""

    seed: int

    def resolve(self, path: str) -> Path: ...


class ConverterParams(BaseModel):
    """Settings of one source kind (none by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # finite, as every config float


def _ordered(v: tuple[float, float] | None) -> tuple[float, float] | None:
    if v is not None and not v[0] < v[1]:
        raise ValueError(f"score_range must be [min, max] with min < max, got {list(v)}")
    return v


class ScoreRangeParams(ConverterParams):
    """For kinds that read scores: the range a valid score lies in."""

    score_range: Annotated[tuple[float, float] | None, AfterValidator(_ordered)] = Field(
        None, description="Inclusive [min, max] of a valid score; a row with a score outside it is quarantined "
        "(reason score_range). None = any finite score.")


class Columns:
    """Maps a kind's logical fields to the source's columns (names, or indexes without header)."""

    def __init__(self, spec: SourceLike, names: dict[str, str], optional: tuple[str, ...] = ()):
        positions = {logical: i for i, logical in enumerate(names)}
        named = spec.header or spec.format in ("jsonl", "parquet")
        self.map: dict[str, str | int] = {**(names if named else positions), **spec.columns}
        self.optional = optional

    def __getitem__(self, logical: str) -> str | int:
        return self.map[logical]

    def required(self) -> list[str | int]:
        return [c for k, c in self.map.items() if k not in self.optional]


class Converter:
    """One source kind: what it declares and how it converts (see the module docstring); an
    instance reads one configured source."""

    kind: ClassVar[str]
    task: ClassVar[str] = "retrieval"
    columns: ClassVar[dict[str, str]] = {}
    optional: ClassVar[tuple[str, ...]] = ()
    text_fields: ClassVar[tuple[str, ...]] = ()
    pair: ClassVar[bool] = False
    one_file: ClassVar[bool] = True  # reads one file (so a dev_path file of the same layout works)
    produces: ClassVar[str] = "records"  # the artifact kind prepare writes from it (artifacts.ARTIFACT_KINDS)
    Params: ClassVar[type[ConverterParams]] = ConverterParams

    def __init__(self, spec: SourceLike, run: RunLike):
        self.spec = spec
        self.run = run
        self.params = spec.params
        self.cols = Columns(spec, self.columns, self.optional)

    @classmethod
    def check_columns(cls, columns: dict[str, str | int]) -> None:
        """A ValueError naming the keys of ``columns`` that are no logical field of this kind."""
        unknown = set(columns) - set(cls.columns)
        if unknown:
            raise ValueError(f"unknown column key(s) {sorted(unknown)} for kind '{cls.kind}' "
                             f"(expected {sorted(cls.columns)})")

    # -- what a kind implements --------------------------------------------------------------

    def convert_row(self, raw: RawRow) -> list[Item]:
        """The records of one good row (raise RowError for a bad one)."""
        raise NotImplementedError

    def convert(self, rows: Rows) -> ConvertStream:
        """Records of all rows; bad rows come out as their RowError, in file order."""
        for raw in rows:
            if isinstance(raw, RowError):
                yield raw
                continue
            try:
                items = self.convert_row(raw)
            except RowError as err:
                yield err
                continue
            yield from items

    # -- what every kind gets ----------------------------------------------------------------

    def records(self) -> ConvertStream:
        return self.convert(self.rows())

    def rows(self) -> Rows:
        spec = self.spec
        rows = read_rows(self.run.resolve(spec.path), spec.path, fmt=spec.format, delimiter=spec.delimiter,
                         header=spec.header, quoting=spec.quoting, multiline=spec.multiline,
                         required=self.cols.required(), root=root_for(self.run.resolve, spec.path),
                         limits=spec.limits)
        return rows if spec.max_rows is None else _limit(rows, spec.max_rows)

    def texts(self) -> Iterator[str]:
        """The raw texts of an evaluation source (its ``text_fields``), for contamination checks."""
        for raw in self.rows():
            if isinstance(raw, RowError):
                continue
            for logical in self.text_fields:
                try:
                    yield self.text(raw, logical)
                except RowError:
                    continue

    def pairs(self) -> Iterator[tuple[str, str]]:
        """(text1, text2) of every good row of a pair kind."""
        for raw in self.rows():
            if isinstance(raw, RowError):
                continue
            try:
                yield self.text(raw, "text1"), self.text(raw, "text2")
            except RowError:
                continue

    def files(self) -> list[tuple[str, Path]]:
        """(display name, resolved path) of every file the source reads: what its fingerprint hashes."""
        out = [(self.spec.path, self.run.resolve(self.spec.path))]
        if self.spec.dev_path:
            out.append((self.spec.dev_path, self.run.resolve(self.spec.dev_path)))
        return out

    def text(self, raw: RawRow, logical: str) -> str:
        """The text of a logical field in ``raw`` (a RowError names the column)."""
        return get_text(raw, self.cols[logical])

    def record(self, *, id: str, source_ref: str, **fields: Any) -> Record:
        """A record of this source: dataset, task and instruction filled in."""
        spec = self.spec
        return Record(id=id, dataset=spec.name, task=spec.task or self.task, instruction=spec.instruction,
                      origin="original", source_ref=source_ref, **fields)

    def row_record(self, raw: RawRow, suffix: str = "", **fields: Any) -> Record:
        """The record of one row, with the row's id (``<name>:<file>:<row><suffix>``) and reference."""
        return self.record(id=f"{self.spec.name}:{PurePath(raw.file).name}:{raw.row}{suffix}", source_ref=raw.ref,
                           **fields)


def _limit(rows: Rows, n: int) -> Rows:
    seen = 0
    for item in rows:
        if seen >= n:
            return
        if not isinstance(item, RowError):
            seen += 1
        yield item


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
            raise RowError(file, row, field, "bad_score", f"not a number: {excerpt(repr(value))}") from None
    else:
        raise RowError(file, row, field, "bad_score", f"not a number: {excerpt(repr(value))}")
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
        raise RowError(raw.file, raw.row, column_label(col), "unknown_label",
                       f"unknown label {excerpt(repr(value))} (expected one of {known})")
    return lowered[key]

"""The small pieces every config section shares: the strict base model, path-safe names and the
file-format settings of a delimited, JSONL or Parquet file.

A leaf: it imports nothing from ``embed_core`` but the errors, so every stage's config module
(``embed_core/<stage>/config.py``) and ``embed_core.config`` can build on it without a cycle.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StrictModel(BaseModel):
    """A config section: unknown keys are errors (a misspelt key never falls back to a default), and
    every float, alone or inside a list or dict, is finite (a NaN weight would train NaN weights)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Names that become file or directory names (run, dataset, evaluation task): one path component,
# printable, short enough for any filesystem, and never '.', '..' or hidden.
PATH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,99}")


def check_path_name(value: str, what: str) -> str:
    """``value`` if it is safe as one path component, else a ValueError saying what is allowed."""
    if not PATH_NAME.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise ValueError(f"{what} {shown!r} becomes a path: use 1-100 letters, digits or '._+=-', starting with "
                         "a letter or digit")
    return value


def one_character_delimiter(v: str | None) -> str | None:
    if v is not None and (len(v) != 1 or v in "\r\n\"" or not v.isprintable() and v != "\t"):
        raise ValueError(f"delimiter must be one character other than a quote or line break, got {v!r}")
    return v


FileFormatName = Literal["csv", "tsv", "delimited", "jsonl", "parquet"]

MiB = 1 << 20
GiB = 1 << 30


class ReadLimits(StrictModel):
    """What a reader holds of a file at once, so a damaged or hostile file (a 2 GB line, a 500 MB
    Parquet cell, a gzip bomb) is one quarantined row or one error line instead of a MemoryError.
    The defaults are far above real data: a text is cut to `cleaning.max_chars` (8,000 characters)
    anyway, and the largest public retrieval corpora hold documents of a few MB; deflate expands a
    file at most about 1,000-fold, so a 32 GiB bound stops only bombs (and corpora bigger than any
    one source this pipeline trains on)."""

    max_line_bytes: int = Field(
        64 * MiB, ge=1024, description="Bytes of one line (CSV, TSV, JSONL); default 64 MiB. A longer line is "
        "quarantined (reason line_too_long; a CSV header line that long refuses the file) and skipped without "
        "being held in memory.")
    max_record_bytes: int = Field(
        64 * MiB, ge=1024, description="Bytes of one record (default 64 MiB): a CSV record whose quoted fields span "
        "lines, a Parquet row, or a corpus document (a .txt, .md, .html or .pdf file, read no further than this "
        "before decoding). A larger one is quarantined (reason record_too_long) with every line that belongs to it.")
    max_field_bytes: int = Field(
        32 * MiB, ge=1024, description="Bytes (UTF-8) of one field (default 32 MiB): a CSV cell, a JSONL string "
        "value, a Parquet text or binary cell. A row holding a larger one is quarantined (reason field_too_long), "
        "naming the field.")
    max_decompressed_bytes: int = Field(
        32 * GiB, ge=1024, description="Bytes a compressed file ('.gz', or the pages of a Parquet file) may expand "
        "to; default 32 GiB. Past it the file is refused with one error line (raise this bound for a larger source).")


class FileFormat(StrictModel):
    """How a data file is read and which of its columns hold which field (prepare sources and
    evaluation tasks): the keys stand flat in the section that inherits them."""

    format: FileFormatName | None = Field(None, description="File format; inferred from the extension when omitted.")
    delimiter: str | None = Field(None, description="Field delimiter for format 'delimited' (one character, e.g. ';').")
    header: bool = Field(True, description="Whether the first line names the columns.")
    quoting: Literal["auto", "none", "minimal"] = Field(
        "auto", description="CSV/TSV quoting: auto (sniffed), none (quotes are text), minimal (RFC 4180).")
    multiline: bool = Field(True, description="CSV (and TSV with quoting: minimal): quoted fields may span lines "
                            "(RFC 4180, as pandas, Excel and Python's csv write them). A broken record costs only "
                            "the line it starts on, and the lines after it are read again as rows: a quote that "
                            "never closes (unterminated_quote), a record without the file's number of fields "
                            "(malformed_line), a quoted field whose lines are rows of the file's shape "
                            "(stray_quote). Off: a record is one line, and a quote "
                            "still open at the end of its line is a stray quote: prepare quarantines that line and "
                            "reads the next line as a new row; evaluation data stops with an error naming the line.")
    columns: dict[str, str | int] = Field(
        default_factory=dict, description="Logical field -> column name (or 0-based index when header is false). "
        "A source's fields are its kind's (see Source kinds); an evaluation task's are those of the source kind "
        "its type is named after (sts: text1, text2, score; pair_classification: text1, text2, label; "
        "classification: text, label).")
    limits: ReadLimits = Field(default_factory=ReadLimits, description="Bounds on a line, a field, a record and "
                               "the decompressed size of the file (see ReadLimits); raise one for a file that "
                               "really holds more.")

    @field_validator("delimiter")
    @classmethod
    def _one_character(cls, v: str | None) -> str | None:
        return one_character_delimiter(v)

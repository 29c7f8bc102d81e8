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
    """A config section: unknown keys are errors (a misspelt key never falls back to a default)."""

    model_config = ConfigDict(extra="forbid")


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


class FileFormat(StrictModel):
    """How a data file is read and which of its columns hold which field (prepare sources and
    evaluation tasks): the keys stand flat in the section that inherits them."""

    format: FileFormatName | None = Field(None, description="File format; inferred from the extension when omitted.")
    delimiter: str | None = Field(None, description="Field delimiter for format 'delimited' (one character, e.g. ';').")
    header: bool = Field(True, description="Whether the first line names the columns.")
    quoting: Literal["auto", "none", "minimal"] = Field(
        "auto", description="CSV/TSV quoting: auto (sniffed), none (quotes are text), minimal (RFC 4180).")
    multiline: bool = Field(False, description="CSV: quoted fields may span lines (RFC 4180). Off: a quote still open "
                            "at the end of its line is a stray quote: prepare quarantines that line and reads the "
                            "next line as a new row (one bad quote never swallows later rows); evaluation data "
                            "stops with an error naming the line.")
    columns: dict[str, str | int] = Field(
        default_factory=dict, description="Logical field -> column name (or 0-based index when header is false). "
        "A source's fields are its kind's (see Source kinds); an evaluation task's are those of the source kind "
        "its type is named after (sts: text1, text2, score; pair_classification: text1, text2, label; "
        "classification: text, label).")

    @field_validator("delimiter")
    @classmethod
    def _one_character(cls, v: str | None) -> str | None:
        return one_character_delimiter(v)

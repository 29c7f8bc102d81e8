"""Error types. Every message names where the problem is: file, row and field."""

from __future__ import annotations


class EmbedpipeError(Exception):
    """Base class: the CLI turns these into a one-line reason and a non-zero exit."""


class ConfigError(EmbedpipeError):
    """The run config is invalid (unknown key, bad value, missing path)."""


class RowError(EmbedpipeError):
    """One input row is bad. Carries the location so it can be quarantined or reported.

    ``row`` is 1-based and counts physical lines of the file (header included), so it
    matches what an editor shows; for Parquet inputs it is the 0-based row index.
    """

    def __init__(self, file: str, row: int | None, field: str | None, reason: str, message: str):
        self.file = file
        self.row = row
        self.field = field
        self.reason = reason  # short machine-readable tag, used for counts
        self.detail = message
        where = file
        if row is not None:
            where += f":{row}"
        if field is not None:
            where += f": field '{field}'"
        super().__init__(f"{where}: {message}")


class SourceError(RowError):
    """A problem that makes a whole source unreadable (missing file, missing column in the header)."""


class SchemaError(RowError):
    """A record does not match the unified schema."""

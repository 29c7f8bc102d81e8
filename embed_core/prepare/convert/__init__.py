"""Converters: one per source kind, each a class in its own module of this package, and their registry.

Every module of this package that defines a subclass of ``Converter`` with its own ``kind`` is
found here (``discover``): a source names its kind (``kind: sts``) and, under ``params:``, the
settings only that kind has, validated against the converter's ``Params`` when the config loads.
Adding a source kind is one new file with a ``Converter`` subclass, and its test.

``convert_source(spec, run)`` reads a configured source and yields ``Record`` for good rows,
``RowError`` for bad ones (to quarantine) and ``Skipped`` for rows deliberately left out.
``source_texts`` / ``source_pairs`` yield the raw texts / text pairs of a source (contamination
checks), ``source_files`` the files it reads (its fingerprint).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from embed_core import registry
from embed_core.prepare.convert.base import (
    Converter,
    ConverterParams,
    ConvertStream,
    RunLike,
    Skipped,
    SourceLike,
)

__all__ = ["CONVERTERS", "Converter", "ConverterParams", "Skipped", "discover", "converter", "convert_source",
           "source_texts", "source_pairs", "source_files"]

CONVERTERS: dict[str, type[Converter]] = {}


def discover() -> dict[str, type[Converter]]:
    """Import every module on this package's ``__path__`` and register (in ``CONVERTERS``, kept as
    the same dict) each ``Converter`` subclass they define with a ``kind`` of its own."""
    found = registry.discover(__name__, __path__, Converter, "kind", "converters", own=True)
    CONVERTERS.clear()
    CONVERTERS.update(sorted(found.items()))
    return CONVERTERS


discover()


def converter(spec: SourceLike, run: RunLike) -> Converter:
    """The converter of ``spec``'s kind, reading ``spec`` (paths resolved and seeded by ``run``)."""
    return CONVERTERS[spec.kind](spec, run)


def convert_source(spec: SourceLike, run: RunLike) -> ConvertStream:
    return converter(spec, run).records()


def source_texts(spec: SourceLike, run: RunLike) -> Iterator[str]:
    """Raw texts of an evaluation source (the kind's text fields; BEIR: the judged queries of ``split``)."""
    return converter(spec, run).texts()


def source_pairs(spec: SourceLike, run: RunLike) -> Iterator[tuple[str, str]]:
    """(text1, text2) of a pair source (a kind with ``pair``: sts, entailment, pair_classification)."""
    return converter(spec, run).pairs()


def source_files(spec: SourceLike, run: RunLike) -> list[tuple[str, Path]]:
    """(display name, resolved path) of every file a source reads: what its fingerprint hashes."""
    return converter(spec, run).files()

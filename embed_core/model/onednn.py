"""A small oneDNN primitive cache, so bf16 encoding memory stays flat (no torch import here: the
CLI calls it before anything loads torch).

oneDNN keeps every primitive it creates in an LRU cache of 1,024 by default, one per input shape;
length-sorted batches have a new shape almost every batch, and under bf16 each cached primitive holds
megabytes, so a mining process grew by about 1 GB over a 78,657-text pool (docs/experiments.md). The
cache's capacity is read from ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` once per process, when the first
primitive is made; child processes (launchers, Ray workers) inherit it. With 8, encoding was no
slower in the same measurement: the shapes rarely repeat, so the large cache hardly ever hit.
"""

from __future__ import annotations

import os

ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CAPACITY = 8


def cap_onednn_primitive_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's primitive cache for this process and its children, unless the user set it."""
    os.environ.setdefault(ONEDNN_CACHE_ENV, str(capacity))

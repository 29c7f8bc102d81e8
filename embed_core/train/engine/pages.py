"""Record files memory-mapped for random access, and their pages let go after each batch: the
train stage maps its records (``embed_core.train.records``), the batch source releases what a batch
read (``embed_core.train.engine.prefetch``)."""

from __future__ import annotations

import mmap
import weakref
from pathlib import Path

import pyarrow as pa


def open_mapped(arrow: Path) -> pa.Table:
    """A table whose buffers are the pages of ``arrow`` (zero-copy: nothing is read until used),
    mapped for random access: no read-ahead, and ``release_pages`` lets go of what was touched."""
    with open(arrow, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)
    _MAPPINGS.add(mapping)
    return pa.ipc.open_file(pa.py_buffer(mapping)).read_all()


_MAPPINGS: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()  # the open record mappings of this process


def release_pages() -> None:
    """Unmap the pages of the record files this process has touched (``MADV_DONTNEED`` on a
    read-only file mapping: the next read maps them again from the page cache, unchanged). Called
    after every batch is built, so a rank's resident memory holds the pages of one batch, not of
    every record it ever drew: with a file-backed mapping the kernel maps in up to 64 KiB around
    each page read, and over a run that would grow with the dataset."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    for mapping in list(_MAPPINGS):
        if not mapping.closed:
            mapping.madvise(mmap.MADV_DONTNEED)

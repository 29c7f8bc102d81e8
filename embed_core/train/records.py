"""Training records memory-mapped, not copied into every rank.

A record file of the upstream stage (Parquet, checked against its manifest's hash) is converted
once, by rank 0, into an uncompressed Arrow IPC file in the stage's checkpoint directory
(``<run_dir>/checkpoints/<stage>/records/<file>-<sha16>.arrow``), validated and summarised as it
streams (a slice of 8,192 rows at a time: ``embed_core.schema.RowChecker``,
``embed_core.train.engine.batches.RecordsSummary``), and then mapped by every rank
(``embed_core.train.engine.pages.open_mapped``: a read-only ``mmap`` for random access): the
columns are views of the file's pages, which the operating system shares between the ranks of a
machine and reads in as batches touch them. A rank's memory then no longer grows with the training
set (``tests/benchmarks/bench_train_records.py``); the sampler's permutation (8 bytes a record) is
what remains: the pages a batch touched are let go after it is built (``pages.release_pages``).
The ranks read the dataset's summary (labels, highest score, instructions) from a JSON file beside
the copy instead of scanning the file.

The Arrow file is named by the Parquet file's hash, so a changed input is converted anew, and it
goes with the checkpoint directory (emptied when the stage's inputs change, removed when the
stage commits).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from embed_core.artifacts import atomic_write_json, checked_outputs, parquet_output
from embed_core.schema import RECORD_SCHEMA, RowChecker, check_schema
from embed_core.train.engine.batches import RecordsSummary
from embed_core.train.engine.pages import open_mapped
from embed_core.dist.distributed import barrier, is_main_process

RECORDS_DIR = "records"  # in the stage's checkpoint directory
ARROW_SUFFIX = ".arrow"
SUMMARY_SUFFIX = ".summary.json"
CONVERT_ROWS = 8192


def mapped_records(run_dir: Path, stage: str, cache_dir: Path) -> dict[str, tuple[pa.Table, RecordsSummary]]:
    """The record tables of ``<run_dir>/<stage>`` by file name, memory-mapped from their Arrow
    copies in ``cache_dir`` (made by rank 0 on first use; every rank calls this), with their
    summaries."""
    outputs = checked_outputs(run_dir, stage, kind="records")
    copies = {name: cache_dir / f"{Path(name).stem}-{sha[:16]}{ARROW_SUFFIX}" for name, (_, sha) in outputs.items()}
    if is_main_process():
        cache_dir.mkdir(parents=True, exist_ok=True)
        for name, (path, _) in outputs.items():
            if not _summary_path(copies[name]).exists():
                convert(path, copies[name])
    barrier()  # the other ranks open what rank 0 wrote
    return {name: (open_mapped(copy), RecordsSummary.from_json(json.loads(_summary_path(copy).read_text())))
            for name, copy in copies.items()}


def _summary_path(arrow: Path) -> Path:
    """Written last: its presence says the Arrow copy is complete and valid."""
    return arrow.with_name(arrow.name.removesuffix(ARROW_SUFFIX) + SUMMARY_SUFFIX)


def convert(parquet: Path, arrow: Path) -> None:
    """Write ``parquet``'s records as an uncompressed Arrow IPC file at ``arrow``, a slice at a time:
    each slice cast to the record schema, validated (a bad row is a ``SchemaError`` naming the
    Parquet file, the row and the field) and summarised; the summary is written last."""
    tmp = arrow.with_name(f".tmp-{arrow.name}")
    try:
        with _bounded_pool(), parquet_output(parquet):  # the pool before the reader is made: it allocates from it
            summary = _write_checked(parquet, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, arrow)
    atomic_write_json(_summary_path(arrow), summary.to_json())


def _write_checked(parquet: Path, tmp: Path) -> RecordsSummary:
    """The Arrow copy at ``tmp``, checked; its summary."""
    source = pq.ParquetFile(parquet)
    check_schema(source.schema_arrow, file=str(parquet))
    checker, summary = RowChecker(str(parquet)), RecordsSummary()
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, RECORD_SCHEMA) as writer:
        # a reader per row group: one reader over the whole file holds on to what it read (measured:
        # Arrow's allocation grew 44 -> 196 MB over 1M records; flat at 16 MB this way)
        for batch in (b for g in range(source.num_row_groups)
                      for b in source.iter_batches(batch_size=CONVERT_ROWS, row_groups=[g])):
            table = pa.Table.from_batches([batch]).cast(RECORD_SCHEMA)
            checker.check(table)
            summary.add(table)
            writer.write_table(table)
    checker.finish(lambda row: open_mapped(tmp).column("id")[row].as_py())
    return summary


@contextmanager
def _bounded_pool() -> Iterator[None]:
    """Arrow's jemalloc pool while converting, where the wheel has it: its memory stays flat over
    the slices (measured over 850k records: +24 MB after the first slices, against +77 MB still
    growing with mimalloc, Arrow's default, and +112 MB with the system allocator)."""
    try:
        pool = pa.jemalloc_memory_pool()
    except (NotImplementedError, AttributeError):
        yield
        return
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        yield
    finally:
        pa.set_memory_pool(previous)

"""The prepare stage's body (declared in ``stage.py``): raw sources → validated, cleaned unified records (one Parquet per dataset).

Order of operations per source: read + convert (bad rows → quarantine) → length limits →
schema validation → per dataset: dedupe (exact, then normalised) → contamination exclusion.
Outputs go to ``<run_dir>/prepare/``: ``<dataset>.parquet`` for each dataset,
``_quarantine.parquet`` (every rejected row with file, row, field, reason, message) and
``manifest.json`` with counts, input and output hashes, config hash and timings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from embed_core.artifacts import StageWriter, TableStream
from embed_core.config import RunConfig, config_hash
from embed_core.errors import RowError, SchemaError, SourceError
from embed_core.fingerprint import Fingerprint, sha256_file
from embed_core.manifests import PrepareManifest
from embed_core.prepare.cleaning import (
    Deduper,
    EvalTexts,
    KeyStore,
    contaminated_field,
    limit_length,
    normalize_text,
    pair_key,
)
from embed_core.prepare.config import PrepareConfig
from embed_core.prepare.convert import CONVERTERS, Skipped, convert_source, source_files, source_pairs, source_texts
from embed_core.prepare.corpus import write_corpus
from embed_core.prepare.near_dup import NearDuplicateIndex, NearHit
from embed_core.prepare.readers import confine, root_for
from embed_core.prepare.stage import NAME as STAGE
from embed_core.prepare.stage import NEAR_DUPLICATES_FILE
from embed_core.progress import iterate
from embed_core.schema import CORPUS_KIND, RECORD_SCHEMA, SCHEMA_VERSION, Record, validate_row

log = logging.getLogger("embedpipe.prepare")

QUARANTINE_FILE = "_quarantine.parquet"
ROWS_PER_GROUP = 8192  # records per Parquet row group: what prepare holds of a dataset at a time
DEV_DIR = "dev"  # <run_dir>/prepare/dev/<dataset>.parquet: dev records (kind dev_records)  # leading underscore: ignored by pyarrow dataset discovery
NEAR_DUPLICATES_SCHEMA = pa.schema([
    ("id", pa.string()), ("dataset", pa.string()), ("source_ref", pa.string()), ("field", pa.string()),
    ("text", pa.string()), ("nearest_text", pa.string()), ("contamination_set", pa.string()),
    ("jaccard", pa.float64()),
])
QUARANTINE_SCHEMA = pa.schema([
    ("dataset", pa.string()), ("file", pa.string()), ("row", pa.int64()), ("field", pa.string()),
    ("reason", pa.string()), ("message", pa.string()),
])


# Libraries whose versions are part of this stage's code identity (embed_core.fingerprint).
LIBRARIES = ("pyarrow",)


def _content_hash(config: RunConfig, display: str, path: Path) -> str:
    """A source file's hash; a missing path or a directory keys as such (the reader then names the
    problem). A path that leaves data_root is never read, not even to hash it (``readers.confine``)."""
    path = confine(path, display, root_for(config.resolve, display))
    if path.is_file():
        return sha256_file(path)
    return "directory" if path.is_dir() else "missing"


def input_fingerprint(config: RunConfig, run_dir: str | Path | None = None) -> Fingerprint:
    """Content hashes of every file the stage reads, plus its config and code identity.

    ``key`` changes exactly when an input file's bytes, the prepare/seed config, the schema
    version or the code this stage runs change (mtime plays no part).
    """
    files: dict[str, str] = {}
    for spec in [*config.prepare.sources, *config.prepare.contamination]:
        for display, path in source_files(spec, config):
            files[str(display)] = _content_hash(config, str(display), Path(path))
    return Fingerprint.of(STAGE, __name__, LIBRARIES, {
        "files": files, "config": _config_key(config.prepare), "seed": config.seed, "schema": SCHEMA_VERSION})


def _config_key(prepare: PrepareConfig) -> str:
    """The prepare section's hash; with near_duplicates unset, the hash it had before that option
    existed (existing configs keep their cache keys' config part)."""
    if prepare.near_duplicates is not None:
        return config_hash(prepare)
    blob = json.dumps(prepare.model_dump(mode="json", exclude={"near_duplicates"}), sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def source_fingerprints(config: RunConfig) -> dict[str, str]:
    """Content hash per configured source (training sources and contamination sets), by name.

    What the data-change watch compares between runs: a source's value changes exactly when the
    bytes of one of its files change (mtime, renames of the run dir etc. play no part).
    """
    out: dict[str, str] = {}
    for spec in [*config.prepare.sources, *config.prepare.contamination]:
        files = {str(display): _content_hash(config, str(display), Path(path))
                 for display, path in source_files(spec, config)}
        out[spec.name] = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return out


def _quarantine_row(dataset: str, err: RowError) -> dict[str, Any]:
    return {"dataset": dataset, "file": err.file, "row": err.row, "field": err.field,
            "reason": err.reason, "message": err.detail}


def collect_eval_texts(config: RunConfig) -> EvalTexts:
    """Normalised texts (and text pairs) of the configured evaluation sets."""
    evals = EvalTexts()
    for spec in config.prepare.contamination:
        if spec.match == "pair":
            evals.pairs.update(pair_key(a, b) for a, b in source_pairs(spec, config))
        else:
            evals.texts.update(normalize_text(t) for t in source_texts(spec, config))
    evals.texts.discard("")
    return evals


def collect_near_duplicates(config: RunConfig) -> NearDuplicateIndex | None:
    """The evaluation sets' texts (``match: pair`` sets: their pairs) for near-duplicate
    exclusion, each under its set's name; None when ``prepare.near_duplicates`` is off."""
    if config.prepare.near_duplicates is None:
        return None
    index = NearDuplicateIndex.from_config(config.prepare.near_duplicates)
    for spec in config.prepare.contamination:
        seen: set[str | tuple[str, str]] = set()
        if spec.match == "pair":
            for a, b in source_pairs(spec, config):
                if (key := pair_key(a, b)) not in seen:
                    seen.add(key)
                    index.add_pair(a, b, spec.name)
        else:
            for text in source_texts(spec, config):
                if (key := normalize_text(text)) not in seen:
                    seen.add(key)
                    index.add_text(text, spec.name)
    return index


def _converted(spec, config: RunConfig, counts: Counter, reasons: Counter, quarantine: TableStream):
    """The valid records of one source file set, counting and quarantining the rest."""
    cleaning = config.prepare.cleaning
    for item in iterate(convert_source(spec, config), f"prepare {spec.name}", unit="rows", logger=log):
        if isinstance(item, Skipped):
            counts["skipped"] += 1
            continue
        if isinstance(item, RowError):
            quarantine.append(_quarantine_row(spec.name, item))
            reasons[item.reason] += 1
            continue
        counts["converted"] += 1
        try:
            record, cut = limit_length(item, cleaning.max_chars, cleaning.over_long)
            file, _, row = record.source_ref.rpartition(":")
            validate_row(record.to_row(), file=file, row_number=int(row) if row.isdigit() else None)
        except (RowError, SchemaError) as err:
            quarantine.append(_quarantine_row(spec.name, err))
            reasons[err.reason] += 1
            continue
        counts["truncated_texts"] += cut
        yield record


def _in_dev(record: Record, fraction: float, seed: int) -> bool:
    """Seeded choice by source row (file:line or query id), so every record of one row — both
    directions of a pair — lands on the same side."""
    key = record.source_ref if record.task != "retrieval" else record.id.split("~")[0]
    digest = hashlib.sha256(f"{seed}:dev:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < fraction


def _add_dev_texts(out: EvalTexts, rec: Record) -> None:
    """What a training record must not share with its dataset's dev records: a dev pair (query with
    a positive, either order), or a dev query of a retrieval or classification set."""
    for pos in rec.positives:
        out.pairs.add(pair_key(rec.query, pos))
    if rec.task in ("retrieval", "classification"):
        out.texts.add(normalize_text(rec.query))


def _records(path: Path) -> Iterator[Record]:
    """Records of a spill file, a row group at a time."""
    for batch in pq.ParquetFile(path).iter_batches(batch_size=ROWS_PER_GROUP):
        for row in batch.to_pylist():
            yield Record(**row)


@dataclass
class _Dataset:
    """One dataset while prepare streams it: training records wait in a spill file (deduplicated,
    not yet checked against dev records, which may come later in the source) and dev records go
    straight to their output."""

    spill: TableStream
    dedupe: Deduper
    dev_dedupe: Deduper
    dev_texts: EvalTexts
    counts: Counter = field(default_factory=Counter)
    dev: TableStream | None = None
    near_dev: NearDuplicateIndex | None = None  # its dev texts, with near_duplicates on


@dataclass
class _NearDuplicates:
    """Near-duplicate exclusion while datasets are written: the evaluation sets' index and the
    report of every record it drops (``_near_duplicates.parquet``)."""

    evals: NearDuplicateIndex
    report: TableStream

    def drops(self, rec: Record, ds: _Dataset) -> bool:
        """True (and a report row) when ``rec`` is a near duplicate of an evaluation or dev text."""
        hit: NearHit | None = self.evals.match(rec)
        if hit is None and ds.near_dev is not None:
            hit = ds.near_dev.match(rec)
        if hit is None:
            return False
        self.report.append({"id": rec.id, "dataset": rec.dataset, "source_ref": rec.source_ref, "field": hit.field,
                            "text": hit.text, "nearest_text": hit.nearest, "contamination_set": hit.source,
                            "jaccard": round(hit.jaccard, 6)})
        return True


def run_prepare(config: RunConfig, run_dir: str | Path, fingerprint: Fingerprint | None = None) -> dict[str, Any]:
    """Run the prepare stage and return its manifest. Raises ``EmbedpipeError`` on a config or
    whole-source problem before anything is written. ``fingerprint``: this run's inputs, when the
    caller computed them already.

    Memory does not grow with the sources' size for streamed kinds: rows are read one at a time,
    records go to Parquet a row group at a time, and the dedupe, dev and id sets live in an
    on-disk key store (``KeyStore``); only the contamination sets (the evaluation data) and what a
    converter itself must hold (a BEIR corpus, a classification source's texts by label) are in
    memory, and with ``near_duplicates`` on the dev texts' shingles and MinHashes."""
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    fingerprint = fingerprint or input_fingerprint(config)
    eval_texts = collect_eval_texts(config)
    near_evals = collect_near_duplicates(config)
    t_eval = time.perf_counter()

    with StageWriter(run_dir, STAGE, PrepareManifest, fingerprint=fingerprint, run_name=config.run_name) as writer:
        keys = KeyStore(writer.scratch / "keys.sqlite")
        quarantine = writer.stream_table(QUARANTINE_FILE, QUARANTINE_SCHEMA, kind="quarantine")
        datasets: dict[str, _Dataset] = {}
        near = None if near_evals is None else _NearDuplicates(near_evals, writer.stream_table(
            NEAR_DUPLICATES_FILE, NEAR_DUPLICATES_SCHEMA, kind="near_duplicates"))
        per_source = [_convert_source(spec, config, writer, keys, quarantine, datasets, eval_texts, near_evals)
                      for spec in config.prepare.sources]
        t_convert = time.perf_counter()
        per_dataset = {name: _write_dataset(name, ds, writer, keys, eval_texts, near)
                       for name, ds in datasets.items() if ds.counts["records_in"]}
        keys.close()
        quarantine.close()
        t_clean = time.perf_counter()
        totals = _totals(per_source, per_dataset, quarantine.rows, eval_texts)
        if near is not None:
            near.report.close()
            totals["excluded_near_duplicate"] = near.report.rows
        t_end = time.perf_counter()
        manifest = writer.commit({
            "inputs": fingerprint.inputs["files"],
            "config_hash": fingerprint.inputs["config"],
            "counts": {"totals": totals, "sources": per_source, "datasets": list(per_dataset.values())},
            "timings_s": {"eval_texts": round(t_eval - t0, 3), "convert": round(t_convert - t_eval, 3),
                          "clean": round(t_clean - t_convert, 3), "write": round(t_end - t_clean, 3),
                          "total": round(t_end - t0, 3)},
        })
    log.info("prepare: %d records written, %d quarantined, %d deduped, %d excluded (contamination)%s",
             totals["records_written"], totals["quarantined"], totals["deduped"], totals["excluded_contamination"],
             f", {totals['excluded_near_duplicate']} near duplicates" if near is not None else "")
    return manifest


def _dataset_for(spec, config: RunConfig, writer: StageWriter, keys: KeyStore,
                 datasets: dict[str, _Dataset]) -> _Dataset:
    """The dataset a source writes to (two sources may share one name)."""
    ds = datasets.get(spec.name)
    if ds is None:
        dedupe = config.prepare.cleaning.dedupe
        ds = datasets[spec.name] = _Dataset(
            spill=TableStream(writer.scratch / f"{spec.name}.spill.parquet", RECORD_SCHEMA, ROWS_PER_GROUP),
            dedupe=Deduper(keys, f"{spec.name}:train", dedupe),
            dev_dedupe=Deduper(keys, f"{spec.name}:dev", dedupe),
            dev_texts=EvalTexts(keys.set(f"{spec.name}:dev-texts"), keys.set(f"{spec.name}:dev-pairs")),
            near_dev=(None if config.prepare.near_duplicates is None
                      else NearDuplicateIndex.from_config(config.prepare.near_duplicates)))
    return ds


def _convert_source(spec, config: RunConfig, writer: StageWriter, keys: KeyStore, quarantine: TableStream,
                    datasets: dict[str, _Dataset], eval_texts: EvalTexts,
                    near_evals: NearDuplicateIndex | None) -> dict[str, Any]:
    """Step 1, per source: convert its rows (and its dev file's), send dev records to their output
    and training records, deduplicated, to the dataset's spill file; its counts. A corpus source
    (passages, no queries) writes its corpus artifact instead (``prepare/corpus.py``)."""
    if CONVERTERS[spec.kind].produces == CORPUS_KIND:
        return write_corpus(spec, config, writer, keys, quarantine, _quarantine_row, eval_texts, near_evals)
    counts: Counter = Counter()
    reasons: Counter = Counter()
    parts = [(spec, False)]
    if spec.dev_path:  # the source's own dev file: read like the source, every row a dev record
        parts.append((spec.model_copy(update={"path": spec.dev_path, "dev_path": None}), True))
    ds = _dataset_for(spec, config, writer, keys, datasets)
    for part, is_dev_file in parts:
        for record in _converted(part, config, counts, reasons, quarantine):
            if is_dev_file or (spec.dev_fraction > 0 and _in_dev(record, spec.dev_fraction, config.seed)):
                _add_dev_record(ds, record, writer, spec.name, eval_texts, near_evals)
                continue
            ds.counts["records_in"] += 1
            verdict = ds.dedupe.verdict(record)
            if verdict is not None:
                ds.counts[f"deduped_{verdict}"] += 1
                continue
            ds.spill.append(record.to_row())
    if not (counts["converted"] or counts["skipped"] or reasons) and not spec.allow_empty:
        raise SourceError(spec.path, None, None, "empty_source",
                          f"source '{spec.name}' has no data rows (set allow_empty: true on the source to "
                          "accept an empty one)")
    return {"source": spec.name, "kind": spec.kind, "path": spec.path,
            "records_converted": counts["converted"], "rows_skipped": counts["skipped"],
            "quarantined": sum(reasons.values()), "quarantined_by_reason": dict(reasons),
            "truncated_texts": counts["truncated_texts"], "dev_records": ds.counts["dev_in"]}


def _add_dev_record(ds: _Dataset, record: Record, writer: StageWriter, dataset: str, eval_texts: EvalTexts,
                    near_evals: NearDuplicateIndex | None) -> None:
    ds.counts["dev_in"] += 1
    if ds.dev is None:
        ds.dev = writer.stream_table(f"{DEV_DIR}/{dataset}.parquet", RECORD_SCHEMA,
                                     kind="dev_records")  # not "records": no stage trains on them
    # dev records select models during training: a test text (or, with near_duplicates on, a near
    # duplicate of one) among them would leak the test set
    if (ds.dev_dedupe.verdict(record) is None and contaminated_field(record, eval_texts) is None
            and (near_evals is None or near_evals.match(record) is None)):
        ds.dev.append(record.to_row())
        _add_dev_texts(ds.dev_texts, record)
        if ds.near_dev is not None:
            _add_dev_near(ds.near_dev, record, dataset)


def _add_dev_near(index: NearDuplicateIndex, rec: Record, dataset: str) -> None:
    """What ``_add_dev_texts`` keeps of a dev record, for near-duplicate exclusion."""
    for pos in rec.positives:
        index.add_pair(rec.query, pos, f"dev:{dataset}")
    if rec.task in ("retrieval", "classification"):
        index.add_text(rec.query, f"dev:{dataset}")


def _write_dataset(dataset: str, ds: _Dataset, writer: StageWriter, keys: KeyStore,
                   eval_texts: EvalTexts, near: _NearDuplicates | None) -> dict[str, Any]:
    """Step 2, per dataset: its spilled training records minus those that share a text with the
    evaluation sets or its dev records (or, with ``near``, nearly share one), to
    ``<dataset>.parquet``; its counts."""
    ds.spill.close()
    out: TableStream | None = None
    tasks: Counter = Counter()
    ids = keys.set(f"{dataset}:ids")
    excluded = excluded_dev = excluded_near = 0
    for rec in _records(ds.spill.path):
        if contaminated_field(rec, eval_texts) is not None:
            excluded += 1
            continue
        if ds.dev_texts and contaminated_field(rec, ds.dev_texts) is not None:
            excluded_dev += 1
            continue
        if near is not None and near.drops(rec, ds):
            excluded_near += 1
            continue
        if not ids.add(rec.id):  # two sources with one dataset name and the same file name
            raise SchemaError(rec.source_ref, None, "id", "duplicate_id",
                              f"duplicate record id {rec.id!r} in dataset {dataset!r}")
        if out is None:
            out = writer.stream_table(f"{dataset}.parquet", RECORD_SCHEMA, kind="records")
        out.append(rec.to_row())
        tasks[rec.task] += 1
    ds.spill.path.unlink()
    if out is not None:
        out.close()
    dev_written = 0
    if ds.dev is not None:
        ds.dev.close()
        dev_written = ds.dev.rows
    counts = {"dataset": dataset, "records_in": ds.counts["records_in"], "deduped_exact": ds.counts["deduped_exact"],
              "deduped_normalized": ds.counts["deduped_normalized"], "excluded_contamination": excluded,
              "excluded_dev_overlap": excluded_dev, "written": out.rows if out is not None else 0,
              "dev_records": dev_written, "tasks": dict(tasks)}
    if near is not None:  # the key only with near_duplicates on: manifests without it stay as they were
        counts["excluded_near_duplicate"] = excluded_near
    return counts


def _totals(per_source: list[dict[str, Any]], per_dataset: dict[str, dict[str, Any]], quarantined: int,
            eval_texts: EvalTexts) -> dict[str, Any]:
    return {
        "rows_read": sum(s["records_converted"] for s in per_source) + quarantined
        + sum(s["rows_skipped"] for s in per_source),
        "records_written": sum(d["written"] for d in per_dataset.values()),
        "quarantined": quarantined,
        "quarantined_by_reason": dict(sum((Counter(s["quarantined_by_reason"]) for s in per_source), Counter())),
        "skipped": sum(s["rows_skipped"] for s in per_source),
        "deduped": sum(d["deduped_exact"] + d["deduped_normalized"] for d in per_dataset.values()),
        "excluded_contamination": sum(d["excluded_contamination"] for d in per_dataset.values()),
        "eval_texts": len(eval_texts.texts), "eval_pairs": len(eval_texts.pairs),
    }

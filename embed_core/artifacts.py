"""Artifact store: ``<run_dir>/<stage>/`` holds Parquet files and a ``manifest.json``.

Atomicity: a stage writes into a hidden staging directory next to its final one; only when every
file and the manifest are written is the staging directory swapped in (rename). A stage killed
half-way leaves its previous artifact untouched and the staging directory is ignored (and cleaned
up by the next run). Readers go through the manifest and refuse outputs whose hash does not match.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from embed_core import __version__
from embed_core.errors import UNCOMMITTED_ATTR, DiskFullError, EmbedpipeError, disk_full_errno, printable
from embed_core.fingerprint import Fingerprint, sha256_file
from embed_core.manifests import MANIFEST, Manifest, OutputInfo
from embed_core.paths import files_within
from embed_core.procs import check_parent
from embed_core.schema import CORPUS_KIND, PASSAGE_SCHEMA, RECORD_SCHEMA, SCHEMA_VERSION, check_table

__all__ = ["MANIFEST", "Manifest", "OutputInfo", "StageWriter", "TableStream", "ARTIFACT_KINDS", "read_manifest",
           "read_records", "read_corpora", "read_model", "read_tables", "output_hashes"]

# mkstemp creates files 0600; outputs are meant to be shared (run directories are copied between
# people and served to the Prefect UI), so they get the mode a plain open() would: 0666 & ~umask.
_UMASK = os.umask(0)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        _fsync_replace(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def atomic_write_parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, FILE_MODE)
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")
        _fsync_replace(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``): a reader or
    a kill sees the old or the new artifact, never neither. False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


class TableStream:
    """One Parquet output of a stage written a row group at a time (memory constant in the file's
    size): ``append`` rows, and the stage writer registers the file with its row count and hash
    when it is closed (``StageWriter.commit`` closes any still open)."""

    def __init__(self, path: Path, schema: pa.Schema, rows_per_group: int):
        self.path = path
        self.schema = schema
        self.rows_per_group = rows_per_group
        self.rows = 0
        self._pending: list[dict[str, Any]] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(path, schema, compression="zstd")

    def append(self, row: dict[str, Any]) -> None:
        self._pending.append(row)
        if len(self._pending) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if self._pending and self._writer is not None:
            self._writer.write_table(pa.Table.from_pylist(self._pending, schema=self.schema))
            self.rows += len(self._pending)
            self._pending = []

    def close(self) -> None:
        if self._writer is None:
            return
        self._flush()
        self._writer.close()
        self._writer = None
        os.chmod(self.path, FILE_MODE)

    def discard(self) -> None:
        """Close without writing what is pending (the stage failed; its staging directory goes)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class StageWriter:
    """Collects one stage's outputs in a staging directory and swaps it in on ``commit``.

    Use as a context manager; leaving the block with an exception discards the staging
    directory and leaves the previous artifact as it was.

    The writer fills the manifest's envelope (``embed_core.manifests``): ``manifest`` is the step's
    class (its ``STEP`` is written as ``step``; ``commit`` validates the stage's sections against
    it), ``fingerprint`` the cache key (a ``Fingerprint``: key and code; or a bare key, with
    ``code``), ``run_name`` the run's; ``commit`` takes only the stage's own sections. (A bare
    ``StageWriter(run_dir, name)`` whose ``commit`` is given ``run_name``, ``input_fingerprint``
    and ``code`` itself still works, with no ``step``.)

    In a multi-process job only rank 0 opens one (``embed_core.dist.ranks``): opening cleans the
    stage's leftovers, which would be another rank's staging directory, so a writer on any other
    rank is refused.
    """

    def __init__(self, run_dir: Path, stage: str, manifest: type[Manifest] = Manifest, *,
                 fingerprint: Fingerprint | str | None = None, run_name: str | None = None, code: str | None = None):
        self.run_dir = Path(run_dir)
        self.stage = stage
        self.manifest_class = manifest
        key, code = (fingerprint.key, fingerprint.code) if isinstance(fingerprint, Fingerprint) else (fingerprint, code)
        self.envelope = {k: v for k, v in (("step", manifest.STEP), ("run_name", run_name),
                                           ("input_fingerprint", key), ("code", code)) if v is not None}
        self.final = self.run_dir / stage
        self.staging = self.run_dir / f".{stage}.staging-{uuid.uuid4().hex[:8]}"
        self.outputs: dict[str, dict[str, Any]] = {}
        self._streams: dict[str, tuple[TableStream, str]] = {}
        self._committed = False

    def __enter__(self) -> "StageWriter":
        rank = _other_rank()
        if rank:  # its clean-up would delete rank 0's staging directory of the same stage
            raise EmbedpipeError(f"{self.final}: rank {rank} of a multi-process job opened a stage writer; only rank 0 "
                                 "writes a stage, the other ranks read what it committed")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.final.is_symlink() or (self.final.exists() and not (self.final / MANIFEST).is_file()):
            raise EmbedpipeError(f"{self.final}: exists and is not a stage artifact embedpipe wrote (no {MANIFEST}); "
                                 "it is left as it is: move it out of the run directory to run this stage")
        clean_leftovers(self.run_dir, self.stage)
        self.staging.mkdir()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._committed:
            for stream, _ in self._streams.values():
                stream.discard()
            shutil.rmtree(self.staging, ignore_errors=True)
            if exc is not None and not isinstance(exc, Exception):  # an interrupt: the command's line names the stage
                setattr(exc, UNCOMMITTED_ATTR, [*getattr(exc, UNCOMMITTED_ATTR, []), str(self.final)])
            full = disk_full_errno(exc)  # pyarrow's names no file, safetensors' is no OSError
            if full is not None:
                where = getattr(exc, "filename", None) or self.staging
                raise DiskFullError(f"{where}: no space left to write the {self.stage} stage "
                                    f"({errno.errorcode.get(full, full)}: the disk is full, or a quota or "
                                    f"file-size limit is reached); nothing was committed and {self.final} is as it "
                                    "was: free space on the run directory's disk and run again") from exc

    @property
    def scratch(self) -> Path:
        """A directory for a stage's temporary files (spills, on-disk indexes): inside the staging
        directory, so it is on the run's disk and removed before the commit or with a failed stage."""
        path = self.staging / ".scratch"
        path.mkdir(exist_ok=True)
        return path

    def stream_table(self, name: str, schema: pa.Schema, kind: str, rows_per_group: int = 8192) -> TableStream:
        """A Parquet output written in row groups (``TableStream``); registered when closed."""
        stream = TableStream(self.staging / name, schema, rows_per_group)
        self._streams[name] = (stream, kind)
        return stream

    def _register_streams(self) -> None:
        for name, (stream, kind) in self._streams.items():
            stream.close()
            if name not in self.outputs:
                self.outputs[name] = {"kind": kind, "rows": stream.rows,
                                      "sha256": sha256_file(stream.path, remember=False)}

    def write_table(self, name: str, table: pa.Table, kind: str) -> Path:
        path = self.staging / name
        atomic_write_parquet(path, table)
        self.outputs[name] = {"kind": kind, "rows": table.num_rows, "sha256": sha256_file(path, remember=False)}
        return self.final / name

    def write_file(self, name: str, data: bytes, kind: str) -> Path:
        path = self.staging / name
        atomic_write_bytes(path, data)
        self.outputs[name] = {"kind": kind, "sha256": sha256_file(path, remember=False)}
        return self.final / name

    def register_tree(self, name: str, kind: str) -> Path:
        """Record every file a caller wrote under ``staging/<name>/`` (e.g. a saved model) as outputs;
        a link out of the staging directory is an error, never an output (``files_within``)."""
        root = self.staging / name
        for path in files_within(root):
            self.outputs[str(path.relative_to(self.staging))] = {"kind": kind, "sha256": sha256_file(path, remember=False)}
        return self.final / name

    def commit(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the manifest (the envelope filled here, ``body``: the stage's own sections) and swap
        the staging directory in; the manifest as written."""
        self._register_streams()
        shutil.rmtree(self.staging / ".scratch", ignore_errors=True)
        body = dict(body or {})
        twice = sorted({"stage", "step", "schema_version", "package_version", "created_at", "outputs",
                        *self.envelope} & body.keys())
        if twice:  # the writer fills the envelope: a stage that gives it too is a bug
            raise ValueError(f"{self.final}: {', '.join(twice)} of the manifest is filled by the stage writer, "
                             "not given to commit")
        manifest = self.manifest_class.model_validate({  # a stage that forgets its key fails here, before the swap
            "stage": self.stage,
            "schema_version": SCHEMA_VERSION,
            "package_version": __version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **body,
            **self.envelope,
            "outputs": self.outputs,
        }).as_dict()
        atomic_write_json(self.staging / MANIFEST, manifest)
        check_parent(f"committing {self.stage}")  # an orphaned worker: the lock was its parent's
        if self.final.exists() and _exchange(self.staging, self.final):
            shutil.rmtree(self.staging, ignore_errors=True)  # now holds the previous artifact
        else:
            old = None
            if self.final.exists():  # no atomic exchange here: a kill between the renames is undone by clean_leftovers
                old = self.run_dir / f".{self.stage}.old-{uuid.uuid4().hex[:8]}"
                os.replace(self.final, old)
            os.replace(self.staging, self.final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        self._committed = True
        return manifest


def _other_rank() -> int:
    """This process's rank when it is one of several of a multi-process job (the launcher's, or
    ``train.processes``', ``RANK`` / ``WORLD_SIZE``), else 0. Read here from the environment, so
    that writing an artifact imports no torch and depends on no training module."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


_LEFTOVER = re.compile(r"\.(?P<stage>[^/]+)\.(?P<kind>old|staging)-[0-9a-f]{8}")
_TMP = re.compile(r"\.[^/]+\.[a-z0-9_]{8}\.tmp")  # atomic_write_*: mkstemp(prefix=".<name>.", suffix=".tmp")


def clean_leftovers(run_dir: Path, stage: str | None = None) -> list[str]:
    """Undo what a killed writer left in ``run_dir`` (for ``stage``, or every stage): a commit cut
    between its two renames gets its previous artifact back (``.<stage>.old-*`` → ``<stage>``);
    staging directories, superseded artifacts and half-written temporary files are removed.
    Only entries named exactly as embedpipe's writers name them are touched (a superseded artifact
    only when it holds a manifest). Call it only while holding the run directory (its lock, or as
    the stage's one writer). Returns what it did, for the log."""
    run_dir = Path(run_dir)
    done: list[str] = []
    found = [(m, run_dir / m.string) for m in map(_LEFTOVER.fullmatch, _names(run_dir)) if m is not None
             and (stage is None or m["stage"] == stage) and (run_dir / m.string).is_dir()]
    olds = [(m, p) for m, p in found if m["kind"] == "old" and (p / MANIFEST).is_file()]
    for match, old in sorted(olds, key=lambda mp: mp[1].stat().st_mtime, reverse=True):
        final = run_dir / match["stage"]
        if not final.exists():
            os.replace(old, final)
            done.append(f"restored {final.name} from an interrupted commit")
        else:
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name}")
    for match, debris in found:
        if match["kind"] == "staging":
            shutil.rmtree(debris, ignore_errors=True)
            done.append(f"removed {debris.name}")
    if stage is None:
        for name in filter(_TMP.fullmatch, _names(run_dir)):
            if (run_dir / name).is_file() and not (run_dir / name).is_symlink():
                (run_dir / name).unlink(missing_ok=True)
                done.append(f"removed {name}")
    return done


def _names(directory: Path) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except FileNotFoundError:
        return []


def model_artifact_dir(model: str | Path, run_dir: str | Path) -> Path | None:
    """The stage directory a model path was committed in (``<stage>/model`` with a manifest beside
    it; named under ``run_dir`` when it is one of that run's stages), or None for any other model
    (a base model, a packaged one): a stage that reads a trained model checks that directory."""
    path = Path(model).expanduser()
    if not path.is_dir() or not (path.parent / MANIFEST).is_file():
        return None
    return Path(run_dir) / path.parent.name if path.parent.resolve().parent == Path(run_dir).resolve() else path.parent


def read_manifest(run_dir: Path, stage: str) -> dict[str, Any] | None:
    """The stage's manifest as a dict (validated against the envelope, ``Manifest``; stage sections
    as written), or None when there is none or it is not a manifest (a damaged one reads as
    missing). A reader of a step's sections reads them through the step's class instead
    (``embed_core.manifests``: ``PrepareManifest.read(run_dir, "prepare").counts``)."""
    manifest = _envelope(run_dir, stage)
    return manifest.as_dict() if manifest is not None else None


def _envelope(run_dir: Path, stage: str) -> Manifest | None:
    path = Path(run_dir) / stage / MANIFEST
    if not path.exists():
        return None
    try:
        return Manifest.model_validate_json(path.read_bytes())
    except ValidationError:
        return None


def output_hashes(run_dir: Path, stage: str, kind: str | None = None, prefix: str = "", *,
                  required: bool = True) -> dict[str, str]:
    """Output name -> sha256 of a committed stage (of one ``kind``, under ``prefix``): what a later
    stage's cache key holds of it. No manifest: an EmbedpipeError saying to run it (``required``),
    else {}."""
    manifest = _envelope(run_dir, stage)
    if manifest is None:
        if required:
            raise EmbedpipeError(f"{Path(run_dir) / stage}: no {MANIFEST} — run the {stage} stage first")
        return {}
    return manifest.hashes(kind, prefix)


def changed_output(run_dir: Path, stage: str, manifest: dict[str, Any] | None = None) -> str | None:
    """The first output of the stage (its name in the stage directory) that is missing, has become
    a symbolic link (a stage writes none) or whose bytes differ from its manifest; None when every
    one matches."""
    typed = Manifest.of(manifest) if manifest is not None else _envelope(run_dir, stage)
    for name, sha256 in (typed.hashes() if typed is not None else {}).items():
        path = Path(run_dir) / stage / name
        if path.is_symlink() or not path.is_file() or sha256_file(path) != sha256:
            return name
    return None


def intact_manifest(stage_dir: Path, *, holding: str | None = None) -> dict[str, Any]:
    """The manifest of the committed stage ``stage_dir`` when every output matches it (the judgement
    ``embedpipe status`` calls ``damaged``, ``changed_output``) and, if given, ``holding`` is one
    of its outputs; else an EmbedpipeError naming the file. For a reader that trusts what a stage
    file says (where other files are, which rows were used)."""
    stage_dir = Path(stage_dir)
    manifest = read_manifest(stage_dir.parent, stage_dir.name)
    if manifest is None:
        raise EmbedpipeError(f"{stage_dir / MANIFEST}: missing or not a stage manifest (the stage was not committed, "
                             "or the file is damaged): run the stage again with --force")
    if holding is not None and holding not in Manifest.of(manifest).outputs:
        raise EmbedpipeError(f"{stage_dir / holding}: not an output of {stage_dir / MANIFEST} (not written by the "
                             "stage): run the stage again with --force")
    changed = changed_output(stage_dir.parent, stage_dir.name, manifest)
    if changed is not None:
        raise EmbedpipeError(f"{stage_dir / changed}: missing or changed since its manifest was written (the stage is "
                             "damaged, as embedpipe status shows): run the stage again with --force")
    return manifest


def stage_is_intact(run_dir: Path, stage: str, input_fingerprint: str | None = None) -> bool:
    """True when the stage's manifest exists, every output matches its hash, and (if given) the
    manifest was produced from ``input_fingerprint``."""
    manifest = _envelope(run_dir, stage)
    if manifest is None:
        return False
    if input_fingerprint is not None and manifest.input_fingerprint != input_fingerprint:
        return False
    return changed_output(run_dir, stage, manifest.as_dict()) is None


def checked_outputs(run_dir: Path, stage: str, *, kind: str = "records") -> dict[str, tuple[Path, str]]:
    """The outputs of a finished stage of one ``kind``, by file name: (path, sha256), each file
    checked against the hash its manifest holds."""
    manifest = _envelope(run_dir, stage)
    if manifest is None:
        raise EmbedpipeError(f"{Path(run_dir) / stage}: no {MANIFEST} (stage not run, or interrupted)")
    out = {}
    for name, sha256 in manifest.hashes(kind).items():
        path = Path(run_dir) / stage / name
        if not path.exists() or sha256_file(path) != sha256:
            raise EmbedpipeError(f"{path}: missing or changed since its manifest was written")
        out[name] = (path, sha256)
    return out


@contextmanager
def parquet_output(path: Path) -> Iterator[None]:
    """Reading a stage's Parquet output whose hash its manifest vouched for: a file that is not
    readable Parquet all the same (damaged before the manifest was written, or the manifest edited
    to match a truncated file) is one line naming it and what to run, not pyarrow's traceback."""
    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        detail = printable(" ".join(str(exc).split()), 160)
        raise EmbedpipeError(f"{path}: not a readable Parquet file although its manifest's hash matches it ({detail}); "
                             f"rerun the stage that wrote {path.parent.name}/ with --force") from None


def read_parquet(path: Path, **kwargs: Any) -> pa.Table:
    """``pq.read_table`` of a stage output, under :func:`parquet_output`."""
    with parquet_output(path):
        return pq.read_table(path, **kwargs)


def read_records(run_dir: Path, stage: str, *, validate: bool = True, kind: str = "records") -> dict[str, pa.Table]:
    """Record tables of a finished stage, by file name, checked against the manifest and the schema
    (``kind="dev_records"``: the dev records prepare sets aside)."""
    tables = {}
    for name, (path, _) in checked_outputs(run_dir, stage, kind=kind).items():
        table = read_parquet(path, schema=None)
        if validate:
            check_table(table, file=str(path))
        tables[name] = table.cast(RECORD_SCHEMA) if table.schema != RECORD_SCHEMA else table
    return tables


def read_tables(run_dir: Path, stage: str, *, kind: str) -> dict[str, pa.Table]:
    """The Parquet outputs of one ``kind`` of a finished stage, by file name, checked against the
    manifest (the schema is the writing stage's: metrics, stats, results)."""
    return {name: read_parquet(path) for name, (path, _) in checked_outputs(run_dir, stage, kind=kind).items()}


def read_corpora(run_dir: Path, stage: str) -> dict[str, pa.Table]:
    """The corpus artifacts of a finished stage (prepare's ``corpus-<name>.parquet``), by corpus
    name, checked against the manifest and ``PASSAGE_SCHEMA``: passages are no records and never
    go through the record path."""
    out = {}
    for name, (path, _) in checked_outputs(Path(run_dir), stage, kind=CORPUS_KIND).items():
        table = read_parquet(path)
        if [(f.name, f.type) for f in table.schema] != [(f.name, f.type) for f in PASSAGE_SCHEMA]:
            raise EmbedpipeError(f"{path}: not a corpus of passages (columns {table.schema.names}, expected "
                                 f"{PASSAGE_SCHEMA.names}): run prepare again with --force")
        out[name.removeprefix("corpus-").removesuffix(".parquet")] = table
    return out


def read_model(run_dir: Path, stage: str) -> Path:
    """The model directory a finished stage committed (``<stage>/model``), every file of it
    checked against the manifest."""
    files = checked_outputs(Path(run_dir), stage, kind="model")
    if not files:
        raise EmbedpipeError(f"{Path(run_dir) / stage / MANIFEST}: lists no model (the stage saved none)")
    return Path(run_dir) / stage / "model"


@dataclass(frozen=True)
class ArtifactKind:
    """A kind of stage output another stage reads: its ``OutputInfo.kind``, its Arrow schema (None:
    not a table, or the writing stage's own), and the one reader that checks it."""

    kind: str
    schema: pa.Schema | None
    read: Callable[..., Any]
    holds: str


ARTIFACT_KINDS: dict[str, ArtifactKind] = {k.kind: k for k in (
    ArtifactKind("records", RECORD_SCHEMA, read_records, "training records (prepare, synthesize, mine, steps)"),
    ArtifactKind("dev_records", RECORD_SCHEMA, functools.partial(read_records, kind="dev_records"),
                 "prepare's dev records (dev/<dataset>.parquet), for model selection only"),
    ArtifactKind(CORPUS_KIND, PASSAGE_SCHEMA, read_corpora, "prepare's passages of a corpus source"),
    ArtifactKind("model", None, read_model, "a trained model directory (<stage>/model/)"),
    ArtifactKind("metrics", None, functools.partial(read_tables, kind="metrics"),
                 "per-step training metrics, dev scores, ablation scores (the writer's schema)"),
)}

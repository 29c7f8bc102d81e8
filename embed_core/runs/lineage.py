"""``embedpipe lineage MODEL --text TEXT | --id ID``: was this text trained on, by which model, from
which source row?

``MODEL`` is a trained stage's model (``<run_dir>/train-<stage>/model``, or the stage directory),
or the run's release (``<run_dir>/evaluate/model``: the train stage named in its ``embedpipe.json``).
The stage's ``lineage.parquet`` (``embed_core.train.engine.lineage``) names the upstream record files it
trained on; their records whose query, positives, negatives or weak positives equal the text after
the project's normalisation (``embed_core.prepare.cleaning.normalize_text``; or whose id is ``ID``)
are looked up in the lineage of the stage and of every stage it started from (``init_model``
within the run directory, e.g. stage2 from stage1's model). Per match: the dataset, record id,
field, the record's ``source_ref`` (source file and row), and per stage the steps that drew it.

What a step records is the *record* it drew: a drawn record trains its query with one of its
positives and up to ``num_hard_negatives`` of its negatives; which of a record's several
positives or negatives a step picked is not recorded. Steps after the weights a stage kept
(``dev.select: best``) are listed but do not count as trained on.

Exit status, as ``grep``: 0 when some model of the chain trained on a match, 1 when none did (the
text is in no record, or its records were never drawn), 2 on an error (not a trained model, no
lineage, records changed since training, a damaged file).

Nothing a stage file says is used unchecked: a stage's ``lineage.parquet`` is read only when the
stage is intact (every output matches its manifest, the check ``embedpipe status`` calls
``damaged``: ``artifacts.intact_manifest``), its metadata must be what training writes
(``train.lineage.read_metadata``: the record files it names are files of the run directory, never
a path out of it), and its columns must have their types; a released model's ``embedpipe.json``
must name its train stage. Each failure is one line naming the file (and field). A stage that
trained on a data-value gate's records (``value-<stage>``) says which units the gate dropped and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embed_core.artifacts import MANIFEST, intact_manifest, model_artifact_dir
from embed_core.datavalue.apply import gate_note
from embed_core.config_base import PATH_NAME
from embed_core.errors import EmbedpipeError, printable
from embed_core.fingerprint import sha256_file
from embed_core.paths import resolve_within
from embed_core.prepare.cleaning import normalize_text
from embed_core.stage_dirs import instance_name
from embed_core.train.engine.lineage import LINEAGE_FILE, LINEAGE_SCHEMA, read_metadata

TEXT_FIELDS = ("query", "positives", "negatives", "weak_positives")
MAX_SETTINGS_BYTES = 16 * 1024 * 1024  # a model's embedpipe.json (real ones: a few KB)


@dataclass
class TrainedStage:
    name: str  # train-<stage>
    directory: Path
    metadata: dict
    steps: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]  # dataset -> (row steps, offsets, flat positions)


@dataclass
class Match:
    dataset: str
    position: int
    record_id: str
    fields: list[str]
    source_ref: str
    steps: dict[str, list[int]] = field(default_factory=dict)  # stage name -> steps that drew it


def stage_of_model(model: str | Path) -> Path:
    """The ``train-<stage>`` directory that wrote ``model``; an EmbedpipeError naming it otherwise."""
    path = Path(model)
    stage = path if (path / MANIFEST).is_file() and (path / "model").is_dir() else path.parent
    if not (stage / MANIFEST).is_file() or not (stage / "model").is_dir():
        raise EmbedpipeError(f"{path}: not a trained model (no {MANIFEST} of a train stage beside or in it)")
    if (stage / LINEAGE_FILE).is_file():
        return stage
    trained = _release_stage(stage / "model")
    if trained is not None and (trained / LINEAGE_FILE).is_file():
        return trained
    raise EmbedpipeError(f"{stage}: no {LINEAGE_FILE} (not a train stage, an AutoRegEmbed stage, or trained before "
                         "lineage was recorded: retrain it with --force)")


def _release_stage(model: Path) -> Path | None:
    """The run's ``train-<stage>`` directory a released model (``evaluate/model``) was copied from;
    None for a model without ``embedpipe.json``, an EmbedpipeError naming it when it is damaged."""
    path = model / "embedpipe.json"
    if not path.exists() and not path.is_symlink():
        return None
    try:
        if path.stat().st_size > MAX_SETTINGS_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes")
        settings = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise EmbedpipeError(f"{path}: not readable as the model's settings JSON ({exc}): the model is damaged; "
                             "copy it again or run its stages again with --force") from None
    name = settings
    for key in ("training", "stage", "name"):
        name = name.get(key) if isinstance(name, dict) else None
    if not isinstance(name, str) or not PATH_NAME.fullmatch(name):
        raise EmbedpipeError(f"{path}: field training.stage.name is {printable(repr(name), 60)}, not a stage name: "
                             "the model is damaged; copy it again or run its stages again with --force")
    return model.parent.parent / instance_name(name)


def chain(stage_dir: Path) -> list[TrainedStage]:
    """``stage_dir`` and the train stages it started from, within its run directory, newest first."""
    out: list[TrainedStage] = []
    seen: set[Path] = set()
    current: Path | None = stage_dir
    while current is not None and current.resolve() not in seen and (current / LINEAGE_FILE).is_file():
        seen.add(current.resolve())
        manifest = intact_manifest(current, holding=LINEAGE_FILE)
        out.append(_read_stage(current))
        init = manifest.get("init_model")
        parent = model_artifact_dir(init, current.parent) if isinstance(init, str) and init else None
        current = parent if parent is not None and parent.parent.resolve() == current.parent.resolve() else None
    return out


def _read_stage(stage_dir: Path) -> TrainedStage:
    path = stage_dir / LINEAGE_FILE
    table = _read_parquet(path, "lineage file", LINEAGE_SCHEMA.names, LINEAGE_SCHEMA)
    metadata = read_metadata(table.schema, path)
    steps = {}
    datasets = table.column("dataset").to_pylist()
    step_col = table.column("step").to_numpy()
    positions = table.column("positions").combine_chunks()
    for name in metadata["datasets"]:
        rows = np.array([i for i, d in enumerate(datasets) if d == name], dtype=np.int64)
        lists = positions.take(rows) if len(rows) else positions.slice(0, 0)
        offsets = lists.offsets.to_numpy() - (lists.offsets[0].as_py() if len(lists) else 0)
        steps[name] = (step_col[rows], offsets, lists.flatten().to_numpy(zero_copy_only=False))
    return TrainedStage(stage_dir.name, stage_dir, metadata, steps)


def _read_parquet(path: Path, what: str, columns: list[str], types: pa.Schema | None = None) -> pa.Table:
    """``columns`` of the Parquet file ``path`` (with their types in ``types``, if given); one
    EmbedpipeError naming the file (and the column) when it is cut off, not Parquet or lacks one."""
    try:
        found = pq.read_schema(path)
        for name in columns:
            index = found.get_field_index(name)
            if index < 0:
                raise EmbedpipeError(f"{path}: no column {name!r}: not a {what}, or a damaged one")
            if types is not None and found.field(index).type != types.field(name).type:
                raise EmbedpipeError(f"{path}: column {name!r} is {found.field(index).type}, not "
                                     f"{types.field(name).type}: not a {what}, or a damaged one")
        return pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as exc:  # cut off, not Parquet, a directory
        raise EmbedpipeError(f"{path}: not readable as a {what} ({printable(exc, 200)}): the file is damaged") from None


def _records(stage: TrainedStage, dataset: str, cache: dict[Path, object]):
    """The upstream record file ``stage`` trained ``dataset`` on, inside the run directory and
    checked against the hash it had then."""
    info = stage.metadata["datasets"][dataset]
    path = resolve_within(stage.directory.parent, Path(stage.metadata["upstream"]) / info["file"])
    if path not in cache:
        if not path.is_file() or (info.get("sha256") and sha256_file(path) != info["sha256"]):
            raise EmbedpipeError(f"{path}: missing or changed since {stage.name} trained on it: the records it "
                                 "trained on are gone (retrain the stage to answer for the current records)")
        cache[path] = _read_parquet(path, "record file", ["id", "source_ref", *TEXT_FIELDS])
    return cache[path]


def find_matches(stages: list[TrainedStage], text: str | None, record_id: str | None) -> list[Match]:
    """Records of the chain's datasets whose text (normalised) or id matches, with the steps of each
    stage that drew them."""
    wanted = normalize_text(text) if text is not None else None
    cache: dict[Path, object] = {}
    rows: dict[Path, list[tuple[int, list[str]]]] = {}  # stages of a run share their record files
    found: dict[tuple[Path, int], Match] = {}
    for stage in stages:
        for dataset in stage.metadata["datasets"]:
            table = _records(stage, dataset, cache)
            key_path = stage.directory.parent / stage.metadata["upstream"] / stage.metadata["datasets"][dataset]["file"]
            if key_path not in rows:
                rows[key_path] = _matching_rows(table, wanted, record_id)
            for pos, fields in rows[key_path]:
                match = found.setdefault((key_path, pos), Match(
                    dataset, pos, table.column("id")[pos].as_py(), fields, table.column("source_ref")[pos].as_py()))
                match.steps[stage.name] = _steps_drawing(stage.steps[dataset], pos)
    return sorted(found.values(), key=lambda m: (m.dataset, m.position))


def _matching_rows(table, wanted: str | None, record_id: str | None) -> list[tuple[int, list[str]]]:
    """(row, fields that match) of the records whose id is ``record_id`` or whose texts normalise to ``wanted``."""
    if record_id is not None:
        return [(i, ["id"]) for i, v in enumerate(table.column("id").to_pylist()) if v == record_id]
    out = []
    columns = {name: table.column(name).to_pylist() for name in TEXT_FIELDS}
    for i in range(table.num_rows):
        fields = []
        for name in TEXT_FIELDS:
            value = columns[name][i]
            texts = [value] if isinstance(value, str) else list(value or [])
            fields += [name if isinstance(value, str) else f"{name}[{j}]"
                       for j, t in enumerate(texts) if t and normalize_text(t) == wanted]
        if fields:
            out.append((i, fields))
    return out


def _steps_drawing(lineage: tuple[np.ndarray, np.ndarray, np.ndarray], position: int) -> list[int]:
    steps, offsets, flat = lineage
    hits = np.flatnonzero(flat == position)
    rows = np.searchsorted(offsets, hits, side="right") - 1
    return sorted({int(steps[r]) for r in rows})


def answer(model: str | Path, *, text: str | None = None, record_id: str | None = None) -> tuple[str, int]:
    """The report for ``text`` (or ``record_id``) against ``model`` and its exit status (0 trained on,
    1 not)."""
    if (text is None) == (record_id is None):
        raise EmbedpipeError("lineage: give exactly one of --text and --id")
    if text is not None and not normalize_text(text):
        raise EmbedpipeError(f"lineage: --text {printable(text, 40)!r} has no words left after normalisation")
    stages = chain(stage_of_model(model))
    matches = find_matches(stages, text, record_id)
    what = f"text {printable(' '.join(text.split()), 70)!r}" if text is not None else f"id {printable(record_id, 70)!r}"
    models = ", ".join(f"{s.name} ({s.directory / 'model'})" for s in stages)
    lines, trained = _gate_lines(stages), False
    if not matches:
        return "\n".join([f"{what}: not trained on: in no record of {models}", *lines]), 1
    for m in matches:
        lines.append(f"{m.dataset} record {printable(m.record_id, 60)} as {', '.join(m.fields)}, "
                     f"source {printable(m.source_ref, 100)}")
        for stage in stages:
            if m.dataset not in stage.metadata["datasets"]:
                lines.append(f"  {stage.name}: not among its datasets")
                continue
            steps = m.steps.get(stage.name, [])
            kept = [s for s in steps if s <= stage.metadata["model_step"]]
            trained |= bool(kept)
            lines.append(f"  {stage.name}: " + _steps_line(steps, kept, stage.metadata))
    head = f"{what}: trained on" if trained else f"{what}: not trained on (in the records, never drawn)"
    return "\n".join([f"{head} ({len(matches)} matching record{'s' * (len(matches) != 1)}; models: {models})",
                      *lines]), 0 if trained else 1


def _gate_lines(stages: list[TrainedStage]) -> list[str]:
    """A line per stage that trained on a data-value gate's records: the units it dropped and why."""
    notes = [(s, gate_note(s.directory.parent, s.metadata["upstream"])) for s in stages]
    return [f"{s.name} trained on {g['step']}'s records: {g['summary']}" for s, g in notes if g is not None]


def _steps_line(steps: list[int], kept: list[int], metadata: dict) -> str:
    if not steps:
        return f"not drawn in its {metadata['steps']} steps"
    shown = ", ".join(map(str, steps[:20])) + (f" and {len(steps) - 20} more" if len(steps) > 20 else "")
    line = f"trained on at step{'s' * (len(steps) != 1)} {shown} of {metadata['steps']}"
    if len(kept) < len(steps):
        line += f" (its kept weights are step {metadata['model_step']}'s: {len(steps) - len(kept)} after them do not count)"
    return line

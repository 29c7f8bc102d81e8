"""The units of a data-value gate and the records without them.

A unit is a data source (``dataset:NAME``: one record file of the records a training stage reads)
or a synthetic strategy (``origin:ORIGIN``: the records of one origin across the datasets:
paraphrase, augmentation, synthetic = corpus queries). ``origin:llm_negative`` is special: the
synthesize stage wrote the LLM's negative first into its source record's negatives (and the mine
stage appends after it), so the records without that unit are those records with their first
negative taken out and their origin ``original`` again; every other unit's records are removed."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from embed_core.artifacts import checked_outputs, read_parquet
from embed_core.datavalue.config import SOURCE, SYNTHETIC, SYNTHETIC_ORIGINS, DataValueConfig
from embed_core.errors import ConfigError
from embed_core.schema import RECORD_SCHEMA
from embed_core.train.config import TrainStageConfig
from embed_core.train.key import _used_outputs

LLM_NEGATIVE = "llm_negative"


def unit_slug(unit: str) -> str:
    """A unit as a path component: ``dataset:x`` -> ``dataset=x``."""
    return unit.replace(":", "=")


def used_files(run_dir: Path, upstream: str, stage: TrainStageConfig) -> dict[str, tuple[Path, str]]:
    """The record files of ``upstream`` the stage trains on (its datasets and tasks): (path, sha256)."""
    outputs = checked_outputs(run_dir, upstream, kind="records")
    used = _used_outputs(run_dir / upstream, {n: sha for n, (_, sha) in outputs.items()}, stage)
    return {name: outputs[name] for name in sorted(used)}


def _origins(path: Path) -> set[str]:
    return set(pc.unique(read_parquet(path, columns=["origin"]).column("origin")).to_pylist())


def discover(files: dict[str, tuple[Path, str]], cfg: DataValueConfig) -> list[str]:
    """The units to measure: ``cfg.units`` (each checked to be in the records), else every dataset
    and every synthetic origin the stage's records have; datasets first, in name order."""
    datasets = [f"{SOURCE}:{name.removesuffix('.parquet')}" for name in files]
    present = set().union(*(_origins(path) for path, _ in files.values())) if files else set()
    origins = [f"{SYNTHETIC}:{o}" for o in SYNTHETIC_ORIGINS if o in present]
    found = datasets + origins
    if cfg.units is None:
        return found
    missing = [u for u in cfg.units if u not in found]
    if missing:
        raise ConfigError(f"data_value.units: {', '.join(missing)} not in the stage's records (units there: "
                          f"{', '.join(found) or 'none'})")
    return list(cfg.units)


def whole(files: dict[str, tuple[Path, str]], units: list[str]) -> frozenset[str]:
    """The units without which the stage has no record left (e.g. ``origin:synthetic`` in a corpus
    recipe): a weight on such a unit scales the stage's whole loss and changes nothing else. Decided
    by ``without`` on the files' origin columns; ``origin:llm_negative`` never is (its records stay,
    without their LLM negative)."""
    origins = {name: read_parquet(path, columns=["origin"]) for name, (path, _) in files.items()}

    def left(unit: str) -> int:
        return sum(0 if (out := without(name, table, frozenset([unit]))) is None else out.num_rows
                   for name, table in origins.items())

    return frozenset(u for u in units if files and u != f"{SYNTHETIC}:{LLM_NEGATIVE}" and left(u) == 0)


def without(name: str, table: pa.Table, removed: frozenset[str]) -> pa.Table | None:
    """Record file ``name``'s records without the units ``removed`` (None: the whole file goes);
    the same table object when nothing in it is removed."""
    if f"{SOURCE}:{name.removesuffix('.parquet')}" in removed:
        return None
    origins = {u.partition(":")[2] for u in removed if u.startswith(SYNTHETIC + ":")}
    if not origins:
        return table
    origin = table.column("origin")
    dropped = pa.array(sorted(origins - {LLM_NEGATIVE}), pa.string())
    keep = pc.invert(pc.is_in(origin, value_set=dropped))
    stripped = LLM_NEGATIVE in origins and pc.any(pc.equal(origin, LLM_NEGATIVE)).as_py()
    if pc.all(keep).as_py() and not stripped:
        return table
    out = table.filter(keep)
    if stripped:
        rows = [_strip_llm_negative(r) if r["origin"] == LLM_NEGATIVE else r for r in out.to_pylist()]
        out = pa.Table.from_pylist(rows, schema=RECORD_SCHEMA)
    return out


def _strip_llm_negative(record: dict) -> dict:
    """The source record before the LLM's negative was put first into its negatives."""
    return {**record, "negatives": record["negatives"][1:], "negative_scores": record["negative_scores"][1:],
            "negative_labels": record["negative_labels"][1:], "origin": "original"}


def applied_weights(decisions: list[dict]) -> dict[str, dict[str, float]]:
    """The multipliers of the dataset and origin weights the decisions give (dropped: 0)."""
    out: dict[str, dict[str, float]] = {"dataset": {}, "origin": {}}
    for d in decisions:
        if d["action"] != "keep":
            kind, _, name = d["unit"].partition(":")
            out[kind][name] = 0.0 if d["action"] == "drop" else float(d["weight"])
    return out

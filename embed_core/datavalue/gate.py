"""The data-value step's body (declared in ``embed_core.train.stage`` as the step ``value-<stage>``):
measure each unit with the proxies (``proxy``), decide (``rule``), and commit the decision with the
records the stage trains on.

``<run_dir>/value-<stage>/`` holds ``decision.parquet`` (per unit: its mode, per-seed deltas, mean
delta ± spread, the reference's noise, the decision, its weight and the reason), ``proxies.parquet``
(per proxy run: variant, seed, dev score ×100, cached, seconds), ``report.md``, and the stage's
record files with the dropped units taken out (a file nothing is taken from is the same bytes). The
training stage reads those records, and its dataset and origin weights are multiplied by the
down-weighted units' weights (``embed_core.datavalue.apply``)."""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from embed_core.artifacts import StageWriter, read_parquet
from embed_core.config import RunConfig
from embed_core.datavalue.proxy import (REFERENCE, check_budget, cost_line, plan_proxy, proxy_root, run_proxy,
                                        seconds_per_step, seeds, unit_pairs, variants, write_variant_records)
from embed_core.datavalue.rule import UnitDecision, decide
from embed_core.datavalue.units import applied_weights, discover, used_files, whole, without
from embed_core.errors import ConfigError
from embed_core.fingerprint import Fingerprint
from embed_core.manifests import DataValueManifest
from embed_core.train.key import LIBRARIES, step_fingerprint
from embed_core.train.resolved import resolve_step

log = logging.getLogger("embedpipe.datavalue")
DECISION_SCHEMA = pa.schema([
    ("unit", pa.string()), ("mode", pa.string()), ("deltas", pa.list_(pa.float64())), ("delta", pa.float64()),
    ("spread", pa.float64()), ("noise", pa.float64()), ("seeds", pa.int64()), ("action", pa.string()),
    ("weight", pa.float64()), ("reason", pa.string())])
PROXY_SCHEMA = pa.schema([("variant", pa.string()), ("seed", pa.int64()), ("score", pa.float64()),
                          ("cached", pa.bool_()), ("seconds", pa.float64()), ("steps", pa.int64())])


def gate_fingerprint(config: RunConfig, run_dir: str | Path, stage_name: str, instance: str, *,
                     upstream: str) -> Fingerprint:
    """The gate's key: the stage's own training key on the records it reads (records, start model,
    dev tasks, the stage's settings with its data_value section, seed) and the gate's code."""
    train = step_fingerprint(resolve_step(config, run_dir, stage_name, upstream=upstream))
    return Fingerprint.of(instance, __name__, LIBRARIES, {"stage": train.key})


def run_gate(config: RunConfig, run_dir: str | Path, stage_name: str, instance: str, fingerprint: Fingerprint, *,
             upstream: str) -> dict[str, Any]:
    """Measure, decide and commit ``<run_dir>/<instance>/``; the manifest."""
    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    step = resolve_step(config, run_dir, stage_name, upstream=upstream)
    cfg = step.stage.data_value
    files = used_files(run_dir, upstream, step.stage)
    units = discover(files, cfg)
    if not units:
        raise ConfigError(f"train.stages[{stage_name}].data_value: the stage's records have no unit to measure")
    planned = variants(units, cfg)
    check_budget(stage_name, len(planned) * cfg.seeds, cfg)
    root = proxy_root(run_dir, stage_name)
    for v in planned:
        write_variant_records(run_dir, upstream, files, v, root / v.name, config.run_name)
    proxies = [plan_proxy(config, root / v.name, v.name, seed, stage_name, step.init_model, v.removed)
               for v in planned for seed in seeds(cfg)]
    log.info("%s", cost_line(stage_name, proxies, len(units), cfg, seconds_per_step(root)))
    rows = [run_proxy(p) for p in proxies]
    score = {(r["variant"], r["seed"]): r["score"] for r in rows}
    reference = [score[(REFERENCE, s)] for s in seeds(cfg)]
    deltas = {u: [score[(with_, s)] - score[(without_, s)] for s in seeds(cfg)]
              for u, (with_, without_) in unit_pairs(units, cfg).items()}
    decisions = decide(deltas, statistics.stdev(reference), down_weight=cfg.down_weight, z=cfg.z,
                       whole=whole(files, units))
    return _commit(config, run_dir, stage_name, instance, fingerprint, upstream, files, cfg, decisions, deltas,
                   rows, reference, t0)


def _decision_rows(cfg, decisions: list[UnitDecision], deltas: dict[str, list[float]]) -> list[dict[str, Any]]:
    return [{"unit": d.unit, "mode": cfg.mode_of(d.unit), "deltas": deltas[d.unit], "delta": d.delta,
             "spread": d.spread, "noise": d.noise, "seeds": d.seeds, "action": d.action, "weight": d.weight,
             "reason": d.reason} for d in decisions]


def _commit(config: RunConfig, run_dir: Path, stage_name: str, instance: str, fingerprint: Fingerprint,
            upstream: str, files: dict, cfg, decisions: list[UnitDecision], deltas: dict[str, list[float]],
            rows: list[dict[str, Any]], reference: list[float], t0: float) -> dict[str, Any]:
    table = _decision_rows(cfg, decisions, deltas)
    dropped = frozenset(d.unit for d in decisions if d.action == "drop")
    with StageWriter(run_dir, instance, DataValueManifest, fingerprint=fingerprint,
                     run_name=config.run_name) as writer:
        records = {}
        for name, (path, _) in files.items():
            data = read_parquet(path)
            out = without(name, data, dropped)
            if out is data:
                writer.write_file(name, path.read_bytes(), kind="records")
            elif out is not None and out.num_rows:
                writer.write_table(name, out, kind="records")
            records[name] = {"before": data.num_rows, "after": 0 if out is None else out.num_rows}
        writer.write_table("decision.parquet", pa.Table.from_pylist(table, schema=DECISION_SCHEMA), kind="metrics")
        writer.write_table("proxies.parquet", pa.Table.from_pylist(rows, schema=PROXY_SCHEMA), kind="metrics")
        writer.write_file("report.md", report_markdown(stage_name, cfg, table, reference, rows).encode(),
                          kind="report")
        return writer.commit({
            "stage_name": stage_name, "upstream": upstream,
            "units": {r["unit"]: {k: r[k] for k in ("mode", "action", "weight", "delta", "spread", "reason")}
                      for r in table},
            "weights": applied_weights(table),
            "noise": statistics.stdev(reference), "reference_score": statistics.fmean(reference),
            "counts": {"units": len(table), "proxy_runs": len(rows), "trained": sum(not r["cached"] for r in rows),
                       "cached": sum(r["cached"] for r in rows), "steps": cfg.steps, "seeds": cfg.seeds,
                       "records": records},
            "timings_s": {"total": round(time.perf_counter() - t0, 3),
                          "proxies_trained": round(sum(r["seconds"] for r in rows if not r["cached"]), 3)}})


def report_markdown(stage: str, cfg, table: list[dict[str, Any]], reference: list[float],
                    rows: list[dict[str, Any]]) -> str:
    trained = [r for r in rows if not r["cached"]]
    lines = [f"# Data value of stage {stage}'s units", "",
             f"{len(rows)} proxy runs of {cfg.steps} steps ({cfg.seeds} seeds; {len(trained)} trained now, "
             f"{len(rows) - len(trained)} cached; {sum(r['seconds'] for r in trained) / 60:.1f} min trained now). "
             f"Reference dev score ×100: {statistics.fmean(reference):.2f} ± {statistics.stdev(reference):.2f} "
             "(the noise: its sample standard deviation over the seeds).", "",
             "Delta: the dev score ×100 with the unit minus without it (leave_one_out: the reference minus the "
             "reference without the unit; add_one_in: the base, every add_one_in unit left out, with the unit minus "
             "the base), mean ± sample standard deviation over the seeds.", "",
             "| unit | mode | delta | per seed | decision | weight | reason |", "|---|---|---:|---|---|---:|---|"]
    for r in table:
        per_seed = ", ".join(f"{x:+.2f}" for x in r["deltas"])
        lines.append(f"| {r['unit']} | {r['mode']} | {r['delta']:+.2f} ± {r['spread']:.2f} | {per_seed} | "
                     f"{r['action']} | {r['weight']:g} | {r['reason']} |")
    return "\n".join(lines) + "\n"

"""The gate's proxy runs: short trainings of a stage's own recipe on its records with some units
left out, each with every seed, scored on the stage's dev tasks.

A variant (``reference``: every unit; ``base``: without every unit measured add-one-in;
``minus-<unit>`` / ``plus-<unit>``) is its own run directory under
``<run_dir>/proxies/<stage>/<variant>/``, as an ablation's rows are (``embed_core.runs.ablation``,
whose ``set_path`` changes the settings): ``prepare/`` holds its records (and a copy of the dev
records the dev tasks read), ``train-<stage>-s<seed>/`` each seed's proxy. Both are committed
stage directories with the ordinary cache keys, so an unchanged unit and seed is never trained
twice, and a gate interrupted part-way resumes from what it committed (an interrupted proxy from
its checkpoint)."""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embed_core.artifacts import StageWriter, checked_outputs, read_parquet, stage_is_intact
from embed_core.config import RunConfig, parse_config
from embed_core.datavalue.apply import emptied_by_gate
from embed_core.datavalue.config import SOURCE, DataValueConfig
from embed_core.datavalue.units import unit_slug, without
from embed_core.errors import ConfigError
from embed_core.fingerprint import Fingerprint
from embed_core.manifests import Manifest, TrainManifest
from embed_core.runs.ablation import set_path
from embed_core.stage_dirs import PREPARE, PROXIES, instance_name
from embed_core.train.key import LIBRARIES, step_fingerprint
from embed_core.train.resolved import resolve_step

log = logging.getLogger("embedpipe.datavalue")
REFERENCE, BASE = "reference", "base"


@dataclass(frozen=True)
class Variant:
    """The records of one proxy variant: the stage's records without ``removed``."""

    name: str
    removed: frozenset[str]


def variants(units: list[str], cfg: DataValueConfig) -> list[Variant]:
    """The reference, the base (when a unit is measured add-one-in) and one variant per unit; a
    variant with the reference's records is the reference (the one add-one-in unit's ``plus``)."""
    added = frozenset(u for u in units if cfg.mode_of(u) == "add_one_in")
    out = [Variant(REFERENCE, frozenset())] + ([Variant(BASE, added)] if added else [])
    for unit in units:
        if unit in added:
            if added - {unit}:
                out.append(Variant(f"plus-{unit_slug(unit)}", added - {unit}))
        else:
            out.append(Variant(f"minus-{unit_slug(unit)}", frozenset({unit})))
    return out


def unit_pairs(units: list[str], cfg: DataValueConfig) -> dict[str, tuple[str, str]]:
    """unit -> (the variant with it, the variant without it): its delta is their difference."""
    added = {u for u in units if cfg.mode_of(u) == "add_one_in"}
    return {u: ((f"plus-{unit_slug(u)}" if added - {u} else REFERENCE), BASE) if u in added
            else (REFERENCE, f"minus-{unit_slug(u)}") for u in units}


def proxy_root(run_dir: Path, stage: str) -> Path:
    return Path(run_dir) / PROXIES / stage


def proxy_stage(stage: str, seed: int) -> str:
    return f"{stage}-s{seed}"


def seeds(cfg: DataValueConfig) -> list[int]:
    return list(range(1, cfg.seeds + 1))


def proxy_config(config: RunConfig, stage_name: str, start_model: str, variant: str, seed: int,
                 removed: frozenset[str] = frozenset()) -> RunConfig:
    """The run config of one proxy: the stage alone, named ``<stage>-s<seed>``, from the model the
    stage starts from, at the gate's budget (warm-up scaled with it), scored on its dev tasks once,
    at its last step, in one process; no re-mining, synthesis, merge, gate or tracking. A dataset in
    ``removed`` (the variant's units left out) loses its ``dataset_weight`` entry: its records are gone."""
    stage = next(s for s in config.train.stages if s.name == stage_name)
    cfg = stage.data_value
    raw = config.model_dump(mode="json", exclude={"ablation", "sweep", "tracking"})
    name = proxy_stage(stage_name, seed)
    gone = {u.partition(":")[2] for u in removed if u.startswith(SOURCE + ":")}
    weights = {k: w for k, w in stage.dataset_weight.items() if k not in gone}
    for path, value in {"steps": cfg.steps, "warmup_steps": round(stage.warmup_steps * cfg.steps / stage.steps),
                        "dataset_weight": weights,
                        "init_from": "base", "remine": None, "targeted_synthesis": None, "merge": None,
                        "data_value": None, "dev.eval_every": cfg.steps, "dev.select": "last",
                        "name": name}.items():  # the name last: the paths find the stage by its name
        set_path(raw, f"train.stages[{stage_name}].{path}", value)
    raw["train"]["stages"] = [s for s in raw["train"]["stages"] if s["name"] == name]
    raw["train"].update(base_model=start_model, processes=1, work_pool=None)
    raw.update(seed=seed, run_name=f"{config.run_name}-value-{stage_name}-{variant}")
    return parse_config(raw, origin=f"data-value proxy {variant} seed {seed}")


def write_variant_records(run_dir: Path, upstream: str, files: dict[str, tuple[Path, str]], variant: Variant,
                          directory: Path, run_name: str) -> None:
    """``<directory>/prepare/``: the variant's records and the dev records the dev tasks read (a
    cache hit when the upstream files and the removed units are unchanged)."""
    dev = _dev_files(run_dir)
    key = Fingerprint.of(PREPARE, __name__, LIBRARIES, {
        "records": {n: sha for n, (_, sha) in files.items()}, "dev": {n: sha for n, (_, sha) in dev.items()},
        "removed": sorted(variant.removed)})
    if stage_is_intact(directory, PREPARE, key.key):
        return
    with StageWriter(directory, PREPARE, Manifest, fingerprint=key, run_name=run_name) as writer:
        counts = {}
        for name, (path, _) in files.items():
            table = read_parquet(path)
            out = without(name, table, variant.removed)
            if out is table:
                writer.write_file(name, path.read_bytes(), kind="records")  # the same bytes, the same hash
            elif out is not None and out.num_rows:
                writer.write_table(name, out, kind="records")
            counts[name] = 0 if out is None else out.num_rows
        for name, (path, _) in dev.items():
            writer.write_file(name, path.read_bytes(), kind="dev_records")
        writer.commit({"counts": {"records": counts, "removed": sorted(variant.removed)}})


def _dev_files(run_dir: Path) -> dict[str, tuple[Path, str]]:
    if not (run_dir / PREPARE).is_dir():
        return {}
    return checked_outputs(run_dir, PREPARE, kind="dev_records")


@dataclass(frozen=True)
class Proxy:
    variant: str
    seed: int
    directory: Path  # its run directory
    config: RunConfig
    fingerprint: Fingerprint

    @property
    def stage(self) -> str:
        return self.config.train.stages[0].name

    @property
    def cached(self) -> bool:
        return stage_is_intact(self.directory, instance_name(self.stage), self.fingerprint.key)


def plan_proxy(config: RunConfig, directory: Path, variant: str, seed: int, stage_name: str,
               start_model: str, removed: frozenset[str] = frozenset()) -> Proxy:
    cfg = proxy_config(config, stage_name, start_model, variant, seed, removed)
    name = cfg.train.stages[0].name
    return Proxy(variant, seed, directory, cfg, step_fingerprint(resolve_step(cfg, directory, name, upstream=PREPARE)))


def run_proxy(proxy: Proxy) -> dict[str, Any]:
    """Train one proxy unless it is cached (resuming its checkpoint when interrupted); its row."""
    from embed_core.train.run import run_train_stage

    cached = proxy.cached
    if not cached:
        empty = emptied_by_gate(proxy.directory, PREPARE)
        log.info("data value: proxy %s, seed %d: %s", proxy.variant, proxy.seed,
                 "training" if empty is None else "no record: scoring the start model untrained")
        run_train_stage(proxy.config, proxy.directory, proxy.stage, upstream=PREPARE, resume=True,
                        fingerprint=proxy.fingerprint)
    trained = TrainManifest.read(proxy.directory, instance_name(proxy.stage))
    score = trained.counts.selected_dev_score
    if score is None:
        raise ConfigError(f"{proxy.directory / instance_name(proxy.stage)}: the proxy has no dev score")
    return {"variant": proxy.variant, "seed": proxy.seed, "score": 100 * float(score), "cached": cached,
            "seconds": float(trained.timings_s.get("total", 0.0)), "steps": trained.steps}


def seconds_per_step(root: Path) -> float | None:
    """The mean seconds per step of the proxies committed under ``root`` that trained (an untrained
    scoring of the start model has no step to time); None: none yet."""
    rates = []
    for path in sorted(root.glob(f"*/{instance_name('*')}/manifest.json")):
        try:
            m = json.loads(path.read_bytes())
            if int(m["steps"]) > 0:
                rates.append(float(m["timings_s"]["total"]) / int(m["steps"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return statistics.fmean(rates) if rates else None


def cost_line(stage: str, proxies: list[Proxy], units: int, cfg: DataValueConfig, rate: float | None) -> str:
    """What the gate will cost, said before it starts."""
    todo = [p for p in proxies if not p.cached]
    # a variant without records scores the start model untrained (0 steps); one read per variant, not per seed
    trains = {d: emptied_by_gate(d, PREPARE) is None for d in {p.directory for p in proxies}}
    n_variants, trained = len(proxies) // cfg.seeds, sum(trains[p.directory] for p in proxies)
    untrained = len(proxies) - trained
    runs = (f" × {cfg.steps} steps" if not untrained else
            f": {trained} of {cfg.steps} steps and {untrained} untrained scorings of the start model (no record)")
    line = (f"data value gate before stage {stage}: {len(proxies)} proxy runs ({n_variants} variants for {units} "
            f"unit{'' if units == 1 else 's'} × {cfg.seeds} seeds){runs} = {trained * cfg.steps} steps; "
            f"{len(proxies) - len(todo)} cached, {len(todo)} to train")
    if not todo:
        return line + " (nothing to train)"
    if rate is None:
        return line + " (no earlier proxy timing to estimate minutes from)"
    steps = cfg.steps * sum(trains[p.directory] for p in todo)
    return line + f", about {steps * rate / 60:.1f} min ({rate:.2f} s per step measured before)"


def check_budget(stage: str, proxies: int, cfg: DataValueConfig) -> None:
    if proxies > cfg.max_proxy_runs:
        raise ConfigError(f"train.stages[{stage}].data_value: the gate needs {proxies} proxy runs, more than "
                          f"max_proxy_runs {cfg.max_proxy_runs}: raise it, lower seeds, or list fewer units")


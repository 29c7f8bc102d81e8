"""The stage registry: which stages exist and in which order, and the context each one runs in.

Everything that walks the pipeline reads this order — ``embedpipe status``, the pipeline flow,
the CLI's commands, the data watch and the artifact table. A stage is a package whose
``stage.py`` declares ``STAGE`` (``embed_core.stage_api``); adding one is that package plus one
line in ``ORDER``. Modules are imported on first use, so the CLI's ``--help`` stays light.

A stage with several instances (train: one per configured training stage) lists them through its
``instances``; every instance has its own directory ``<run_dir>/<instance>/`` and fingerprint.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embed_core.config import RunConfig
from embed_core.errors import EmbedpipeError
from embed_core.fingerprint import Fingerprint
from embed_core.manifests import Manifest
from embed_core.stage_api import Stage, StageContext
from embed_core.dist import ranks

# The pipeline's order: the module that declares each stage's STAGE.
ORDER: list[str] = [
    "embed_core.prepare.stage",
    "embed_core.synthesize.stage",
    "embed_core.mine.stage",
    "embed_core.train.stage",
    "embed_core.evaluate.stage",
    "embed_core.release.stage",
]


def all_stages() -> list[Stage]:
    """Every registered stage, in pipeline order."""
    stages = [importlib.import_module(module).STAGE for module in ORDER]
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"two stages share a name: {names}")
    return stages


def get(name: str) -> Stage:
    for s in all_stages():
        if s.name == name:
            return s
    raise EmbedpipeError(f"no stage {name!r} (stages: {', '.join(s.name for s in all_stages())})")


def enabled_stages(config: RunConfig) -> list[Stage]:
    return [s for s in all_stages() if s.enabled(config)]


def pipeline_instances(config: RunConfig) -> list[tuple[Stage, str]]:
    """(stage, instance directory name) for everything the pipeline runs, in order."""
    return [(s, inst) for s in enabled_stages(config) for inst in s.instance_names(config, s.options_for_pipeline(config))]


def downstream_of(config: RunConfig, instance: str) -> list[str]:
    """Instances after ``instance`` in pipeline order (each reads, directly or not, its outputs)."""
    names = [inst for _, inst in pipeline_instances(config)]
    if instance not in names:
        raise EmbedpipeError(f"no stage {instance!r} in this config (stages: {', '.join(names)})")
    return names[names.index(instance) + 1:]


def records_upstreams(config: RunConfig, stage: str) -> list[str]:
    """The enabled stages before ``stage`` that produce records, in order (prepare, synthesize,
    mine: the last is the one ``stage`` reads)."""
    found: list[str] = []
    for s in enabled_stages(config):
        if s.name == stage:
            break
        if s.produces_records:
            found.append(s.name)
    return found


def records_upstream(config: RunConfig, stage: str) -> str | None:
    """The stage directory whose records ``stage`` reads: the nearest enabled earlier stage that
    produces records (mine reads synthesize when the config has it, else prepare); None for a
    stage with no such stage before it."""
    found = records_upstreams(config, stage)
    return found[-1] if found else None


def context(config: RunConfig, run_dir: str | Path, stage: Stage | str, instance: str | None = None,
            options: Any = None) -> StageContext:
    """The context ``stage`` runs in: ``instance`` defaults to the stage's only (or first) one,
    ``options`` to its defaults."""
    stage = get(stage) if isinstance(stage, str) else stage
    options = options if options is not None else stage.options()
    instance = instance or stage.instance_names(config, options)[0]
    upstreams = records_upstreams(config, stage.name)
    return StageContext(config=config, run_dir=Path(run_dir), instance=instance, options=options,
                        upstream=upstreams[-1] if upstreams else None, upstreams=tuple(upstreams))


def cache_decision(stage: Stage, ctx: StageContext, force: bool = False) -> tuple[Fingerprint, bool]:
    """The instance's fingerprint, and whether it is a cache hit: the run directory holds an intact
    artifact of exactly those inputs (never under ``force``). The one cache: this decides — after
    ``check_inputs``, so neither a run nor a hit stands on damaged or stale inputs. In a
    multi-process train command rank 0 decides for every rank (``embed_core.dist.ranks``): a rank
    that looked for itself could find a step rank 0 has just committed and skip the step's barrier."""
    from embed_core.artifacts import stage_is_intact

    check_inputs(stage, ctx)
    fingerprint = stage.fingerprint(ctx)
    hit = not force and stage_is_intact(ctx.run_dir, ctx.instance, fingerprint.key)
    return fingerprint, ranks.main_decides(hit, timeout_s=ctx.config.train.dist_timeout_s if ctx.config.train else None)


@dataclass(frozen=True)
class InstanceState:
    """Where one stage instance of a run directory stands for a config (``embedpipe status``)."""

    state: str                 # missing, damaged, stale or fresh
    current: str | None        # the input fingerprint it would have now (None: cannot compute)
    recorded: str | None       # the one in its manifest
    detail: str = ""
    changed: str | None = None  # damaged: the first output that is missing or differs


def instance_state(config: RunConfig, run_dir: Path, stage: Stage, instance: str) -> InstanceState:
    """The one judgement of an instance's artifact: ``missing`` (no manifest), ``damaged`` (an
    output missing or changed since the manifest), ``stale`` (intact, from other inputs than this
    config's) or ``fresh``. ``embedpipe status`` shows it; ``check_inputs`` refuses on it."""
    from embed_core.artifacts import changed_output, read_manifest

    manifest = read_manifest(run_dir, instance)
    recorded = Manifest.of(manifest).input_fingerprint if manifest else None
    try:
        current, detail = stage.fingerprint(context(config, run_dir, stage, instance,
                                                    stage.options_for_pipeline(config))).key, ""
    except EmbedpipeError as exc:
        current, detail = None, str(exc)
    if manifest is None:
        return InstanceState("missing", current, recorded, detail)
    changed = changed_output(run_dir, instance, manifest)
    if changed is not None:
        return InstanceState("damaged", current, recorded, f"{instance}/{changed} is missing or changed since its "
                             "manifest was written", changed)
    if current is None or current != recorded:
        return InstanceState("stale", current, recorded,
                             detail or "inputs changed since it ran (config, data or upstream outputs)")
    return InstanceState("fresh", current, recorded)


def _closure(stage: Stage, ctx: StageContext, known: dict[str, Stage]) -> list[Path]:
    """The stage directories ``ctx.instance`` reads, directly or through the stages it reads."""
    seen: list[Path] = []
    todo = list(stage.input_dirs(ctx))
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.append(path)
        if path.parent == ctx.run_dir and path.name in known:
            up = known[path.name]
            todo += up.input_dirs(context(ctx.config, ctx.run_dir, up, path.name, up.options_for_pipeline(ctx.config)))
    return seen


def check_inputs(stage: Stage, ctx: StageContext) -> None:
    """Refuse, with one line saying what to run, when a stage directory ``ctx.instance`` reads
    (directly or not) is missing, damaged (an output differs from its manifest: e.g. weights swapped
    into a trained model) or stale for this config (it would recompute: a single-stage run would
    otherwise read the old data and record the new config). Stages are judged in pipeline order,
    so the line names the first one to run; a directory outside this config's pipeline (another
    run's model, a sweep variant) is checked against its manifest only."""
    from embed_core.artifacts import MANIFEST, changed_output, read_manifest

    known = {inst: s for s, inst in pipeline_instances(ctx.config)}
    order = list(known)
    deps = sorted(_closure(stage, ctx, known),
                  key=lambda p: order.index(p.name) if p.parent == ctx.run_dir and p.name in known else len(order))
    again = f"--run-dir {ctx.run_dir}` (with the same --config)"
    for path in deps:
        if path == ctx.stage_dir:  # e.g. evaluate scoring its own release again
            continue
        if path.parent == ctx.run_dir and path.name in known:
            up = known[path.name]
            st = instance_state(ctx.config, ctx.run_dir, up, path.name)
            if st.state == "missing":
                raise EmbedpipeError(f"{ctx.instance} reads {path}, which has no {MANIFEST} (not run yet, or "
                                     f"interrupted): run `{up.command(path.name)} {again} first")
            if st.state == "damaged":
                raise EmbedpipeError(f"{ctx.instance}: {path / st.changed} is missing or changed since {path / MANIFEST} "
                                     f"was written; rerun that stage: `{up.command(path.name)} --force {again}")
            if st.state == "stale":
                raise EmbedpipeError(f"{ctx.instance}: upstream stage {path.name} in {ctx.run_dir} is stale for this "
                                     f"config: {st.detail}; run `{up.command(path.name)} {again} first, or "
                                     "`embedpipe run` to recompute every out-of-date stage in order")
        elif (manifest := read_manifest(path.parent, path.name)) is not None:
            changed = changed_output(path.parent, path.name, manifest)
            if changed is not None:
                raise EmbedpipeError(f"{ctx.instance}: {path / changed} is missing or changed since {path / MANIFEST} "
                                     "was written; rerun the stage that wrote it (with --force)")

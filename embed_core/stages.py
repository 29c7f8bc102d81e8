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
from pathlib import Path
from typing import Any

from embed_core.config import RunConfig
from embed_core.errors import EmbedpipeError
from embed_core.fingerprint import Fingerprint
from embed_core.stage_api import Stage, StageContext

# The pipeline's order: the module that declares each stage's STAGE.
ORDER: list[str] = [
    "embed_core.prepare.stage",
    "embed_core.synthesize.stage",
    "embed_core.mine.stage",
    "embed_core.train.stage",
    "embed_core.evaluate.stage",
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


def records_upstream(config: RunConfig, stage: str) -> str | None:
    """The stage directory whose records ``stage`` reads: the nearest enabled earlier stage that
    produces records (mine reads synthesize when the config has it, else prepare); None for a
    stage with no such stage before it."""
    found = None
    for s in enabled_stages(config):
        if s.name == stage:
            break
        if s.produces_records:
            found = s.name
    return found


def context(config: RunConfig, run_dir: str | Path, stage: Stage | str, instance: str | None = None,
            options: Any = None) -> StageContext:
    """The context ``stage`` runs in: ``instance`` defaults to the stage's only (or first) one,
    ``options`` to its defaults."""
    stage = get(stage) if isinstance(stage, str) else stage
    options = options if options is not None else stage.options()
    instance = instance or stage.instance_names(config, options)[0]
    return StageContext(config=config, run_dir=Path(run_dir), instance=instance, options=options,
                        upstream=records_upstream(config, stage.name))


def cache_decision(stage: Stage, ctx: StageContext, force: bool = False) -> tuple[Fingerprint, bool]:
    """The instance's fingerprint, and whether it is a cache hit: the run directory holds an intact
    artifact of exactly those inputs (never under ``force``). The one cache: this decides."""
    from embed_core.artifacts import stage_is_intact

    fingerprint = stage.fingerprint(ctx)
    return fingerprint, not force and stage_is_intact(ctx.run_dir, ctx.instance, fingerprint.key)

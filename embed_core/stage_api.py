"""What a stage is: the contract every stage module declares as ``STAGE``.

A stage package (``embed_core/<stage>/``) has a light ``stage.py`` that declares
``STAGE = Stage(...)``: its name and help, when the config enables it, its options (the CLI's
flags and the Prefect UI's sub-form), its instances (train: one per configured training stage),
what it shows on the UI, and four functions with one signature for every stage:

``fingerprint(ctx) -> Fingerprint``       the stage's inputs (the cache key)
``run(ctx, fingerprint) -> manifest``     compute and commit the stage directory
``summarize(manifest) -> str``            the few lines the CLI and the run logs print
``report(ctx, manifest) -> Report``       extra markdown and a table for the Prefect UI

and, where they differ from the default, ``inputs(ctx)``: the stage directories it reads (records,
trained models; default: the records upstream), which are checked before it runs.

The heavy body (torch, FAISS, MTEB) lives in the package's other modules and is imported on the
first call (``body``), so listing the stages (``embedpipe --help``) stays light. The registry
(``embed_core.stages``) holds the order and builds each ``StageContext``; a stage module never
imports it: what the registry knows about the other stages reaches the stage as ``ctx.upstream``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from embed_core.config import RunConfig
from embed_core.fingerprint import Fingerprint


class StageOptions(BaseModel):
    """Per-run options of a stage beyond the config (none for most stages)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class StageContext:
    """Everything a stage function is given: the run's config and directory, the instance it
    works on (its directory under ``run_dir``), its options, and ``upstream``: the directory of
    the nearest enabled earlier stage whose records it reads (None for the first stage);
    ``upstreams``: every enabled earlier stage that produces records, in order (``upstream`` last)."""

    config: RunConfig
    run_dir: Path
    instance: str
    options: Any
    upstream: str | None = None
    upstreams: tuple[str, ...] = ()

    @property
    def stage_dir(self) -> Path:
        return self.run_dir / self.instance


@dataclass(frozen=True)
class Report:
    """What a stage shows on the Prefect UI besides its file list: extra markdown (plots by
    relative path, inlined when published) and an optional table."""

    markdown: str = ""
    markdown_key: str | None = None      # a stable artifact key (e.g. the evaluation report)
    table: list[dict[str, Any]] = field(default_factory=list)
    table_key: str | None = None          # artifact key prefix, e.g. "prepare-counts-"
    table_description: str = ""


def _always(config: RunConfig) -> bool:
    return True


def _no_report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    return Report()


@dataclass(frozen=True)
class Stage:
    """A stage as the pipeline, the CLI, ``embedpipe status`` and the UI see it."""

    name: str
    help: str
    fingerprint: Callable[[StageContext], Fingerprint]
    run: Callable[[StageContext, Fingerprint], dict[str, Any]]
    summarize: Callable[[dict[str, Any]], str]
    report: Callable[[StageContext, dict[str, Any]], Report] = _no_report
    enabled: Callable[[RunConfig], bool] = _always
    options: type[StageOptions] = StageOptions
    instances: Callable[[RunConfig, Any], list[str]] | None = None  # default: [name]
    produces_records: bool = False                                # later stages read its records
    inputs: Callable[[StageContext], list[Path]] | None = None      # stage dirs it reads; default: ctx.upstream's
    cli_args: Callable[[str], str] | None = None                  # flags that pick an instance (train: --stage x)
    retries: int = 0                                              # Prefect task retries
    retry_delay_s: Callable[[RunConfig], float] | None = None       # seconds before a retry; default 30
    log_prints: bool = True                                       # Prefect's print capture

    def instance_names(self, config: RunConfig, options: Any = None) -> list[str]:
        return self.instances(config, options or self.options()) if self.instances else [self.name]

    def options_for_pipeline(self, config: RunConfig) -> Any:
        return self.options()  # a stage run alone and in the pipeline computes the same thing

    def input_dirs(self, ctx: StageContext) -> list[Path]:
        """The stage directories ``ctx.instance`` reads (records, trained models): checked against
        their manifests, and for staleness, before it runs (``embed_core.stages.check_inputs``)."""
        if self.inputs is not None:
            return self.inputs(ctx)
        return [ctx.run_dir / ctx.upstream] if ctx.upstream else []

    def command(self, instance: str) -> str:
        """The command line that (re)computes ``instance``, without --config / --run-dir."""
        extra = self.cli_args(instance) if self.cli_args else ""
        return f"embedpipe {self.name}" + (f" {extra}" if extra else "")


def lazy(module: str, function: str) -> Callable[..., Any]:
    """``module.function``, imported on the first call: a stage declaration points at its heavy
    body without importing it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), function)(*args, **kwargs)

    call.__name__ = call.__qualname__ = function
    call.__module__ = module
    return call


def body(module: str, function: str, *, upstream: bool = False) -> Callable[..., Any]:
    """A stage function ``(ctx, *args)`` calling the library function ``module.function(config,
    run_dir, *args)`` — with ``upstream=ctx.upstream`` for a stage that reads an earlier stage's
    records — imported on the first call."""
    target = lazy(module, function)

    def call(ctx: StageContext, *args: Any) -> Any:
        return target(ctx.config, ctx.run_dir, *args, **({"upstream": ctx.upstream} if upstream else {}))

    call.__name__ = call.__qualname__ = function
    return call

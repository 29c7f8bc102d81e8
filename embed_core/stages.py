"""The stage registry: which stages exist, in which order, and how each one is fingerprinted,
run, summarised and reported.

Everything that walks the pipeline reads this list — ``embedpipe status``, the pipeline flow,
the CLI's commands, the data watch and the artifact table — so adding a stage is one
``register(Stage(...))`` call plus its module. A stage with several instances (train: one per
configured training stage) lists them through ``instances``; every instance has its own
directory ``<run_dir>/<instance>/``, fingerprint and cache entry.

Stage modules are imported lazily by the adapters below: a stage module may import this one
(for ``records_upstream``) without a cycle, and ``embed_core.fingerprint`` treats this module as
wiring (a leaf of the code-identity walk): what a stage read is in its key as content hashes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from embed_core.config import RunConfig
from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.fingerprint import Fingerprint


class StageOptions(BaseModel):
    """Per-run options of a stage beyond the config (none for most stages)."""

    model_config = ConfigDict(extra="forbid")


class TrainOptions(StageOptions):
    stage: str | None = Field(None, description="One training stage: its name or 1-based number; default all in order.")
    resume: bool = Field(True, description="Continue from the newest checkpoint of an interrupted run with the same "
                                           "inputs.")


class EvaluateOptions(StageOptions):
    models: list[str] | None = Field(None, description="'base', 'trained' or local model paths (default: the "
                                                       "config's evaluate.models).", json_schema_extra={"cli_flag": "--model"})
    tasks: list[str] | None = Field(None, description="Task names from the config (default: all configured tasks).")


@dataclass(frozen=True)
class Report:
    """What a stage shows on the Prefect UI besides its file list: extra markdown (plots by
    relative path, inlined when published) and an optional table."""

    markdown: str = ""
    markdown_key: str | None = None      # a stable artifact key (e.g. the evaluation report)
    table: list[dict[str, Any]] = field(default_factory=list)
    table_key: str | None = None          # artifact key prefix, e.g. "prepare-counts-"
    table_description: str = ""


@dataclass(frozen=True)
class Stage:
    name: str
    help: str
    module: str                                                   # where its code lives (code identity root)
    enabled: Callable[[RunConfig], bool]
    fingerprint: Callable[[RunConfig, Path, str, Any], Fingerprint]   # (config, run_dir, instance, options)
    run: Callable[[RunConfig, Path, str, Any, Fingerprint], dict[str, Any]]
    summarize: Callable[[dict[str, Any], Path], str]
    report: Callable[[RunConfig, Path, dict[str, Any]], Report] = lambda c, d, m: Report()
    options: type[StageOptions] = StageOptions
    instances: Callable[[RunConfig, Any], list[str]] | None = None  # default: [name]
    pipeline_options: Callable[[RunConfig], Any] | None = None      # options the pipeline runs it with
    produces_records: bool = False                                # later stages read its records
    retries: int = 0                                              # Prefect task retries
    log_prints: bool = True

    def instance_names(self, config: RunConfig, options: Any = None) -> list[str]:
        return self.instances(config, options or self.options()) if self.instances else [self.name]

    def options_for_pipeline(self, config: RunConfig) -> Any:
        return self.pipeline_options(config) if self.pipeline_options else self.options()


STAGES: list[Stage] = []


def register(stage: Stage, *, after: str | None = None) -> Stage:
    """Add a stage at the end of the pipeline, or right after the stage named ``after``."""
    if any(s.name == stage.name for s in STAGES):
        raise ValueError(f"stage {stage.name!r} is registered already")
    index = len(STAGES) if after is None else [s.name for s in STAGES].index(after) + 1
    STAGES.insert(index, stage)
    return stage


def unregister(name: str) -> None:
    STAGES[:] = [s for s in STAGES if s.name != name]


def get(name: str) -> Stage:
    for s in STAGES:
        if s.name == name:
            return s
    raise EmbedpipeError(f"no stage {name!r} (stages: {', '.join(s.name for s in STAGES)})")


def enabled_stages(config: RunConfig) -> list[Stage]:
    return [s for s in STAGES if s.enabled(config)]


def pipeline_instances(config: RunConfig) -> list[tuple[Stage, str]]:
    """(stage, instance directory name) for everything the pipeline runs, in order."""
    return [(s, inst) for s in enabled_stages(config) for inst in s.instance_names(config, s.options_for_pipeline(config))]


def downstream_of(config: RunConfig, instance: str) -> list[str]:
    """Instances after ``instance`` in pipeline order (each reads, directly or not, its outputs)."""
    names = [inst for _, inst in pipeline_instances(config)]
    if instance not in names:
        raise EmbedpipeError(f"no stage {instance!r} in this config (stages: {', '.join(names)})")
    return names[names.index(instance) + 1:]


def records_upstream(config: RunConfig, stage: str) -> str:
    """The stage directory whose records ``stage`` reads: the nearest enabled earlier stage that
    produces records (mine reads synthesize when the config has it, else prepare)."""
    found = None
    for s in enabled_stages(config):
        if s.name == stage:
            break
        if s.produces_records:
            found = s.name
    if found is None:
        raise EmbedpipeError(f"stage {stage!r} has no records-producing stage before it")
    return found


# -- the built-in stages -------------------------------------------------------------------------

def _prepare() -> Stage:
    def report(config: RunConfig, run_dir: Path, manifest: dict) -> Report:
        from embed_core.prepare.stage import counts_table

        return Report(table=counts_table(manifest), table_key="prepare-counts-",
                      table_description=f"prepare stage counts for run '{manifest.get('run_name')}'")

    def fingerprint(c, d, i, o):
        from embed_core.prepare.stage import input_fingerprint
        return input_fingerprint(c)

    def run(c, d, i, o, fp):
        from embed_core.prepare.stage import run_prepare
        return run_prepare(c, d, fp)

    def summarize(m, d):
        from embed_core.prepare.stage import format_counts
        return format_counts(m)

    return Stage(name="prepare", help="raw sources → unified records", module="embed_core.prepare.stage",
                 enabled=lambda c: True, fingerprint=fingerprint, run=run, summarize=summarize, report=report,
                 produces_records=True)


def _synthesize() -> Stage:
    def report(config: RunConfig, run_dir: Path, manifest: dict) -> Report:
        rows = [{"strategy": name, **s} for name, s in manifest["counts"]["strategies"].items()]
        return Report(markdown=(f"Samples: `{run_dir}/synthesize/_samples.parquet`, failures with raw replies: "
                                "`_failures.parquet`, filtered answers: `_filtered.parquet`."),
                      table=rows, table_key="synthesize-stats-",
                      table_description="synthesize stage: requests, failures and filters per strategy")

    def fingerprint(c, d, i, o):
        from embed_core.synthesize.stage import input_fingerprint
        return input_fingerprint(c, d)

    def run(c, d, i, o, fp):
        from embed_core.synthesize.stage import run_synthesize
        return run_synthesize(c, d, fp)

    def summarize(m, d):
        from embed_core.synthesize.stage import format_counts
        return format_counts(m)

    # One task-level retry on top of the client's per-request retries: the request cache makes a
    # retry repeat only the calls that had not finished.
    return Stage(name="synthesize", help="LLM paraphrase, augmentation and hard negatives (needs prepare's output)",
                 module="embed_core.synthesize.stage", enabled=lambda c: c.synthesize is not None,
                 fingerprint=fingerprint, run=run, summarize=summarize, report=report, produces_records=True,
                 retries=1)


def _mine() -> Stage:
    def report(config: RunConfig, run_dir: Path, manifest: dict) -> Report:
        rows = [{k: d.get(k) for k in ("dataset", "records", "mined", "negatives_added", "too_few", "filtered_by_margin")}
                | {"index": (d.get("index") or {}).get("type"), "positive_p50": (d.get("positive_score") or {}).get("p50"),
                   "kept_p50": (d.get("kept_score") or {}).get("p50")} for d in manifest["counts"]["datasets"]]
        plot = "![score histogram](score_hist.png)" if "score_hist.png" in manifest.get("outputs", {}) else ""
        return Report(markdown=plot, table=rows, table_key="mine-stats-",
                      table_description="mine stage: negatives per dataset and score medians")

    def fingerprint(c, d, i, o):
        from embed_core.mine.stage import input_fingerprint
        return input_fingerprint(c, d)

    def run(c, d, i, o, fp):
        from embed_core.mine.stage import run_mine
        return run_mine(c, d, fp)

    def summarize(m, d):
        from embed_core.mine.stage import format_counts
        return format_counts(m)

    return Stage(name="mine", help="FAISS hard-negative mining (needs prepare's or synthesize's output)",
                 module="embed_core.mine.stage", enabled=lambda c: c.mine is not None, fingerprint=fingerprint, run=run,
                 summarize=summarize, report=report, produces_records=True)


def train_stage_names(config: RunConfig, stage: str | None) -> list[str]:
    """Instance directories of the configured training stages (or one: name or 1-based number)."""
    if config.train is None:
        raise ConfigError("the run config has no 'train' section")
    names = [s.name for s in config.train.stages]
    if stage is None:
        return [f"train-{n}" for n in names]
    if stage.isdigit() and 1 <= int(stage) <= len(names):  # --stage 1 | 2
        return [f"train-{names[int(stage) - 1]}"]
    if stage.removeprefix("train-") not in names:
        raise ConfigError(f"train: no stage {stage!r} (configured: {', '.join(names)})")
    return [f"train-{stage.removeprefix('train-')}"]


def _train() -> Stage:
    def report(config: RunConfig, run_dir: Path, manifest: dict) -> Report:
        return Report(markdown=f"Model: `{run_dir / ('train-' + manifest['stage_name']) / 'model'}`\n\n"
                               "![loss curve](loss.png)")

    def fingerprint(c, d, i, o):
        from embed_core.train.stage import input_fingerprint
        return input_fingerprint(c, d, i.removeprefix("train-"))

    def run(c, d, i, o, fp):
        from embed_core.train.stage import run_train_stage
        return run_train_stage(c, d, i.removeprefix("train-"), resume=o.resume, fingerprint=fp)

    def summarize(m, d):
        from embed_core.train.stage import format_counts
        return format_counts(m)

    return Stage(name="train", help="the training stages in order (needs prepare/synthesize/mine output)",
                 module="embed_core.train.stage", enabled=lambda c: c.train is not None, fingerprint=fingerprint, run=run,
                 summarize=summarize, report=report, options=TrainOptions, log_prints=False,  # dev tasks: see _evaluate
                 instances=lambda c, o: train_stage_names(c, o.stage))


def _evaluate() -> Stage:
    def report(config: RunConfig, run_dir: Path, manifest: dict) -> Report:
        from embed_core.evaluate.stage import main_scores

        report_md = (run_dir / "evaluate" / "report.md").read_text(encoding="utf-8")
        return Report(markdown=report_md, markdown_key="evaluate-report-",
                      table=[{k: r[k] for k in ("model", "task", "metric", "value")} for r in main_scores(run_dir)],
                      table_key="evaluate-scores-", table_description="evaluate stage: main score per model and task (mteb)")

    def fingerprint(c, d, i, o):
        from embed_core.evaluate.stage import input_fingerprint
        return input_fingerprint(c, d, o.models, o.tasks)

    def run(c, d, i, o, fp):
        from embed_core.evaluate.stage import run_evaluate
        return run_evaluate(c, d, o.models, o.tasks, fingerprint=fp)

    def summarize(m, d):
        from embed_core.evaluate.stage import format_counts
        return format_counts(m, d)

    def pipeline_options(config: RunConfig) -> EvaluateOptions:
        from embed_core.evaluate.stage import pipeline_models
        return EvaluateOptions(models=pipeline_models(config))

    # log_prints off: `datasets` fingerprints functions with dill, which disassembles code with
    # print() while capturing sys.stdout; Prefect's print patch would turn that into log lines
    # (train too: its dev tasks run mteb).
    return Stage(name="evaluate", help="MTEB on the configured tasks for the base and trained models",
                 module="embed_core.evaluate.stage", enabled=lambda c: c.evaluate is not None, fingerprint=fingerprint,
                 run=run, summarize=summarize, report=report, options=EvaluateOptions,
                 pipeline_options=pipeline_options, log_prints=False)


for _factory in (_prepare, _synthesize, _mine, _train, _evaluate):
    register(_factory())

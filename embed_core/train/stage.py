"""The train stage, as the pipeline sees it: one instance per configured training stage, each its
own directory ``train-<stage>/`` (the body is ``run.py``; the trainer, batches and sampling beside
it). Before a stage, two optional steps, each an instance of its own: with ``remine``,
``mine-<stage>/``: the records the mine stage reads, mined again with the model that stage starts
from (``embed_core.mine.run``); with ``targeted_synthesis``, ``synth-<stage>/``: LLM paraphrases and
hard negatives for the training records nearest to that model's dev failures
(``embed_core.synthesize.targeted_step``); with ``data_value``, ``value-<stage>/``: the data-value
gate's decision and the records without the units it dropped (``embed_core.datavalue.gate``). The
stage trains on its last step's records. The steps
belong to the train stage so that they run where training runs (a GPU work pool) and in its order;
under several processes they run on rank 0 alone (``embed_core.dist.ranks``). The directories'
names come from ``embed_core.stage_dirs``; ``STEPS`` is the one table of step kinds: each entry its
prefix, body, records, key, inputs, which ranks run it, its summary and report; a manifest records
its kind as ``step`` (``manifest_kind``: one written before, by its sections)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from embed_core import numbers
from embed_core.config import RunConfig
from embed_core.errors import ConfigError
from embed_core.manifests import (DataValueManifest, Manifest, RemineManifest, SynthManifest, TrainManifest,
                                  step_class)
from embed_core.mine import stage as mine_stage
from embed_core import stage_dirs
from embed_core.stage_api import Report, Stage, StageContext, StageOptions, lazy
from embed_core.stage_dirs import (REMINE_PREFIX, SYNTH_PREFIX, TRAIN_PREFIX, VALUE_PREFIX, instance_name,
                                   remine_instance_name, stage_name_of, synth_instance_name, value_instance_name)
from embed_core.synthesize import stage as synth_stage
from embed_core.dist import ranks

NAME = stage_dirs.TRAIN
BODY = "embed_core.train.run"
MINE_BODY = "embed_core.mine.run"
SYNTH_BODY = "embed_core.synthesize.targeted_step"
GATE_BODY = "embed_core.datavalue.gate"
GATE_VIEW = "embed_core.datavalue.apply"  # light: the gate's summary lines
KEY = "embed_core.train.key"  # the training step's cache key and inputs
START = "embed_core.train.resolved"  # the model a training stage starts from
PREFIX = TRAIN_PREFIX


class TrainOptions(StageOptions):
    stage: str | None = Field(None, description="One training stage: its name or 1-based number (with its "
                                                "re-mining, synthesis and data-value steps when it has them; "
                                                "mine-NAME, synth-NAME or value-NAME, e.g. mine-stage2: that step "
                                                "alone); default all in order.")
    resume: bool = Field(True, description="Continue from the newest checkpoint of an interrupted run with the same "
                                           "inputs.")


def stage_steps(stage: Any) -> list[str]:
    """The instances of one training stage, in order: its re-mining step (``remine``), its
    error-driven synthesis step (``targeted_synthesis``), its data-value gate (``data_value``), the stage
    itself (``STEPS``' order)."""
    return [kind.instance_name(stage.name) for kind in STEPS if kind.configured(stage)]


def train_stage_names(config: RunConfig, stage: str | None) -> list[str]:
    """Instance directories of the configured training stages, each after its steps (or one stage:
    name or 1-based number; ``mine-<name>`` / ``synth-<name>``: that step alone)."""
    if config.train is None:
        raise ConfigError("the run config has no 'train' section")
    stages = config.train.stages
    steps = [inst for s in stages for inst in stage_steps(s)]
    if stage is None:
        return steps
    if stage.isdigit() and 1 <= int(stage) <= len(stages):  # --stage 1 | 2
        return stage_steps(stages[int(stage) - 1])
    before = [inst for inst in steps if step_kind(inst) is not TRAIN]  # the steps before a stage
    if stage in before:
        return [stage]
    for s in stages:
        if s.name == stage_name_of(stage):
            return stage_steps(s)
    raise ConfigError(f"train: no stage {stage!r} (configured: {', '.join(s.name for s in stages)}"
                      + "".join(f", {inst}" for inst in before) + ")")


def _stage_of(ctx: StageContext, instance: str) -> Any:
    name = instance.removeprefix(step_kind(instance).prefix)
    return next(s for s in ctx.config.train.stages if s.name == name)


def records_dir(ctx: StageContext, instance: str) -> str:
    """The stage directory whose records ``instance`` reads: a training stage its last step's (else
    the records upstream), a synthesis step the re-mining step's (else the records upstream), a
    re-mining step those the mine stage reads (its negatives are replaced, a source's own kept)."""
    return step_kind(instance).records(ctx, instance)


def _records_before(ctx: StageContext, instance: str) -> str:
    steps = stage_steps(_stage_of(ctx, instance))
    before = steps[:steps.index(instance)]
    return before[-1] if before else ctx.upstream


def _remine_records(ctx: StageContext, instance: str) -> str:
    return [u for u in ctx.upstreams if u != mine_stage.NAME][-1]


def _start_model(ctx: StageContext) -> str:
    return lazy(START, "start_model_path")(ctx.config, ctx.run_dir, _stage_of(ctx, ctx.instance).name)


def _start_model_dirs(ctx: StageContext) -> list[Path]:
    return lazy(START, "start_model_dirs")(ctx.config, ctx.run_dir, _stage_of(ctx, ctx.instance).name)


def _remine_settings(ctx: StageContext):
    from embed_core.mine.config import remine_settings

    return remine_settings(ctx.config.mine, _stage_of(ctx, ctx.instance).remine, model=_start_model(ctx),
                           pooling=ctx.config.train.pooling)


def _train_counts(manifest: dict[str, Any]) -> str:
    m = TrainManifest.of(manifest)
    lines = [f"stage {m.stage_name}: {m.steps} steps from {m.init_model}"]
    hw = m.hardware
    if hw:  # manifests written before it was recorded have none
        lines.append(f"trained on {hw['device']} x {m.processes} process{'es' if m.processes > 1 else ''}, "
                     f"{hw['precision']}, weights {hw['weights']}, sharding {hw['sharding']}")
    lines += [f"{'dataset':<22}{'task':>16}{'records':>9}{'weight':>9}"]
    for name, d in m.datasets.items():
        lines.append(f"{name:<22}{d.task:>16}{d.records:>9}{d.weight:>9.3f}")
    c = m.counts
    lines.append(f"examples {c.examples}, tokens {c.tokens}, final loss {numbers.loss(c.final_loss)}")
    return "\n".join(lines)


def _synth_counts(manifest: dict[str, Any]) -> str:
    targeted = SynthManifest.of(manifest).targeted
    return "\n".join([synth_stage.format_counts(manifest), "dev failures -> training records: " + ", ".join(
        f"{ds} {c['failures']} -> {c['selected']}" for ds, c in targeted["datasets"].items())])


def _train_report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    return Report(markdown=f"Model: `{ctx.run_dir / instance_name(TrainManifest.of(manifest).stage_name) / 'model'}`"
                           "\n\n![loss curve](loss.png)")


def _remine_fingerprint(ctx: StageContext, upstream: str):
    return lazy(MINE_BODY, "mining_fingerprint")(ctx.config, ctx.run_dir, _remine_settings(ctx), ctx.instance,
                                                 upstream=upstream)


def _synth_fingerprint(ctx: StageContext, upstream: str):
    return lazy(SYNTH_BODY, "targeted_fingerprint")(ctx.config, ctx.run_dir, _stage_of(ctx, ctx.instance).name,
                                                    ctx.instance, _start_model(ctx), upstream=upstream)


def _gate_fingerprint(ctx: StageContext, upstream: str):
    return lazy(GATE_BODY, "gate_fingerprint")(ctx.config, ctx.run_dir, _stage_of(ctx, ctx.instance).name,
                                               ctx.instance, upstream=upstream)


def _gate_run(ctx: StageContext, fingerprint, upstream: str) -> dict[str, Any]:
    return lazy(GATE_BODY, "run_gate")(ctx.config, ctx.run_dir, _stage_of(ctx, ctx.instance).name, ctx.instance,
                                       fingerprint, upstream=upstream)


def _gate_report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    units = DataValueManifest.of(manifest).units
    return Report(markdown=(ctx.stage_dir / "report.md").read_text(encoding="utf-8"),
                  table=[{"unit": u, **d} for u, d in units.items()], table_key=f"{ctx.instance}-decision-",
                  table_description=f"{ctx.instance}: each unit's delta and decision")


def _train_fingerprint(ctx: StageContext, upstream: str):
    return lazy(KEY, "input_fingerprint")(ctx.config, ctx.run_dir, stage_name_of(ctx.instance), upstream=upstream)


def _step_inputs(ctx: StageContext, upstream: str) -> list[Path]:
    return [ctx.run_dir / upstream, *_start_model_dirs(ctx)]


def _synth_inputs(ctx: StageContext, upstream: str) -> list[Path]:
    extra = [ctx.run_dir / stage_dirs.PREPARE] if upstream != stage_dirs.PREPARE else []
    return [ctx.run_dir / upstream, *extra, *_start_model_dirs(ctx)]


def _train_inputs(ctx: StageContext, upstream: str) -> list[Path]:
    return lazy(KEY, "input_dirs")(ctx.config, ctx.run_dir, _stage_of(ctx, ctx.instance).name, upstream=upstream)


def _remine_run(ctx: StageContext, fingerprint, upstream: str) -> dict[str, Any]:
    return lazy(MINE_BODY, "mine_into")(ctx.config, ctx.run_dir, _remine_settings(ctx), ctx.instance, fingerprint,
                                        upstream=upstream)


def _synth_run(ctx: StageContext, fingerprint, upstream: str) -> dict[str, Any]:
    return lazy(SYNTH_BODY, "run_targeted")(ctx.config, ctx.run_dir, _stage_of(ctx, ctx.instance).name,
                                            ctx.instance, _start_model(ctx), fingerprint, upstream=upstream)


def _train_run(ctx: StageContext, fingerprint, upstream: str) -> dict[str, Any]:
    return lazy(BODY, "run_train_stage")(ctx.config, ctx.run_dir, stage_name_of(ctx.instance), upstream=upstream,
                                         resume=ctx.options.resume, fingerprint=fingerprint)


@dataclass(frozen=True)
class StepKind:
    """One kind of instance of the train stage; its manifest records ``name`` as its ``step``."""

    name: str
    prefix: str  # its directories' prefix (``mine-``, ``synth-``, ``train-``)
    body: str  # the module that runs it
    instance_name: Callable[[str], str]  # training stage name -> its directory
    configured: Callable[[Any], bool]  # whether a training stage has this step
    records: Callable[[StageContext, str], str]  # (ctx, instance) -> the stage directory whose records it reads
    fingerprint: Callable[[StageContext, str], Any]  # (ctx, records upstream) -> its cache key
    inputs: Callable[[StageContext, str], list[Path]]  # (ctx, records upstream) -> the directories it reads
    run: Callable[[StageContext, Any, str], dict[str, Any]]  # (ctx, fingerprint, records upstream) -> manifest
    all_ranks: bool  # every rank runs it (training); else rank 0 alone, the other ranks reading what it committed
    summarize: Callable[[dict[str, Any]], str]  # manifest -> the lines `embedpipe status` prints
    report: Callable[[StageContext, dict[str, Any]], Report]
    cli_arg: Callable[[str], str]  # instance -> its --stage value
    manifest: type[Manifest]  # the class of what it commits (embed_core.manifests)


REMINE = StepKind("remine", REMINE_PREFIX, MINE_BODY, remine_instance_name, lambda s: s.remine is not None,
                  _remine_records, _remine_fingerprint, _step_inputs, _remine_run, all_ranks=False,
                  summarize=mine_stage.format_counts, report=mine_stage.report, cli_arg=lambda i: i,
                  manifest=RemineManifest)
SYNTHESIS = StepKind("synth", SYNTH_PREFIX, SYNTH_BODY, synth_instance_name,
                     lambda s: s.targeted_synthesis is not None, _records_before, _synth_fingerprint, _synth_inputs,
                     _synth_run, all_ranks=False, summarize=_synth_counts, report=synth_stage.report,
                     cli_arg=lambda i: i, manifest=SynthManifest)
DATAVALUE = StepKind("datavalue", VALUE_PREFIX, GATE_BODY, value_instance_name, lambda s: s.data_value is not None,
                     _records_before, _gate_fingerprint, _train_inputs, _gate_run, all_ranks=False,
                     summarize=lazy(GATE_VIEW, "format_counts"), report=_gate_report, cli_arg=lambda i: i,
                     manifest=DataValueManifest)
TRAIN = StepKind("train", PREFIX, BODY, instance_name, lambda s: True, _records_before, _train_fingerprint,
                 _train_inputs, _train_run, all_ranks=True, summarize=_train_counts, report=_train_report,
                 cli_arg=stage_name_of, manifest=TrainManifest)
STEPS = (REMINE, SYNTHESIS, DATAVALUE, TRAIN)  # in the order they run before and as a training stage


def step_kind(instance: str) -> StepKind:
    """The kind of an instance directory, by its prefix (the one place instance names are told apart)."""
    return next(kind for kind in STEPS if instance.startswith(kind.prefix))


def manifest_kind(manifest: dict[str, Any]) -> StepKind:
    """The step kind whose manifest this is: the class of the step it records
    (``embed_core.manifests.step_class``; one written before it recorded its step, by its sections)."""
    cls = step_class(manifest)
    return next(kind for kind in STEPS if kind.manifest is cls)


def format_counts(manifest: dict[str, Any]) -> str:
    return manifest_kind(manifest).summarize(manifest)


def _report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    return step_kind(ctx.instance).report(ctx, manifest)


def _fingerprint(ctx: StageContext):
    return step_kind(ctx.instance).fingerprint(ctx, records_dir(ctx, ctx.instance))


def _inputs(ctx: StageContext) -> list[Path]:
    return step_kind(ctx.instance).inputs(ctx, records_dir(ctx, ctx.instance))


def _run(ctx: StageContext, fingerprint) -> dict[str, Any]:
    """A training stage on every rank; a step before it (re-mining, targeted synthesis) on rank 0
    alone, the other ranks reading what it committed (``embed_core.dist.ranks``)."""
    kind, upstream = step_kind(ctx.instance), records_dir(ctx, ctx.instance)
    if kind.all_ranks:
        return kind.run(ctx, fingerprint, upstream)
    return ranks.on_main_rank(ctx.instance, lambda: kind.run(ctx, fingerprint, upstream),
                              lambda: ranks.committed(ctx.run_dir, ctx.instance, fingerprint.key),
                              timeout_s=ctx.config.train.dist_timeout_s)


# log_prints off: dev tasks run mteb, whose `datasets` dependency disassembles code with print()
# while capturing sys.stdout; Prefect's print patch would turn that into log lines.
STAGE = Stage(name=NAME, help="the training stages in order, each after its re-mining, synthesis and data-value "
                             "steps if it has them (needs prepare/synthesize/mine output)",
              enabled=lambda c: c.train is not None, fingerprint=_fingerprint, run=_run, summarize=format_counts,
              report=_report, options=TrainOptions, log_prints=False,
              instances=lambda c, o: train_stage_names(c, o.stage), inputs=_inputs,
              cli_args=lambda instance: f"--stage {step_kind(instance).cli_arg(instance)}")

"""The train stage, as the pipeline sees it: one instance per configured training stage, each its
own directory ``train-<stage>/`` (the body is ``run.py``; the trainer, batches and sampling beside
it). Before a stage, two optional steps, each an instance of its own: with ``remine``,
``mine-<stage>/``: the records the mine stage reads, mined again with the model that stage starts
from (``embed_core.mine.run``); with ``targeted_synthesis``, ``synth-<stage>/``: LLM paraphrases and
hard negatives for the training records nearest to that model's dev failures
(``embed_core.synthesize.targeted_step``). The stage trains on its last step's records. The steps
belong to the train stage so that they run where training runs (a GPU work pool) and in its order;
under several processes they run on rank 0 alone (``embed_core.dist.ranks``). The directories'
names come from ``embed_core.stage_dirs``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from embed_core.config import RunConfig
from embed_core.errors import ConfigError
from embed_core.mine import stage as mine_stage
from embed_core.stage_api import Report, Stage, StageContext, StageOptions, lazy
from embed_core.stage_dirs import (REMINE_PREFIX, SYNTH_PREFIX, TRAIN, TRAIN_PREFIX, instance_name, is_remine_instance,
                                   is_synth_instance, is_train_instance, remine_instance_name, stage_name_of,
                                   synth_instance_name)
from embed_core.synthesize import stage as synth_stage
from embed_core.dist import ranks

NAME = TRAIN
BODY = "embed_core.train.run"
MINE_BODY = "embed_core.mine.run"
SYNTH_BODY = "embed_core.synthesize.targeted_step"
PREFIX = TRAIN_PREFIX


class TrainOptions(StageOptions):
    stage: str | None = Field(None, description="One training stage: its name or 1-based number (with its "
                                                "re-mining and synthesis steps when it has them; mine-NAME or "
                                                "synth-NAME, e.g. mine-stage2: that step alone); default all in "
                                                "order.")
    resume: bool = Field(True, description="Continue from the newest checkpoint of an interrupted run with the same "
                                           "inputs.")


def stage_steps(stage: Any) -> list[str]:
    """The instances of one training stage, in order: its re-mining step (``remine``), its
    error-driven synthesis step (``targeted_synthesis``), the stage itself."""
    return ([remine_instance_name(stage.name)] if stage.remine is not None else []) + \
        ([synth_instance_name(stage.name)] if stage.targeted_synthesis is not None else []) + [instance_name(stage.name)]


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
    if stage in steps and not is_train_instance(stage):
        return [stage]
    for s in stages:
        if s.name == stage_name_of(stage):
            return stage_steps(s)
    raise ConfigError(f"train: no stage {stage!r} (configured: {', '.join(s.name for s in stages)}"
                      + "".join(f", {inst}" for inst in steps if not is_train_instance(inst)) + ")")


def _stage_of(ctx: StageContext, instance: str) -> Any:
    name = instance.removeprefix(REMINE_PREFIX if is_remine_instance(instance) else
                                 SYNTH_PREFIX if is_synth_instance(instance) else PREFIX)
    return next(s for s in ctx.config.train.stages if s.name == name)


def records_dir(ctx: StageContext, instance: str) -> str:
    """The stage directory whose records ``instance`` reads: a training stage its last step's (else
    the records upstream), a synthesis step the re-mining step's (else the records upstream), a
    re-mining step those the mine stage reads (its negatives are replaced, a source's own kept)."""
    if is_remine_instance(instance):
        return [u for u in ctx.upstreams if u != mine_stage.NAME][-1]
    steps = stage_steps(_stage_of(ctx, instance))
    before = steps[:steps.index(instance)]
    return before[-1] if before else ctx.upstream


def _start_model(ctx: StageContext) -> str:
    return lazy(BODY, "start_model_path")(ctx.config, ctx.run_dir, _stage_of(ctx, ctx.instance).name)


def _remine_settings(ctx: StageContext):
    from embed_core.mine.config import remine_settings

    return remine_settings(ctx.config.mine, _stage_of(ctx, ctx.instance).remine, model=_start_model(ctx),
                           pooling=ctx.config.train.pooling)


def format_counts(manifest: dict[str, Any]) -> str:
    if "targeted" in manifest:  # an error-driven synthesis step's manifest
        return "\n".join([synth_stage.format_counts(manifest), "dev failures -> training records: " + ", ".join(
            f"{ds} {c['failures']} -> {c['selected']}" for ds, c in manifest["targeted"]["datasets"].items())])
    if "stage_name" not in manifest:  # a re-mining step's manifest
        return mine_stage.format_counts(manifest)
    lines = [f"stage {manifest['stage_name']}: {manifest['steps']} steps from {manifest['init_model']}"]
    hw = manifest.get("hardware")
    if hw:  # manifests written before it was recorded have none
        processes = manifest.get("processes", 1)
        lines.append(f"trained on {hw['device']} x {processes} process{'es' if processes > 1 else ''}, "
                     f"{hw['precision']}, weights {hw['weights']}, sharding {hw['sharding']}")
    lines += [f"{'dataset':<22}{'task':>16}{'records':>9}{'weight':>9}"]
    for name, d in manifest["datasets"].items():
        lines.append(f"{name:<22}{d['task']:>16}{d['records']:>9}{d['weight']:>9.3f}")
    c = manifest["counts"]
    lines.append(f"examples {c['examples']}, tokens {c['tokens']}, final loss {c['final_loss']}")
    return "\n".join(lines)


def _report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    if is_remine_instance(ctx.instance):
        return mine_stage.report(ctx, manifest)
    if is_synth_instance(ctx.instance):
        return synth_stage.report(ctx, manifest)
    return Report(markdown=f"Model: `{ctx.run_dir / instance_name(manifest['stage_name']) / 'model'}`\n\n"
                           "![loss curve](loss.png)")


def _fingerprint(ctx: StageContext):
    upstream = records_dir(ctx, ctx.instance)
    if is_remine_instance(ctx.instance):
        return lazy(MINE_BODY, "mining_fingerprint")(ctx.config, ctx.run_dir, _remine_settings(ctx), ctx.instance,
                                                     upstream=upstream)
    if is_synth_instance(ctx.instance):
        return lazy(SYNTH_BODY, "targeted_fingerprint")(ctx.config, ctx.run_dir, _stage_of(ctx, ctx.instance).name,
                                                        ctx.instance, _start_model(ctx), upstream=upstream)
    return lazy(BODY, "input_fingerprint")(ctx.config, ctx.run_dir, stage_name_of(ctx.instance), upstream=upstream)


def _inputs(ctx: StageContext) -> list[Path]:
    upstream = records_dir(ctx, ctx.instance)
    name = _stage_of(ctx, ctx.instance).name
    if is_train_instance(ctx.instance):
        return lazy(BODY, "input_dirs")(ctx.config, ctx.run_dir, name, upstream=upstream)
    extra = [ctx.run_dir / "prepare"] if is_synth_instance(ctx.instance) and upstream != "prepare" else []
    return [ctx.run_dir / upstream, *extra, *lazy(BODY, "start_model_dirs")(ctx.config, ctx.run_dir, name)]


def _run(ctx: StageContext, fingerprint) -> dict[str, Any]:
    """A training stage on every rank; a step before it (re-mining, targeted synthesis) on rank 0
    alone, the other ranks reading what it committed (``embed_core.dist.ranks``)."""
    upstream = records_dir(ctx, ctx.instance)
    if is_train_instance(ctx.instance):
        return lazy(BODY, "run_train_stage")(ctx.config, ctx.run_dir, stage_name_of(ctx.instance), upstream=upstream,
                                             resume=ctx.options.resume, fingerprint=fingerprint)
    return ranks.on_main_rank(ctx.instance, lambda: _run_step(ctx, fingerprint, upstream),
                              lambda: ranks.committed(ctx.run_dir, ctx.instance, fingerprint.key),
                              timeout_s=ctx.config.train.dist_timeout_s)


def _run_step(ctx: StageContext, fingerprint, upstream: str) -> dict[str, Any]:
    if is_remine_instance(ctx.instance):
        return lazy(MINE_BODY, "mine_into")(ctx.config, ctx.run_dir, _remine_settings(ctx), ctx.instance, fingerprint,
                                            upstream=upstream)
    return lazy(SYNTH_BODY, "run_targeted")(ctx.config, ctx.run_dir, _stage_of(ctx, ctx.instance).name,
                                            ctx.instance, _start_model(ctx), fingerprint, upstream=upstream)


# log_prints off: dev tasks run mteb, whose `datasets` dependency disassembles code with print()
# while capturing sys.stdout; Prefect's print patch would turn that into log lines.
STAGE = Stage(name=NAME, help="the training stages in order, each after its re-mining and synthesis steps if it "
                             "has them (needs prepare/synthesize/mine output)",
              enabled=lambda c: c.train is not None, fingerprint=_fingerprint, run=_run, summarize=format_counts,
              report=_report, options=TrainOptions, log_prints=False,
              instances=lambda c, o: train_stage_names(c, o.stage), inputs=_inputs,
              cli_args=lambda instance: f"--stage {stage_name_of(instance) if is_train_instance(instance) else instance}")

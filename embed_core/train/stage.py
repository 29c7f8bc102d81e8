"""The train stage, as the pipeline sees it: one instance per configured training stage, each its
own directory ``train-<stage>/`` (the body is ``run.py``; the trainer, batches and sampling beside
it), and before a stage with ``remine`` a re-mining step ``mine-<stage>/``: the records the mine
stage reads, mined again with the model that stage starts from (``embed_core.mine.run``), which the
stage then trains on. Re-mining belongs to the train stage so that it runs where training runs (a
GPU work pool) and in its order. This module is the one place that names those directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from embed_core.config import RunConfig
from embed_core.errors import ConfigError
from embed_core.mine import stage as mine_stage
from embed_core.stage_api import Report, Stage, StageContext, StageOptions, lazy

NAME = "train"
BODY = "embed_core.train.run"
MINE_BODY = "embed_core.mine.run"
PREFIX = "train-"
REMINE_PREFIX = mine_stage.NAME + "-"


class TrainOptions(StageOptions):
    stage: str | None = Field(None, description="One training stage: its name or 1-based number (with its "
                                                "re-mining step when it has one; mine-NAME, e.g. mine-stage2: that "
                                                "step alone); default all in order.")
    resume: bool = Field(True, description="Continue from the newest checkpoint of an interrupted run with the same "
                                           "inputs.")


def instance_name(stage_name: str) -> str:
    """The directory of training stage ``stage_name``: ``train-<stage_name>``."""
    return PREFIX + stage_name


def stage_name_of(instance: str) -> str:
    """The training stage an instance directory holds (``train-stage1`` -> ``stage1``)."""
    return instance.removeprefix(PREFIX)


def is_train_instance(name: str) -> bool:
    return name.startswith(PREFIX)


def remine_instance_name(stage_name: str) -> str:
    """The directory of the negatives re-mined for training stage ``stage_name``: ``mine-<stage_name>``."""
    return REMINE_PREFIX + stage_name


def is_remine_instance(name: str) -> bool:
    return name.startswith(REMINE_PREFIX)


def trained_model_dirs(run_dir: str | Path) -> list[Path]:
    """``<run_dir>/train-*/model`` directories, whatever the config says."""
    return sorted(Path(run_dir).glob(f"{PREFIX}*/model"))


def train_stage_names(config: RunConfig, stage: str | None) -> list[str]:
    """Instance directories of the configured training stages, each after its re-mining step (or
    one stage: name or 1-based number; ``mine-<name>``: its re-mining step alone)."""
    if config.train is None:
        raise ConfigError("the run config has no 'train' section")
    stages = {s.name: s for s in config.train.stages}
    names = list(stages)
    if stage is None:
        chosen = names
    elif stage.isdigit() and 1 <= int(stage) <= len(names):  # --stage 1 | 2
        chosen = [names[int(stage) - 1]]
    elif is_remine_instance(stage) and stage.removeprefix(REMINE_PREFIX) in names \
            and stages[stage.removeprefix(REMINE_PREFIX)].remine is not None:
        return [stage]
    elif stage_name_of(stage) in names:
        chosen = [stage_name_of(stage)]
    else:
        steps = [remine_instance_name(n) for n in names if stages[n].remine is not None]
        raise ConfigError(f"train: no stage {stage!r} (configured: {', '.join(names + steps)})")
    return [inst for n in chosen for inst in
            ([remine_instance_name(n)] if stages[n].remine is not None else []) + [instance_name(n)]]


def records_dir(ctx: StageContext, stage_name: str) -> str:
    """The stage directory whose records training stage ``stage_name`` trains on: its re-mining
    step's when it has one, else the records upstream."""
    stage = next(s for s in ctx.config.train.stages if s.name == stage_name)
    return remine_instance_name(stage_name) if stage.remine is not None else ctx.upstream


def _remined_from(ctx: StageContext) -> str:
    """The records a re-mining step mines: those the mine stage reads (its negatives are replaced,
    a source's own negatives kept)."""
    return [u for u in ctx.upstreams if u != mine_stage.NAME][-1]


def _remine_settings(ctx: StageContext):
    from embed_core.mine.config import remine_settings

    stage_name = ctx.instance.removeprefix(REMINE_PREFIX)
    stage = next(s for s in ctx.config.train.stages if s.name == stage_name)
    model = lazy(BODY, "start_model_path")(ctx.config, ctx.run_dir, stage_name)
    return remine_settings(ctx.config.mine, stage.remine, model=model, pooling=ctx.config.train.pooling)


def format_counts(manifest: dict[str, Any]) -> str:
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
    return Report(markdown=f"Model: `{ctx.run_dir / instance_name(manifest['stage_name']) / 'model'}`\n\n"
                           "![loss curve](loss.png)")


def _fingerprint(ctx: StageContext):
    if is_remine_instance(ctx.instance):
        return lazy(MINE_BODY, "mining_fingerprint")(ctx.config, ctx.run_dir, _remine_settings(ctx), ctx.instance,
                                                     upstream=_remined_from(ctx))
    name = stage_name_of(ctx.instance)
    return lazy(BODY, "input_fingerprint")(ctx.config, ctx.run_dir, name, upstream=records_dir(ctx, name))


def _inputs(ctx: StageContext) -> list[Path]:
    if is_remine_instance(ctx.instance):
        return [ctx.run_dir / _remined_from(ctx),
                *lazy(BODY, "start_model_dirs")(ctx.config, ctx.run_dir, ctx.instance.removeprefix(REMINE_PREFIX))]
    name = stage_name_of(ctx.instance)
    return lazy(BODY, "input_dirs")(ctx.config, ctx.run_dir, name, upstream=records_dir(ctx, name))


def _run(ctx: StageContext, fingerprint) -> dict[str, Any]:
    if is_remine_instance(ctx.instance):
        return lazy(MINE_BODY, "mine_into")(ctx.config, ctx.run_dir, _remine_settings(ctx), ctx.instance, fingerprint,
                                            upstream=_remined_from(ctx))
    name = stage_name_of(ctx.instance)
    return lazy(BODY, "run_train_stage")(ctx.config, ctx.run_dir, name, upstream=records_dir(ctx, name),
                                         resume=ctx.options.resume, fingerprint=fingerprint)


# log_prints off: dev tasks run mteb, whose `datasets` dependency disassembles code with print()
# while capturing sys.stdout; Prefect's print patch would turn that into log lines.
STAGE = Stage(name=NAME, help="the training stages in order, each after its re-mining step if it has one "
                             "(needs prepare/synthesize/mine output)",
              enabled=lambda c: c.train is not None, fingerprint=_fingerprint, run=_run, summarize=format_counts,
              report=_report, options=TrainOptions, log_prints=False,
              instances=lambda c, o: train_stage_names(c, o.stage), inputs=_inputs,
              cli_args=lambda instance: f"--stage {instance if is_remine_instance(instance) else stage_name_of(instance)}")

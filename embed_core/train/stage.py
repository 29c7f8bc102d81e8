"""The train stage, as the pipeline sees it: one instance per configured training stage, each its
own directory ``train-<stage>/`` (the body is ``run.py``; the trainer, batches and sampling beside
it). This module is the one place that names those directories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from embed_core.config import RunConfig
from embed_core.errors import ConfigError
from embed_core.stage_api import Report, Stage, StageContext, StageOptions, lazy

NAME = "train"
BODY = "embed_core.train.run"
PREFIX = "train-"


class TrainOptions(StageOptions):
    stage: str | None = Field(None, description="One training stage: its name or 1-based number; default all in order.")
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


def trained_model_dirs(run_dir: str | Path) -> list[Path]:
    """``<run_dir>/train-*/model`` directories, whatever the config says."""
    return sorted(Path(run_dir).glob(f"{PREFIX}*/model"))


def train_stage_names(config: RunConfig, stage: str | None) -> list[str]:
    """Instance directories of the configured training stages (or one: name or 1-based number)."""
    if config.train is None:
        raise ConfigError("the run config has no 'train' section")
    names = [s.name for s in config.train.stages]
    if stage is None:
        return [instance_name(n) for n in names]
    if stage.isdigit() and 1 <= int(stage) <= len(names):  # --stage 1 | 2
        return [instance_name(names[int(stage) - 1])]
    if stage_name_of(stage) not in names:
        raise ConfigError(f"train: no stage {stage!r} (configured: {', '.join(names)})")
    return [instance_name(stage_name_of(stage))]


def format_counts(manifest: dict[str, Any]) -> str:
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
    return Report(markdown=f"Model: `{ctx.run_dir / instance_name(manifest['stage_name']) / 'model'}`\n\n"
                           "![loss curve](loss.png)")


def _fingerprint(ctx: StageContext):
    return lazy(BODY, "input_fingerprint")(ctx.config, ctx.run_dir, stage_name_of(ctx.instance), upstream=ctx.upstream)


def _inputs(ctx: StageContext) -> list[Path]:
    return lazy(BODY, "input_dirs")(ctx.config, ctx.run_dir, stage_name_of(ctx.instance), upstream=ctx.upstream)


def _run(ctx: StageContext, fingerprint) -> dict[str, Any]:
    return lazy(BODY, "run_train_stage")(ctx.config, ctx.run_dir, stage_name_of(ctx.instance), upstream=ctx.upstream,
                                         resume=ctx.options.resume, fingerprint=fingerprint)


# log_prints off: dev tasks run mteb, whose `datasets` dependency disassembles code with print()
# while capturing sys.stdout; Prefect's print patch would turn that into log lines.
STAGE = Stage(name=NAME, help="the training stages in order (needs prepare/synthesize/mine output)",
              enabled=lambda c: c.train is not None, fingerprint=_fingerprint, run=_run, summarize=format_counts,
              report=_report, options=TrainOptions, log_prints=False,
              instances=lambda c, o: train_stage_names(c, o.stage), inputs=_inputs,
              cli_args=lambda instance: f"--stage {stage_name_of(instance)}")

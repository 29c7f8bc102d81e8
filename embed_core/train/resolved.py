"""The training step being run, resolved once: the configured stage, its position, the stage whose
model it starts from (or the base model) and the records upstream. Everything after (cache key,
trainer, commit, reference) reads its fields instead of walking the config again."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from embed_core.artifacts import model_artifact_dir
from embed_core.config import RunConfig
from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.model.encoder import resolve_model_path
from embed_core.train.config import TrainConfig, TrainStageConfig
from embed_core.stage_dirs import instance_name, value_instance_name


@dataclass(frozen=True)
class TrainingStep:
    """One configured training stage of one run directory, reading the records of ``upstream``."""

    config: RunConfig
    run_dir: Path
    index: int
    stage: TrainStageConfig
    init_stage: TrainStageConfig | None  # the stage whose model it starts from; None: the base model
    upstream: str = ""  # the stage directory whose records it trains on ("" where no one asks)

    @property
    def train(self) -> TrainConfig:
        return self.config.train

    @property
    def instance(self) -> str:
        """Its directory: ``train-<stage>``."""
        return instance_name(self.stage.name)

    @functools.cached_property
    def init_model(self) -> str:
        """The model it starts from: the earlier stage's saved model (refused until that stage ran),
        else the base model."""
        if self.init_stage is None:
            return resolve_model_path(self.train.base_model)
        path = self.run_dir / instance_name(self.init_stage.name) / "model"
        if not (path / "config.json").exists():
            raise EmbedpipeError(f"{path}: stage {self.stage.name} starts from stage {self.init_stage.name}'s model "
                                 "— run that stage first")
        return str(path)

    def start_model_dirs(self) -> list[Path]:
        """The stage directory of the model it starts from: the earlier stage's, or the one that
        trained the base model; none for a packaged or plain base model."""
        if self.init_stage is not None:
            return [self.run_dir / instance_name(self.init_stage.name)]
        trained = model_artifact_dir(self.train.base_model, self.run_dir)  # a base model another stage (or run) trained
        return [trained] if trained is not None else []


def train_section(config: RunConfig) -> TrainConfig:
    if config.train is None:
        raise ConfigError("the run config has no 'train' section")
    return config.train


def resolve_step(config: RunConfig, run_dir: str | Path, stage_name: str, *, upstream: str = "") -> TrainingStep:
    """Training stage ``stage_name`` resolved: its config, index and the stage it starts from
    (``init_from``: 'base', an earlier stage, by default the previous one)."""
    stages = train_section(config).stages
    index = next((i for i, s in enumerate(stages) if s.name == stage_name), None)
    if index is None:
        raise ConfigError(f"train: no stage named {stage_name!r} (configured: {', '.join(s.name for s in stages)})")
    stage = stages[index]
    if stage.data_value is not None and upstream == value_instance_name(stage.name):  # it trains on the gate's records
        from embed_core.datavalue.apply import gated_stage

        stage = gated_stage(Path(run_dir), stage)
    if stage.init_from == "base":  # e.g. loss ablations: every stage from the same base model
        init = None
    elif stage.init_from is not None:
        init = next(s for s in stages if s.name == stage.init_from)  # config validation: an earlier stage
    else:
        init = stages[index - 1] if index > 0 else None
    return TrainingStep(config, Path(run_dir), index, stage, init, upstream)


def start_model_path(config: RunConfig, run_dir: str | Path, stage_name: str) -> str:
    """The model training stage ``stage_name`` starts from (its re-mining step mines with it)."""
    return resolve_step(config, run_dir, stage_name).init_model


def start_model_dirs(config: RunConfig, run_dir: str | Path, stage_name: str) -> list[Path]:
    """The stage directories of the model training stage ``stage_name`` starts from."""
    return resolve_step(config, run_dir, stage_name).start_model_dirs()

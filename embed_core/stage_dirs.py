"""The one place that names the directories of a run: the stages' own (``<run_dir>/prepare``,
``synthesize``, ``mine``, ``evaluate``) and the train stage's instances, one per configured training
stage and step: ``train-<stage>`` (the stage), ``mine-<stage>`` (its re-mining step),
``synth-<stage>`` (its error-driven synthesis step), ``value-<stage>`` (its data-value gate),
``reference-<stage>`` (AutoRegEmbed's reference scores), ``checkpoints/`` (the stages' resumable
state) and ``proxies/<stage>/`` (the data-value gate's proxy runs, each a run directory of its own).
Every stage package reads these names from here, so no stage imports another to find its directory."""

from __future__ import annotations

from pathlib import Path

PREPARE = "prepare"
SYNTHESIZE = "synthesize"
MINE = "mine"
TRAIN = "train"
EVALUATE = "evaluate"
GATE = "gate"  # the release gate's verdict on the model evaluate released
RELEASE_COPY = "release"  # the current release's files, copied from the registry (not a stage directory)
CHECKPOINTS = "checkpoints"
PROXIES = "proxies"

TRAIN_PREFIX = TRAIN + "-"
REMINE_PREFIX = MINE + "-"
SYNTH_PREFIX = "synth-"
REFERENCE_PREFIX = "reference-"
VALUE_PREFIX = "value-"


def instance_name(stage_name: str) -> str:
    """The directory of training stage ``stage_name``: ``train-<stage_name>``."""
    return TRAIN_PREFIX + stage_name


def stage_name_of(instance: str) -> str:
    """The training stage an instance directory holds (``train-stage1`` -> ``stage1``)."""
    return instance.removeprefix(TRAIN_PREFIX)


def remine_instance_name(stage_name: str) -> str:
    """The directory of the negatives re-mined for training stage ``stage_name``: ``mine-<stage_name>``."""
    return REMINE_PREFIX + stage_name


def synth_instance_name(stage_name: str) -> str:
    """The directory of the records synthesized for training stage ``stage_name``'s dev failures."""
    return SYNTH_PREFIX + stage_name


def value_instance_name(stage_name: str) -> str:
    """The directory of training stage ``stage_name``'s data-value gate (its decision and records)."""
    return VALUE_PREFIX + stage_name


def reference_name(stage_name: str) -> str:
    """The directory of AutoRegEmbed's reference scores for training stage ``stage_name``."""
    return REFERENCE_PREFIX + stage_name


def trained_model_dirs(run_dir: str | Path) -> list[Path]:
    """``<run_dir>/train-*/model`` directories, whatever the config says."""
    return sorted(Path(run_dir).glob(f"{TRAIN_PREFIX}*/model"))

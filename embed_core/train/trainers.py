"""What each training mode does (its entry in ``embed_core.train.modes`` points here): build its
trainer, save its model, describe its losses. ``build_trainer`` is the recipe's phase that asks
the stage's entry."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from embed_core.errors import ConfigError
from embed_core.stage_dirs import reference_name
from embed_core.train.engine.batches import DatasetRecords
from embed_core.train.engine.outcome import FitOutcome
from embed_core.train.modes import Instructions, mode_of
from embed_core.train.resolved import TrainingStep

log = logging.getLogger("embedpipe.train")


def build_trainer(step: TrainingStep, datasets: dict[str, DatasetRecords], instructions: Instructions,
                  checkpoint_dir: Path):
    """The stage's trainer, as its mode builds it, ready to ``fit``."""
    mode = mode_of(step.stage)
    if step.stage.dev is not None and not mode.dev:
        raise ConfigError(f"train stage {step.stage.name}: dev evaluation is for contrastive stages, not {mode.name}")
    return mode.build(step, datasets, instructions, checkpoint_dir)


def contrastive_trainer(step: TrainingStep, datasets: dict[str, DatasetRecords], instructions: Instructions,
                         checkpoint_dir: Path):
    """The contrastive trainer, with its dev evaluator on every rank that scores dev tasks."""
    from embed_core.dist.distributed import is_main_process
    from embed_core.train.engine.trainer import Trainer

    cfg, stage = step.train, step.stage
    trainer = Trainer(cfg, stage, datasets, init_model=step.init_model, checkpoint_dir=checkpoint_dir,
                      seed=step.config.seed, log=log.info)
    if stage.dev is not None and (is_main_process() or trainer.backend.collective_forward):  # FSDP: every rank encodes
        work = checkpoint_dir / ("dev-data" if is_main_process() else f"dev-data-rank{trainer.rank}")
        trainer.dev_evaluator = dev_evaluator(step, instructions, work)
    return trainer


def dev_evaluator(step: TrainingStep, instructions: Instructions, work: Path):
    """The stage's dev tasks, encoded with the instructions and prompts the model trains with."""
    from embed_core.model.settings import ModelSettings
    from embed_core.train.dev import DevEvaluator

    cfg = step.train
    settings = ModelSettings(
        pooling=cfg.pooling, max_length=cfg.max_length, use_instructions=cfg.use_instructions,
        instruction_template=cfg.instruction_template, instructions=instructions[0],
        task_instructions=instructions[1], source="training")
    return DevEvaluator(step.stage.dev, step.config, step.run_dir, work, settings)


def contrastive_save(step: TrainingStep, outcome: FitOutcome, instructions: Instructions,
                      datasets: dict[str, DatasetRecords], model_dir: Path, training: dict[str, Any]) -> None:
    """The encoder in the sentence-transformers layout with its instructions; ``outcome.state``: its
    weights gathered from the shards (FSDP) or in the save dtype, else its own."""
    by_dataset, by_task = instructions
    state = outcome.state
    outcome.model.save(model_dir, instructions=by_dataset, task_instructions=by_task,
                       use_instructions=step.train.use_instructions, extra=training, state_dict=state,
                       retrieval_datasets=[n for n in by_dataset if datasets[n].task == "retrieval"])
    if state and {str(v.dtype) for v in state.values() if v.is_floating_point()} == {"torch.bfloat16"}:
        from embed_core.model.files import set_config_dtype

        set_config_dtype(model_dir, "bfloat16")  # train.save_dtype: config.json says what the file holds


def contrastive_losses(stage, datasets: dict[str, DatasetRecords]) -> dict[str, Any]:
    from embed_core.losses import loss_for
    from embed_core.model.card import describe_loss

    return {task: describe_loss(loss_for(task, stage.losses.get(task)))
            for task in sorted({d.task for d in datasets.values()})}


def _autoregembed_trainer(step: TrainingStep, examples: list, checkpoint_dir: Path, objective: str):
    from embed_core.model.encoder import resolve_model_path
    from embed_core.train.engine.autoregembed.trainer import AutoRegEmbedTrainer

    decoder = resolve_model_path(step.train.autoregembed.decoder or step.train.base_model)
    return AutoRegEmbedTrainer(step.train, step.stage, examples, init_model=step.init_model, decoder_model=decoder,
                               checkpoint_dir=checkpoint_dir, seed=step.config.seed, log=log.info,
                               objective=objective), decoder


def ic_trainer(step: TrainingStep, datasets: dict[str, DatasetRecords], instructions: Instructions,
                checkpoint_dir: Path):
    """L_IC: the compression encoder reconstructs each text through the frozen decoder."""
    from embed_core.train.engine.autoregembed.data import ic_examples

    return _autoregembed_trainer(step, ic_examples(datasets, step.train.autoregembed), checkpoint_dir, "ic")[0]


def cda_trainer(step: TrainingStep, datasets: dict[str, DatasetRecords], instructions: Instructions,
                 checkpoint_dir: Path):
    """L_CDA, against reference scores of the stage's initial encoder (``embed_core.train.reference``)."""
    from embed_core.train.engine.autoregembed.data import cda_examples
    from embed_core.train.reference import reference_scores

    arc = step.train.autoregembed
    examples = cda_examples(datasets, arc, positive_level=arc.positive_level, seed=step.config.seed)
    trainer, decoder = _autoregembed_trainer(step, examples, checkpoint_dir, "cda")
    trainer.reference = reference_scores(step, trainer, decoder, examples)
    log.info("%s: reference scores for %d examples (%s)", step.stage.name, len(examples), reference_name(step.stage.name))
    return trainer


def autoregembed_save(step: TrainingStep, outcome: FitOutcome, instructions: Instructions,
                       datasets: dict[str, DatasetRecords], model_dir: Path, training: dict[str, Any]) -> None:
    """The compression encoder with the method's instructions (its k tokens appended at inference)."""
    arc = step.train.autoregembed
    outcome.model.save(model_dir, extra=training, task_instructions={
        "sts": arc.sts_instruction, "nli": arc.sts_instruction, "classification": arc.sts_instruction,
        "pair_classification": arc.sts_instruction, "retrieval": arc.query_instruction,
        "retrieval_passage": arc.passage_instruction})


def autoregembed_losses(stage, datasets: dict[str, DatasetRecords]) -> dict[str, Any]:
    return {"autoregembed": stage.mode}

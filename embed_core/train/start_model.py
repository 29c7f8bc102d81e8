"""A training stage whose data-value decision left it no record keeps the model it starts from.

When the gate drops every unit (a stage over one all-synthetic dataset whose queries measured
harmful), or a proxy variant leaves every unit out (the base of an add-one-in gate over such a
stage), there is nothing to train: the stage commits its start model, untrained (0 steps), saved in
the stage's layout with its card, and scored on the stage's dev tasks when it has them (the proxy's
score: the reference an add-one-in unit is measured against). Later stages and evaluate read it as
any stage's model; its manifest says why it is untrained."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from embed_core.artifacts import StageWriter
from embed_core.config import config_hash
from embed_core.datavalue.apply import gate_note
from embed_core.fingerprint import Fingerprint
from embed_core.manifests import TrainManifest
from embed_core.model.card import card_facts, write_card
from embed_core.model.settings import read_model_settings, sentence_transformers_prompts
from embed_core.stage_dirs import instance_name
from embed_core.train.resolved import TrainingStep

log = logging.getLogger("embedpipe.train")


def load_start_model(step: TrainingStep):
    """The stage's start model as the trainer loads it (without LoRA adapters: nothing trains them),
    on this process's device, in eval mode."""
    import torch

    from embed_core.model.embedder import Embedder
    from embed_core.model.encoder import default_device_type
    from embed_core.train.engine.trainer import encoder_settings

    model = Embedder(step.init_model, **encoder_settings(step.train, step.init_model))
    return model.to(torch.device(default_device_type())).eval()


def dev_scores(step: TrainingStep, model, work: Path) -> list[dict[str, Any]]:
    """The stage's dev scores of ``model`` as step 0's dev rows (none without dev tasks)."""
    from embed_core.model.encoder import uses_bf16
    from embed_core.train.trainers import dev_evaluator

    if step.stage.dev is None:
        return []
    evaluator = dev_evaluator(step, ({}, {}), work)
    device_type = next(model.parameters()).device.type
    scores = evaluator.score(model, bf16=uses_bf16(step.train.precision, device_type))
    selection = evaluator.selection_score(scores)
    return [{"stage": step.stage.name, "step": 0, "task": task, "score": score, "selection": selection}
            for task, score in scores.items()]


def commit_start_model(step: TrainingStep, fingerprint: Fingerprint, reason: str, work: Path,
                       t0: float) -> dict[str, Any]:
    """Rank 0: ``train-<stage>/`` holding the stage's start model, untrained, and why (``work``: where
    the dev tasks' data is written)."""
    from embed_core.train.commit import DEV_SCHEMA, training_settings

    stage = step.stage
    log.info("%s: %s; the stage keeps the model it starts from, untrained (%s)", stage.name, reason, step.init_model)
    model = load_start_model(step)
    with StageWriter(step.run_dir, instance_name(stage.name), TrainManifest, fingerprint=fingerprint,
                     run_name=step.config.run_name) as writer:
        rows = dev_scores(step, model, work)
        counts = {"steps": 0, "examples": 0, "tokens": 0, "final_loss": None}
        if rows:
            counts.update(selected_step=0, selected_dev_score=rows[0]["selection"])
        model_dir = writer.staging / "model"
        model.save(model_dir, use_instructions=step.train.use_instructions,
                   extra={**training_settings(step), "untrained": reason})
        card = card_facts(run_name=step.config.run_name, config_hash=config_hash(step.config),
                          base_model=step.train.base_model, init_model=step.init_model,
                          stage=stage.model_dump(mode="json"), datasets={}, losses={}, counts=counts)
        write_card(model_dir, card, sentence_transformers_prompts(read_model_settings(model_dir)))
        writer.register_tree("model", kind="model")
        if rows:
            writer.write_table("dev.parquet", pa.Table.from_pylist(rows, schema=DEV_SCHEMA), kind="metrics")
        gate = gate_note(step.run_dir, step.upstream)
        return writer.commit({
            **({"data_value": gate} if gate is not None else {}),
            "stage_name": stage.name, "init_model": step.init_model, "steps": 0, "untrained": reason,
            "datasets": {}, "counts": counts,
            "selected": {"select": stage.dev.select, "step": 0, "best": rows[0]} if rows else None,
            "probe": {"file": None, "reason": "untrained: the start model"},
            "timings_s": {"total": round(time.perf_counter() - t0, 3), "train_steps": 0.0}})

"""The train stage's commit (rank 0): the model saved by its mode, merged and carded, its probe, the
metrics and dev tables, the lineage, the hardware it trained on and the loss plot, committed as
``train-<stage>/``. Every piece reads the trainer's typed outcome (``FitOutcome``), not the trainer."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from embed_core.artifacts import StageWriter, output_hashes
from embed_core.config import config_hash
from embed_core.datavalue.apply import gate_note
from embed_core.fingerprint import Fingerprint
from embed_core.manifests import TrainManifest
from embed_core.model.card import card_facts, write_card
from embed_core.model.settings import read_model_settings, sentence_transformers_prompts
from embed_core.schema import INFONCE_TASKS
from embed_core.train.config import TrainStageConfig
from embed_core.train.engine.batches import DatasetRecords
from embed_core.train.engine.lineage import LINEAGE_FILE, lineage_table
from embed_core.train.engine.outcome import FitOutcome
from embed_core.train.engine.sampling import dataset_weights
from embed_core.train.modes import Instructions, mode_of
from embed_core.train.plots import loss_plot
from embed_core.stage_dirs import instance_name
from embed_core.train.resolved import TrainingStep

log = logging.getLogger("embedpipe.train")

DEV_SCHEMA = pa.schema([("stage", pa.string()), ("step", pa.int64()), ("task", pa.string()), ("score", pa.float64()),
                        ("selection", pa.float64())])

METRIC_SCHEMA = pa.schema([("stage", pa.string()), ("step", pa.int64()), ("dataset", pa.string()), ("task", pa.string()),
                           ("loss", pa.float64()), ("examples", pa.int64()), ("tokens", pa.int64()), ("lr", pa.float64()),
                           ("seconds", pa.float64()), ("tokens_per_s", pa.float64()), ("examples_per_s", pa.float64()),
                           ("grad_norm", pa.float64()), ("peak_memory_mb", pa.float64()),
                           ("peak_reserved_mb", pa.float64()), ("mfu", pa.float64()),
                           # false negatives the loss left out (embed_core.losses.false_negatives)
                           ("masked_duplicates", pa.int64()), ("masked_margin", pa.int64()),
                           ("masked_guide", pa.int64())])


def commit_stage(step: TrainingStep, datasets: dict[str, DatasetRecords], outcome: FitOutcome,
                 instructions: Instructions, fingerprint: Fingerprint, t0: float) -> dict[str, Any]:
    """Rank 0: the model with its card, metrics, dev scores, loss plot and lineage (the records each
    step consumed), committed as ``train-<stage>/``."""
    config, cfg, stage, run_dir = step.config, step.train, step.stage, step.run_dir
    mode = mode_of(stage)
    sizes = {n: d.size for n, d in datasets.items()}
    weights = dataset_weights(sizes, stage.alpha, {n for n, d in datasets.items() if d.task in INFONCE_TASKS}, stage.eta,
                              stage.dataset_weight)
    rows = [{k: r.get(k) for k in METRIC_SCHEMA.names} for r in outcome.metrics]
    dataset_info = {n: {"task": d.task, "records": d.size, "weight": round(weights.get(n, 0.0), 6)}
                    for n, d in datasets.items()}
    counts = stage_counts(stage, outcome, rows)
    card = card_facts(run_name=config.run_name, config_hash=config_hash(config), base_model=cfg.base_model,
                      init_model=step.init_model, stage=stage.model_dump(mode="json"), datasets=dataset_info,
                      losses=mode.losses(stage, datasets), counts=counts, matryoshka=cfg.matryoshka_of(stage))
    lineage = lineage_of(run_dir, step.upstream, stage, datasets, outcome)
    with StageWriter(run_dir, instance_name(stage.name), TrainManifest, fingerprint=fingerprint,
                     run_name=config.run_name) as writer:
        model_dir = writer.staging / "model"
        mode.save(step, outcome, instructions, datasets, model_dir, training_settings(step))
        if stage.merge is not None:
            _merge(run_dir, stage, model_dir)
        write_card(model_dir, card, sentence_transformers_prompts(read_model_settings(model_dir)))
        writer.register_tree("model", kind="model")
        probe = _write_probe(writer, stage, datasets, outcome, model_dir)
        writer.write_table("metrics.parquet", pa.Table.from_pylist(rows, schema=METRIC_SCHEMA), kind="metrics")
        selected = None
        if outcome.dev_rows:
            writer.write_table("dev.parquet", pa.Table.from_pylist(outcome.dev_rows, schema=DEV_SCHEMA), kind="metrics")
            selected = {"select": stage.dev.select, "step": outcome.selected_step, "best": outcome.best}
        if lineage is not None:
            writer.write_table(LINEAGE_FILE, lineage, kind="lineage")
        writer.write_file("loss.png", loss_plot(rows, outcome.dev_rows, outcome.best if outcome.dev_rows else None),
                          kind="plot")
        secs = sum({r["step"]: r["seconds"] for r in rows}.values())
        gate = gate_note(run_dir, step.upstream)  # the data-value decision it trained under, if any
        return writer.commit({
            **({"data_value": gate} if gate is not None else {}),
            "stage_name": stage.name,
            "init_model": step.init_model, "steps": outcome.steps, "processes": outcome.world,
            "hardware": hardware(cfg, outcome),
            "datasets": dataset_info,
            "counts": counts,
            "selected": selected,
            "merged_with": stage.merge.model_dump() if stage.merge is not None else None,
            "probe": probe,
            "timings_s": {"total": round(time.perf_counter() - t0, 3), "train_steps": round(secs, 3)},
        })


def stage_counts(stage: TrainStageConfig, outcome: FitOutcome, rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts = {"steps": outcome.steps, "examples": sum(r["examples"] for r in rows),
              "tokens": sum(r["tokens"] for r in rows), "final_loss": rows[-1]["loss"] if rows else None}
    if outcome.dev_rows:
        counts["selected_step"] = outcome.selected_step
        counts["selected_dev_score"] = outcome.best["score"] if stage.dev.select == "best" else \
            outcome.dev_rows[-1]["selection"]
    return counts


def training_settings(step: TrainingStep) -> dict[str, Any]:
    """What the saved model's ``embedpipe.json`` records of its training (and its Matryoshka dims)."""
    cfg, stage = step.train, step.stage
    training = {"training": {"run_name": step.config.run_name, "stage": stage.model_dump(mode="json"),
                             "train": cfg.model_dump(mode="json", exclude={"stages"}), "init_model": step.init_model,
                             "seed": step.config.seed}}
    mrl = cfg.matryoshka_of(stage)
    if mrl is not None:  # the trained prefix dimensions: a user may cut the embedding to any of them
        training["matryoshka"] = {"dims": list(mrl.dims), "weights": list(mrl.weights)}
    return training


def _write_probe(writer: StageWriter, stage: TrainStageConfig, datasets: dict[str, DatasetRecords],
                 outcome: FitOutcome, model_dir: Path) -> dict[str, Any]:
    """``probe.npz``: the probe texts as the in-training encoder embeds them, under each of the saved
    model's prompts (``embed_core.model.probe``), for the release check. Not recorded for a sharded
    encoder (rank 0 alone cannot run it) nor for a mode whose encoder is not the saved layout."""
    from embed_core.model.probe import PROBE_FILE, probe_record, probe_texts

    no_probe = mode_of(stage).no_probe
    if no_probe is not None or outcome.state is not None:
        return {"file": None, "reason": no_probe or "sharded encoder"}
    texts = probe_texts(datasets)
    if not texts:
        return {"file": None, "reason": "no texts"}
    blob, entry = probe_record(outcome.model, model_dir, texts)
    writer.write_file(PROBE_FILE, blob, kind="probe")
    # weights averaged with another stage's after training: the saved model is not the in-training encoder
    return {**entry, "averaged": stage.merge is not None, "lora": bool(outcome.model.lora)}


def _merge(run_dir: Path, stage: TrainStageConfig, model_dir: Path) -> None:
    """The saved weights become (1 − w) × the stage's + w × ``merge.stage``'s (``embed_core.model.merge``)."""
    from embed_core.model.merge import write_average

    other = run_dir / instance_name(stage.merge.stage) / "model"
    write_average([model_dir, other], [1 - stage.merge.weight, stage.merge.weight], model_dir)
    log.info("%s: saved weights averaged with %s's (weight %.2f)", stage.name, stage.merge.stage, stage.merge.weight)


def lineage_of(run_dir: Path, upstream: str, stage: TrainStageConfig, datasets: dict[str, DatasetRecords],
               outcome: FitOutcome) -> pa.Table | None:
    """The records each step consumed (``embed_core.train.engine.lineage``), with the upstream record files
    they are rows of; None for a mode that trains on examples derived from records (AutoRegEmbed)."""
    if not mode_of(stage).lineage or outcome.consumed is None:
        return None
    hashes = output_hashes(run_dir, upstream, required=False)
    files = {n: {"file": f"{n}.parquet", "sha256": hashes.get(f"{n}.parquet"), "records": d.size}
             for n, d in datasets.items()}
    return lineage_table(outcome.consumed, {"upstream": upstream, "datasets": files, "steps": outcome.steps,
                                            "model_step": outcome.selected_step, "grad_accum": stage.grad_accum,
                                            "processes": outcome.world,
                                            **({"origin_weight": stage.origin_weight} if stage.origin_weight else {})})


def hardware(cfg, outcome: FitOutcome) -> dict[str, Any]:
    """Where and how the stage trained, for its summary and manifest: the device (its name on
    CUDA), the compute precision, the stored weights' dtype and the back end."""
    import torch

    device = outcome.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"device": name, "precision": "bf16 autocast" if outcome.bf16 else "fp32",
            "weights": cfg.weights_dtype, "sharding": cfg.backend_name()}

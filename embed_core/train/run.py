"""The train stage's body (declared in ``stage.py``): QZhou's two-stage recipe (stage 1 retrieval only,
stage 2 all tasks with η), read as a recipe: the step resolved once (``resolved``), its key (``key``),
load -> build the trainer (``modes``, ``trainers``) -> fit (a ``FitOutcome``) -> commit (``commit``).

Each configured stage is its own artifact ``<run_dir>/train-<name>/``:
* ``model/`` — the saved model (transformers + sentence-transformers layout, ``embedpipe.json``
  with pooling, instructions and the training config);
* ``metrics.parquet`` — per micro-batch: step, dataset, task, loss, lr, examples, tokens, seconds,
  tokens/s, examples/s; ``loss.png`` — loss curve per task;
* ``lineage.parquet`` — per (step, dataset) the positions of the upstream records the step consumed
  (``embed_core.train.engine.lineage``; asked with ``embedpipe lineage``, ``embed_core.runs.lineage``);
* ``manifest.json`` — input fingerprint, datasets and sampling weights, timings.
Checkpoints live in ``<run_dir>/checkpoints/<name>/`` until the stage's artifact is committed.

Records come from the mine stage when the run has one, else from prepare. A stage starts from
the previous stage's model (``init_from`` to choose another), the first from ``base_model``.

A stage in an AutoRegEmbed mode (``mode: autoregembed_ic | autoregembed_cda``) trains the
compression encoder against a frozen decoder instead (``embed_core.train.engine.autoregembed``); a CDA stage
first precomputes its reference scores with its initial model (``embed_core.train.reference``) into
``<run_dir>/reference-<name>/`` (``scores.parquet``), an artifact of its own keyed by that model,
the examples and the method's settings, so a resumed or re-run stage reuses it.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embed_core.artifacts import read_records
from embed_core.config import RunConfig
from embed_core.datavalue.apply import emptied_by_gate
from embed_core.dist.distributed import barrier, check_shared_directory, init_process_group, is_main_process
from embed_core.dist.ranks import committed, on_main_rank
from embed_core.dist.spawn import local_ranks
from embed_core.errors import ConfigError
from embed_core.fingerprint import Fingerprint
from embed_core.paths import file_problem
from embed_core.schema import TRAINABLE_TASKS
from embed_core.stage_dirs import CHECKPOINTS
from embed_core.train.commit import commit_stage
from embed_core.train.config import TrainStageConfig
from embed_core.train.engine.batches import DatasetRecords
from embed_core.train.engine.finite import check_finite_weights
from embed_core.train.key import step_fingerprint
from embed_core.train.modes import Instructions
from embed_core.train.records import RECORDS_DIR, mapped_records
from embed_core.train.resolved import TrainingStep, resolve_step
from embed_core.train.trainers import build_trainer

log = logging.getLogger("embedpipe.train")


def run_train_stage(config: RunConfig, run_dir: str | Path, stage_name: str, *, upstream: str, resume: bool = False,
                    fingerprint: Fingerprint | None = None) -> dict[str, Any]:
    """Train the configured stage ``stage_name`` on the records of ``upstream`` (a stage directory)
    and commit ``train-<stage>/``; every rank of a launched run calls it, rank 0 writes. Not
    launched, it starts ``train.processes`` local ranks itself (``embed_core.dist.spawn``)."""
    with local_ranks(config, Path(run_dir), stage_name, upstream=upstream, resume=resume, body=run_train_stage):
        step = resolve_step(config, run_dir, stage_name, upstream=upstream)
        return _run_train_stage(step, resume=resume, fingerprint=fingerprint)


def _run_train_stage(step: TrainingStep, *, resume: bool, fingerprint: Fingerprint | None) -> dict[str, Any]:
    """The recipe, on every rank: load -> build the trainer -> fit -> commit (rank 0; the others wait)."""
    t0 = time.perf_counter()
    name = step.stage.name  # every phase before the first step is a line with its seconds (phase_done)
    # under torchrun / deepspeed / accelerate launch or local_ranks: every rank runs this function
    _, world = init_process_group(timeout_s=step.train.dist_timeout_s)
    check_shared_directory(step.run_dir / CHECKPOINTS, step.stage.name)  # every node sees what rank 0 writes
    fingerprint = fingerprint or step_fingerprint(step)
    ckpt_dir = _checkpoint_dir(step, fingerprint)
    t = phase_done(f"{name}: process group ({world} process{'es' if world > 1 else ''}), input fingerprint and "
                   "checkpoint directory ready", t0)
    emptied = emptied_by_gate(step.run_dir, step.upstream)
    if emptied is not None:  # the data-value decision left no record: the stage keeps its start model
        return _keep_start_model(step, fingerprint, emptied, ckpt_dir, t0)
    # load
    datasets = load_datasets(step.run_dir, step.stage, step.upstream, ckpt_dir / RECORDS_DIR)
    instructions = _instructions(datasets)
    t = phase_done(f"{name}: read {sum(d.size for d in datasets.values())} records of {len(datasets)} dataset"
                   f"{'s' if len(datasets) > 1 else ''} from {step.upstream}", t)
    # build the trainer (it says when its model is loaded and placed)
    trainer = build_trainer(step, datasets, instructions, ckpt_dir)
    phase_done(f"{name}: trainer ready (model, back end, losses, sampler{', dev tasks' if step.stage.dev else ''})", t)
    # fit (every rank; FSDP gathers the whole weights for the save on every rank)
    outcome = trainer.fit(resume=resume)

    def write() -> dict[str, Any]:
        weights = outcome.state.items() if outcome.state is not None else outcome.model.state_dict().items()
        check_finite_weights(step.stage.name, weights, outcome.metrics, outcome.steps)
        return commit_stage(step, datasets, outcome, instructions, fingerprint, t0)

    return _commit_on_rank0(step, fingerprint, ckpt_dir, write)


def _keep_start_model(step: TrainingStep, fingerprint: Fingerprint, reason: str, ckpt_dir: Path,
                      t0: float) -> dict[str, Any]:
    from embed_core.train.start_model import commit_start_model

    return _commit_on_rank0(step, fingerprint, ckpt_dir,
                            lambda: commit_start_model(step, fingerprint, reason, ckpt_dir / "dev-data", t0))


def _commit_on_rank0(step: TrainingStep, fingerprint: Fingerprint, ckpt_dir: Path,
                     write: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Rank 0 commits the stage with ``write`` and removes its checkpoints (the committed artifact
    supersedes them); the others wait, however long that takes, and read what it committed."""
    def commit() -> dict[str, Any]:
        manifest = write()
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        return manifest

    return on_main_rank(step.instance, commit, lambda: committed(step.run_dir, step.instance, fingerprint.key))


def phase_done(what: str, since: float) -> float:
    """Log ``what`` with the seconds since ``since`` (a phase before the first step: none is silent,
    however long it takes); returns now, the next phase's start."""
    now = time.perf_counter()
    log.info("%s in %.1f s", what, now - since)
    return now


def _checkpoint_dir(step: TrainingStep, fingerprint: Fingerprint) -> Path:
    """The stage's checkpoint directory, emptied when its checkpoints are of other inputs."""
    ckpt_dir = step.run_dir / CHECKPOINTS / step.stage.name
    marker = ckpt_dir / "input_fingerprint"
    if is_main_process():
        if ckpt_dir.exists() and (file_problem(marker) is not None or marker.read_text() != fingerprint.key):
            shutil.rmtree(ckpt_dir)  # checkpoints of other inputs must never be resumed
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(fingerprint.key)
    barrier()  # every rank sees the same checkpoints to resume from
    return ckpt_dir


def load_datasets(run_dir: Path, stage: TrainStageConfig, upstream: str,
                  cache_dir: Path | None = None) -> dict[str, DatasetRecords]:
    """The datasets of ``upstream`` (a stage directory) that ``stage`` trains on: memory-mapped from
    Arrow copies in ``cache_dir`` (``embed_core.train.records``; every rank calls it), or read into
    memory without one."""
    tables = (mapped_records(run_dir, upstream, cache_dir) if cache_dir is not None else
              {name: (table, None) for name, table in read_records(run_dir, upstream).items()})
    out: dict[str, DatasetRecords] = {}
    for name, (table, summary) in sorted(tables.items()):
        dataset = name.removesuffix(".parquet")
        if table.num_rows == 0 or (stage.datasets is not None and dataset not in stage.datasets):
            continue
        records = DatasetRecords(dataset, table, summary)
        if records.task not in TRAINABLE_TASKS or (stage.tasks is not None and records.task not in stage.tasks):
            continue
        out[dataset] = records
    if not out:
        raise ConfigError(f"train stage {stage.name}: no dataset matches tasks={stage.tasks} datasets={stage.datasets}")
    unknown = sorted(set(stage.dataset_weight) - set(out))
    if unknown:  # a typo would silently leave the weights as they were
        raise ConfigError(f"train stage {stage.name}: dataset_weight names {', '.join(unknown)}, not among the "
                          f"stage's datasets ({', '.join(sorted(out))})")
    return out


def _instructions(datasets: dict[str, DatasetRecords]) -> Instructions:
    """(dataset -> instruction, task -> instruction) the model is trained with: the largest dataset
    of a task names the task's."""
    instructions: dict[str, str] = {}
    task_instructions: dict[str, str] = {}
    for name, d in sorted(datasets.items(), key=lambda kv: -kv[1].size):
        found = sorted(d.instructions())
        if found:
            instructions[name] = found[0]
            task_instructions.setdefault(d.task, found[0])
    return instructions, task_instructions

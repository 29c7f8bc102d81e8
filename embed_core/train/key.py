"""The train stage's cache key: what a training step reads (the upstream record files it trains on,
the model it starts from, a merged stage's model, the dev tasks' inputs) and the directories that
are. The key's code identity is the whole stage body's (``embed_core.train.run``'s import closure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embed_core.artifacts import output_hashes, read_manifest, read_parquet
from embed_core.config import RunConfig, config_hash
from embed_core.errors import EmbedpipeError
from embed_core.fingerprint import Fingerprint, code_identity
from embed_core.manifests import Manifest
from embed_core.model.encoder import model_fingerprint
from embed_core.paths import files_within
from embed_core.schema import TRAINABLE_TASKS
from embed_core.dist.spawn import training_processes
from embed_core.train.config import TrainStageConfig
from embed_core.train.resolved import TrainingStep, resolve_step
from embed_core.stage_dirs import PREPARE, instance_name
from embed_core.train.stage import BODY

# Libraries whose versions are part of this stage's code identity (embed_core.fingerprint).
LIBRARIES = ("torch", "transformers", "deepspeed", "peft", "numpy")


def input_dirs(config: RunConfig, run_dir: str | Path, stage_name: str, *, upstream: str) -> list[Path]:
    """The stage directories a training stage reads: its records upstream, the stage whose model it
    starts from, and prepare when a dev task uses prepare's dev records."""
    step = resolve_step(config, run_dir, stage_name, upstream=upstream)
    stage, run_dir = step.stage, step.run_dir
    out = [run_dir / upstream, *step.start_model_dirs()]
    if stage.merge is not None and run_dir / instance_name(stage.merge.stage) not in out:
        out.append(run_dir / instance_name(stage.merge.stage))
    if stage.dev is not None and any(task.dataset for task in stage.dev.tasks):
        out.append(run_dir / PREPARE)
    return out


def input_fingerprint(config: RunConfig, run_dir: str | Path, stage_name: str, *, upstream: str) -> Fingerprint:
    return step_fingerprint(resolve_step(config, run_dir, stage_name, upstream=upstream))


def step_fingerprint(step: TrainingStep) -> Fingerprint:
    """The key of ``step``: its inputs' hashes, its settings and the stage body's code."""
    run_dir, cfg, stage, config = step.run_dir, step.train, step.stage, step.config
    up = read_manifest(run_dir, step.upstream)
    if up is None:
        raise EmbedpipeError(f"{run_dir / step.upstream}: no manifest.json — run the earlier stages first")
    records = Manifest.of(up).hashes("records")
    init = ({"base": model_fingerprint(cfg.base_model, cfg.pooling, cfg.max_length, False)} if step.init_stage is None
            else _stage_model_hashes(run_dir, step.init_stage.name))
    return Fingerprint.of(step.instance, BODY, LIBRARIES, {
        # batch_size is per process: the global batch, and so the model, depends on how many train
        "processes": training_processes(cfg),
        "upstream": _used_outputs(run_dir / step.upstream, records, stage),
        "train": config_hash(cfg.model_copy(update={"stages": [], "work_pool": None, "processes": "auto"})),
        "stage": config_hash(stage), "init": init,
        "dev": _dev_inputs(config, run_dir, stage), "seed": config.seed,
        **({"merge": _stage_model_hashes(run_dir, stage.merge.stage)} if stage.merge is not None else {})})


def _dataset_task(path: Path) -> str | None:
    column = read_parquet(path, columns=["task"]).column("task")
    return column[0].as_py() if len(column) else None


def _used_outputs(stage_path: Path, records: dict[str, str], stage: TrainStageConfig) -> dict[str, str]:
    """Hashes of the upstream record files this stage trains on (a change elsewhere — e.g. an STS
    source for a retrieval-only stage 1 — leaves the stage a cache hit)."""
    used = {}
    for name, sha256 in records.items():
        dataset = name.removesuffix(".parquet")
        if stage.datasets is not None and dataset not in stage.datasets:
            continue
        task = _dataset_task(stage_path / name)
        if task is None or task not in TRAINABLE_TASKS or (stage.tasks is not None and task not in stage.tasks):
            continue
        used[name] = sha256
    return used


def _stage_model_hashes(run_dir: Path, stage_name: str) -> dict[str, Any]:
    """A trained stage's model, by its files' hashes (not its metrics, whose timings differ between
    identical runs)."""
    man = read_manifest(run_dir, instance_name(stage_name))
    return {"stage": stage_name, "model": Manifest.of(man).hashes(prefix="model/") if man else "missing"}


def _dev_inputs(config: RunConfig, run_dir: Path, stage: TrainStageConfig) -> dict[str, str]:
    """Hashes of what the dev tasks read and run (with select: best they decide which weights are
    kept): prepare's dev records of their datasets, their files, and the dev evaluation's code with
    the scoring libraries' versions (``embed_core.train.dev`` is a leaf of this stage's code walk)."""
    if stage.dev is None:
        return {}
    from embed_core.scoring.config import SCORING_LIBRARIES
    from embed_core.fingerprint import sha256_file

    out: dict[str, str] = {"code": code_identity("embed_core.train.dev", SCORING_LIBRARIES)}
    prepared = output_hashes(run_dir, PREPARE, prefix="dev/", required=False)
    for task in stage.dev.tasks:
        if task.dataset:
            out[f"{task.name}:dev/{task.dataset}"] = prepared.get(f"dev/{task.dataset}.parquet", "missing")
            continue
        paths = [task.path] if isinstance(task.path, str) else list(task.path)
        for path in [*paths, *([task.train_path] if task.train_path else [])]:
            resolved = config.resolve(path)
            files = files_within(resolved) if resolved.is_dir() else [resolved]
            for f in files:
                out[f"{task.name}:{f.name}"] = sha256_file(f) if f.is_file() else "missing"
    return out

"""The train stage's body (declared in ``stage.py``): QZhou's two-stage recipe (stage 1 retrieval only, stage 2 all tasks with η).

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
first precomputes its reference scores with its initial model into ``<run_dir>/reference-<name>/``
(``scores.parquet``), an artifact of its own keyed by that model, the examples and the method's
settings, so a resumed or re-run stage reuses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from embed_core.artifacts import StageWriter, model_artifact_dir, read_manifest, read_records
from embed_core.config import RunConfig, config_hash
from embed_core.train.config import TrainConfig, TrainStageConfig
from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.fingerprint import Fingerprint, code_identity
from embed_core.losses import loss_for
from embed_core.model.card import card_facts, describe_loss, write_card
from embed_core.model.encoder import model_fingerprint, resolve_model_path
from embed_core.model.settings import ModelSettings, read_model_settings, sentence_transformers_prompts
from embed_core.paths import file_problem, files_within
from embed_core.plots import pyplot, to_png
from embed_core.schema import INFONCE_TASKS, TRAINABLE_TASKS
from embed_core.train.engine.batches import DatasetRecords
from embed_core.train.engine.lineage import LINEAGE_FILE, lineage_table
from embed_core.train.engine.finite import check_finite_weights
from embed_core.train.records import RECORDS_DIR, mapped_records
from embed_core.dist.distributed import barrier, check_shared_directory, init_process_group, is_main_process
from embed_core.dist.ranks import committed, on_main_rank
from embed_core.train.engine.sampling import dataset_weights
from embed_core.dist.spawn import local_ranks, training_processes
from embed_core.stage_dirs import instance_name

log = logging.getLogger("embedpipe.train")


def _cfg(config: RunConfig) -> TrainConfig:
    if config.train is None:
        raise ConfigError("the run config has no 'train' section")
    return config.train


def get_stage(config: RunConfig, name: str) -> tuple[int, TrainStageConfig]:
    for i, s in enumerate(_cfg(config).stages):
        if s.name == name:
            return i, s
    raise ConfigError(f"train: no stage named {name!r} (configured: {', '.join(s.name for s in _cfg(config).stages)})")


def _init_stage(config: RunConfig, index: int, stage: TrainStageConfig) -> TrainStageConfig | None:
    stages = _cfg(config).stages
    if stage.init_from == "base":  # e.g. loss ablations: every stage from the same base model
        return None
    if stage.init_from is not None:
        return get_stage(config, stage.init_from)[1]
    return stages[index - 1] if index > 0 else None


def input_dirs(config: RunConfig, run_dir: str | Path, stage_name: str, *, upstream: str) -> list[Path]:
    """The stage directories a training stage reads: its records upstream, the stage whose model it
    starts from, and prepare when a dev task uses prepare's dev records."""
    run_dir = Path(run_dir)
    stage = get_stage(config, stage_name)[1]
    out = [run_dir / upstream, *start_model_dirs(config, run_dir, stage_name)]
    if stage.merge is not None and run_dir / instance_name(stage.merge.stage) not in out:
        out.append(run_dir / instance_name(stage.merge.stage))
    if stage.dev is not None and any(task.dataset for task in stage.dev.tasks):
        out.append(run_dir / "prepare")
    return out


def start_model_dirs(config: RunConfig, run_dir: str | Path, stage_name: str) -> list[Path]:
    """The stage directory of the model training stage ``stage_name`` starts from: the earlier
    stage's, or the one that trained the base model; none for a packaged or plain base model."""
    index, stage = get_stage(config, stage_name)
    prev = _init_stage(config, index, stage)
    if prev is not None:
        return [Path(run_dir) / instance_name(prev.name)]
    trained = model_artifact_dir(_cfg(config).base_model, run_dir)  # a base model another stage (or run) trained
    return [trained] if trained is not None else []


def start_model_path(config: RunConfig, run_dir: str | Path, stage_name: str) -> str:
    """The model training stage ``stage_name`` starts from (its re-mining step mines with it)."""
    index, stage = get_stage(config, stage_name)
    return init_model_path(config, Path(run_dir), index, stage)


def init_model_path(config: RunConfig, run_dir: Path, index: int, stage: TrainStageConfig) -> str:
    prev = _init_stage(config, index, stage)
    if prev is None:
        return resolve_model_path(_cfg(config).base_model)
    path = run_dir / instance_name(prev.name) / "model"
    if not (path / "config.json").exists():
        raise EmbedpipeError(f"{path}: stage {stage.name} starts from stage {prev.name}'s model — run that stage first")
    return str(path)


def _dataset_task(path: Path) -> str | None:
    import pyarrow.parquet as pq

    column = pq.read_table(path, columns=["task"]).column("task")
    return column[0].as_py() if len(column) else None


def _used_outputs(stage_path: Path, manifest: dict[str, Any], stage: TrainStageConfig) -> dict[str, str]:
    """Hashes of the upstream record files this stage trains on (a change elsewhere — e.g. an STS
    source for a retrieval-only stage 1 — leaves the stage a cache hit)."""
    used = {}
    for name, info in manifest["outputs"].items():
        if info.get("kind") != "records":
            continue
        dataset = name.removesuffix(".parquet")
        if stage.datasets is not None and dataset not in stage.datasets:
            continue
        task = _dataset_task(stage_path / name)
        if task is None or task not in TRAINABLE_TASKS or (stage.tasks is not None and task not in stage.tasks):
            continue
        used[name] = info["sha256"]
    return used


# Libraries whose versions are part of this stage's code identity (embed_core.fingerprint).
LIBRARIES = ("torch", "transformers", "deepspeed", "peft", "numpy")


def input_fingerprint(config: RunConfig, run_dir: str | Path, stage_name: str, *, upstream: str) -> Fingerprint:
    run_dir = Path(run_dir)
    cfg = _cfg(config)
    index, stage = get_stage(config, stage_name)
    up = read_manifest(run_dir, upstream)
    if up is None:
        raise EmbedpipeError(f"{run_dir / upstream}: no manifest.json — run the earlier stages first")
    prev = _init_stage(config, index, stage)
    init = ({"base": model_fingerprint(cfg.base_model, cfg.pooling, cfg.max_length, False)} if prev is None
            else _stage_model_hashes(run_dir, prev.name))
    return Fingerprint.of(instance_name(stage.name), __name__, LIBRARIES, {
        # batch_size is per process: the global batch, and so the model, depends on how many train
        "processes": training_processes(cfg),
        "upstream": _used_outputs(run_dir / upstream, up, stage),
        "train": config_hash(cfg.model_copy(update={"stages": [], "work_pool": None, "processes": "auto"})), "stage": config_hash(stage), "init": init,
        "dev": _dev_inputs(config, run_dir, stage), "seed": config.seed,
        **({"merge": _stage_model_hashes(run_dir, stage.merge.stage)} if stage.merge is not None else {})})


def _stage_model_hashes(run_dir: Path, stage_name: str) -> dict[str, Any]:
    """A trained stage's model, by its files' hashes (not its metrics, whose timings differ between
    identical runs)."""
    man = read_manifest(run_dir, instance_name(stage_name))
    return {"stage": stage_name, "model": {n: i["sha256"] for n, i in man["outputs"].items() if n.startswith("model/")}
            if man else "missing"}


def _dev_inputs(config: RunConfig, run_dir: Path, stage: TrainStageConfig) -> dict[str, str]:
    """Hashes of what the dev tasks read and run (with select: best they decide which weights are
    kept): prepare's dev records of their datasets, their files, and the dev evaluation's code with
    the scoring libraries' versions (``embed_core.train.dev`` is a leaf of this stage's code walk)."""
    if stage.dev is None:
        return {}
    from embed_core.scoring.config import SCORING_LIBRARIES
    from embed_core.fingerprint import sha256_file

    out: dict[str, str] = {"code": code_identity("embed_core.train.dev", SCORING_LIBRARIES)}
    prepared = read_manifest(run_dir, "prepare") or {"outputs": {}}
    for task in stage.dev.tasks:
        if task.dataset:
            info = prepared["outputs"].get(f"dev/{task.dataset}.parquet")
            out[f"{task.name}:dev/{task.dataset}"] = info["sha256"] if info else "missing"
            continue
        paths = [task.path] if isinstance(task.path, str) else list(task.path)
        for path in [*paths, *([task.train_path] if task.train_path else [])]:
            resolved = config.resolve(path)
            files = files_within(resolved) if resolved.is_dir() else [resolved]
            for f in files:
                out[f"{task.name}:{f.name}"] = sha256_file(f) if f.is_file() else "missing"
    return out


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


def _instructions(datasets: dict[str, DatasetRecords]) -> tuple[dict[str, str], dict[str, str]]:
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


def _plot(rows: list[dict[str, Any]], dev_rows: list[dict[str, Any]] | None = None,
          best: dict[str, Any] | None = None) -> bytes:
    """Training loss per task; gradient norm and peak memory (with MFU where the device's peak is
    known); with dev evaluation, a third panel with the dev scores per task, the selection score
    and the step whose weights were kept."""
    plt = pyplot()
    panels = 3 if dev_rows else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.5), squeeze=False)
    ax = axes[0][0]
    for task in sorted({r["task"] for r in rows}):
        pts = [(r["step"], r["loss"]) for r in rows if r["task"] == task]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", markersize=2, linewidth=0.8, label=task)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    _plot_telemetry(axes[0][1], rows)
    if dev_rows:
        ax = axes[0][2]
        for task in dict.fromkeys(r["task"] for r in dev_rows):
            pts = [(r["step"], r["score"]) for r in dev_rows if r["task"] == task]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", markersize=3, linewidth=0.8, label=task)
        steps = sorted({r["step"]: r["selection"] for r in dev_rows}.items())
        ax.plot([s for s, _ in steps], [v for _, v in steps], "k--", linewidth=1, label="selection")
        if best:
            ax.axvline(best["step"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("step")
        ax.set_ylabel("dev main score")
        ax.legend(fontsize=8)
    return to_png(fig)


def _plot_telemetry(ax, rows: list[dict[str, Any]]) -> None:
    """Gradient norm (left axis) and peak memory in MB (right axis) per step, MFU in the title."""
    steps = {r["step"]: r for r in rows}  # one point per optimizer step
    xs = sorted(steps)
    norms = [(x, steps[x].get("grad_norm")) for x in xs if steps[x].get("grad_norm") is not None]
    ax.plot([x for x, _ in norms], [v for _, v in norms], ".-", markersize=2, linewidth=0.8, color="C0")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm", color="C0")
    right = ax.twinx()
    mem = [(x, steps[x].get("peak_memory_mb")) for x in xs if steps[x].get("peak_memory_mb") is not None]
    right.plot([x for x, _ in mem], [v for _, v in mem], "-", linewidth=0.8, color="C3")
    right.set_ylabel("peak memory (MB)", color="C3")
    mfu = [steps[x]["mfu"] for x in xs if steps[x].get("mfu") is not None]
    if mfu:
        ax.set_title(f"MFU {100 * sum(mfu) / len(mfu):.1f} % (mean over steps)", fontsize=9)


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


def run_train_stage(config: RunConfig, run_dir: str | Path, stage_name: str, *, upstream: str, resume: bool = False,
                    fingerprint: Fingerprint | None = None) -> dict[str, Any]:
    """Train the configured stage ``stage_name`` on the records of ``upstream`` (a stage directory)
    and commit ``train-<stage>/``; every rank of a launched run calls it, rank 0 writes. Not
    launched, it starts ``train.processes`` local ranks itself (``embed_core.dist.spawn``)."""
    with local_ranks(config, Path(run_dir), stage_name, body=run_train_stage, upstream=upstream, resume=resume):
        return _run_train_stage(config, Path(run_dir), stage_name, upstream=upstream, resume=resume,
                                fingerprint=fingerprint)


def _run_train_stage(config: RunConfig, run_dir: Path, stage_name: str, *, upstream: str, resume: bool,
                     fingerprint: Fingerprint | None) -> dict[str, Any]:
    index, stage = get_stage(config, stage_name)
    t0 = time.perf_counter()
    # under torchrun / deepspeed / accelerate launch or local_ranks: every rank runs this function
    init_process_group(timeout_s=_cfg(config).dist_timeout_s)
    check_shared_directory(run_dir / "checkpoints", stage_name)  # every node sees what rank 0 writes
    fingerprint = fingerprint or input_fingerprint(config, run_dir, stage_name, upstream=upstream)
    ckpt_dir = _checkpoint_dir(run_dir, stage, fingerprint)
    datasets = load_datasets(run_dir, stage, upstream, ckpt_dir / RECORDS_DIR)
    init = init_model_path(config, run_dir, index, stage)
    trainer, instructions = _trainer(config, run_dir, stage, datasets, init, ckpt_dir)
    metrics = trainer.fit(resume=resume)
    state = trainer.consolidated_state() if hasattr(trainer, "consolidated_state") else None  # every rank: FSDP gathers

    def commit() -> dict[str, Any]:
        weights = state.items() if state is not None else trainer.model.state_dict().items()
        check_finite_weights(stage.name, weights, metrics, trainer.step)
        manifest = _commit(config, run_dir, stage, datasets, init, trainer, metrics, instructions, fingerprint, t0,
                           state, lineage=_lineage(run_dir, upstream, stage, datasets, trainer))
        shutil.rmtree(ckpt_dir, ignore_errors=True)  # the committed artifact supersedes the checkpoints
        return manifest

    # rank 0 writes the stage (and merges); the others wait, however long that takes, and read it
    return on_main_rank(instance_name(stage.name), commit,
                        lambda: committed(run_dir, instance_name(stage.name), fingerprint.key))


def _checkpoint_dir(run_dir: Path, stage: TrainStageConfig, fingerprint: Fingerprint) -> Path:
    """The stage's checkpoint directory, emptied when its checkpoints are of other inputs."""
    ckpt_dir = run_dir / "checkpoints" / stage.name
    marker = ckpt_dir / "input_fingerprint"
    if is_main_process():
        if ckpt_dir.exists() and (file_problem(marker) is not None or marker.read_text() != fingerprint.key):
            shutil.rmtree(ckpt_dir)  # checkpoints of other inputs must never be resumed
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(fingerprint.key)
    barrier()  # every rank sees the same checkpoints to resume from
    return ckpt_dir


def _trainer(config: RunConfig, run_dir: Path, stage: TrainStageConfig, datasets: dict[str, DatasetRecords],
             init: str, ckpt_dir: Path) -> tuple[Any, tuple[dict[str, str], dict[str, str]]]:
    """The stage's trainer (contrastive, with its dev evaluator on rank 0, or AutoRegEmbed) and the
    instructions it trains with."""
    from embed_core.train.engine.trainer import Trainer

    cfg = _cfg(config)
    instructions, task_instructions = _instructions(datasets)
    if stage.mode != "contrastive":
        if stage.dev is not None:
            raise ConfigError(f"train stage {stage.name}: dev evaluation is for contrastive stages, not {stage.mode}")
        return _autoregembed_trainer(config, run_dir, stage, datasets, init, ckpt_dir), (instructions, task_instructions)
    trainer = Trainer(cfg, stage, datasets, init_model=init, checkpoint_dir=ckpt_dir, seed=config.seed, log=log.info)
    if stage.dev is not None and (is_main_process() or cfg.sharding == "fsdp"):  # FSDP: every rank encodes
        from embed_core.train.dev import DevEvaluator

        settings = ModelSettings(
            pooling=cfg.pooling, max_length=cfg.max_length, use_instructions=cfg.use_instructions,
            instruction_template=cfg.instruction_template, instructions=instructions,
            task_instructions=task_instructions, source="training")
        work = ckpt_dir / ("dev-data" if is_main_process() else f"dev-data-rank{trainer.rank}")
        trainer.dev_evaluator = DevEvaluator(stage.dev, config, run_dir, work, settings)
    return trainer, (instructions, task_instructions)


def _stage_counts(stage: TrainStageConfig, trainer, rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts = {"steps": trainer.step, "examples": sum(r["examples"] for r in rows),
              "tokens": sum(r["tokens"] for r in rows), "final_loss": rows[-1]["loss"] if rows else None}
    if getattr(trainer, "dev_rows", None):
        counts["selected_step"] = trainer.best["step"] if stage.dev.select == "best" else trainer.step
        counts["selected_dev_score"] = trainer.best["score"] if stage.dev.select == "best" else \
            trainer.dev_rows[-1]["selection"]
    return counts


def _save_model(config: RunConfig, stage: TrainStageConfig, datasets: dict[str, DatasetRecords], init: str,
                trainer, instructions: tuple[dict[str, str], dict[str, str]], model_dir: Path,
                state: dict[str, Any] | None = None) -> None:
    """The committed model; ``state``: its weights gathered from the shards (FSDP), else its own."""
    cfg = _cfg(config)
    by_dataset, by_task = instructions
    training = {"training": {"run_name": config.run_name, "stage": stage.model_dump(mode="json"),
                             "train": cfg.model_dump(mode="json", exclude={"stages"}), "init_model": init,
                             "seed": config.seed}}
    mrl = cfg.matryoshka_of(stage)
    if mrl is not None:  # the trained prefix dimensions: a user may cut the embedding to any of them
        training["matryoshka"] = {"dims": list(mrl.dims), "weights": list(mrl.weights)}
    if stage.mode == "contrastive":
        trainer.model.save(model_dir, instructions=by_dataset, task_instructions=by_task,
                           use_instructions=cfg.use_instructions, extra=training, state_dict=state,
                           retrieval_datasets=[n for n in by_dataset if datasets[n].task == "retrieval"])
        if state and {str(v.dtype) for v in state.values() if v.is_floating_point()} == {"torch.bfloat16"}:
            from embed_core.model.files import set_config_dtype

            set_config_dtype(model_dir, "bfloat16")  # train.save_dtype: config.json says what the file holds
    else:
        arc = cfg.autoregembed
        trainer.model.save(model_dir, extra=training, task_instructions={
            "sts": arc.sts_instruction, "nli": arc.sts_instruction, "classification": arc.sts_instruction,
            "pair_classification": arc.sts_instruction, "retrieval": arc.query_instruction,
            "retrieval_passage": arc.passage_instruction})


def _commit(config: RunConfig, run_dir: Path, stage: TrainStageConfig, datasets: dict[str, DatasetRecords], init: str,
            trainer, metrics: list, instructions, fingerprint: Fingerprint, t0: float,
            state: dict[str, Any] | None = None, lineage: pa.Table | None = None) -> dict[str, Any]:
    """Rank 0: the model with its card, metrics, dev scores, loss plot and lineage (the records each
    step consumed), committed as ``train-<stage>/``."""
    cfg = _cfg(config)
    sizes = {n: d.size for n, d in datasets.items()}
    weights = dataset_weights(sizes, stage.alpha, {n for n, d in datasets.items() if d.task in INFONCE_TASKS}, stage.eta,
                              stage.dataset_weight)
    rows = [{k: r.get(k) for k in METRIC_SCHEMA.names} for r in metrics]
    dataset_info = {n: {"task": d.task, "records": d.size, "weight": round(weights.get(n, 0.0), 6)}
                    for n, d in datasets.items()}
    counts = _stage_counts(stage, trainer, rows)
    if stage.mode == "contrastive":
        losses = {task: describe_loss(loss_for(task, stage.losses.get(task)))
                  for task in sorted({d.task for d in datasets.values()})}
    else:
        losses = {"autoregembed": stage.mode}
    card = card_facts(run_name=config.run_name, config_hash=config_hash(config), base_model=cfg.base_model,
                      init_model=init, stage=stage.model_dump(mode="json"), datasets=dataset_info, losses=losses,
                      counts=counts, matryoshka=cfg.matryoshka_of(stage))
    with StageWriter(run_dir, instance_name(stage.name)) as writer:
        model_dir = writer.staging / "model"
        _save_model(config, stage, datasets, init, trainer, instructions, model_dir, state)
        if stage.merge is not None:
            _merge(run_dir, stage, model_dir)
        write_card(model_dir, card, sentence_transformers_prompts(read_model_settings(model_dir)))
        writer.register_tree("model", kind="model")
        probe = _write_probe(writer, stage, datasets, trainer, model_dir, state)
        writer.write_table("metrics.parquet", pa.Table.from_pylist(rows, schema=METRIC_SCHEMA), kind="metrics")
        dev_rows = getattr(trainer, "dev_rows", [])
        selected = None
        if dev_rows:
            writer.write_table("dev.parquet", pa.Table.from_pylist(dev_rows, schema=DEV_SCHEMA), kind="metrics")
            selected = {"select": stage.dev.select, "step": trainer.best["step"] if stage.dev.select == "best"
                        else trainer.step, "best": trainer.best}
        if lineage is not None:
            writer.write_table(LINEAGE_FILE, lineage, kind="lineage")
        writer.write_file("loss.png", _plot(rows, dev_rows, trainer.best if dev_rows else None), kind="plot")
        secs = sum({r["step"]: r["seconds"] for r in rows}.values())
        return writer.commit({
            "run_name": config.run_name, "input_fingerprint": fingerprint.key, "code": fingerprint.code,
            "stage_name": stage.name,
            "init_model": init, "steps": trainer.step, "processes": getattr(trainer, "world", 1),
            "hardware": _hardware(cfg, trainer),
            "datasets": dataset_info,
            "counts": counts,
            "selected": selected,
            "merged_with": stage.merge.model_dump() if stage.merge is not None else None,
            "probe": probe,
            "timings_s": {"total": round(time.perf_counter() - t0, 3), "train_steps": round(secs, 3)},
        })


def _write_probe(writer: StageWriter, stage: TrainStageConfig, datasets: dict[str, DatasetRecords], trainer,
                 model_dir: Path, state: dict[str, Any] | None) -> dict[str, Any]:
    """``probe.npz``: the probe texts as the in-training encoder embeds them, under each of the saved
    model's prompts (``embed_core.model.probe``), for the release check. Not recorded for a sharded
    encoder (rank 0 alone cannot run it) nor for AutoRegEmbed (its encoder is not the saved layout)."""
    from embed_core.model.probe import PROBE_FILE, probe_record, probe_texts

    if stage.mode != "contrastive" or state is not None:
        return {"file": None, "reason": "autoregembed" if stage.mode != "contrastive" else "sharded encoder"}
    texts = probe_texts(datasets)
    if not texts:
        return {"file": None, "reason": "no texts"}
    blob, entry = probe_record(trainer.model, model_dir, texts)
    writer.write_file(PROBE_FILE, blob, kind="probe")
    # weights averaged with another stage's after training: the saved model is not the in-training encoder
    return {**entry, "averaged": stage.merge is not None, "lora": bool(getattr(trainer.model, "lora", None))}


def _merge(run_dir: Path, stage: TrainStageConfig, model_dir: Path) -> None:
    """The saved weights become (1 − w) × the stage's + w × ``merge.stage``'s (``embed_core.model.merge``)."""
    from embed_core.model.merge import write_average

    other = run_dir / instance_name(stage.merge.stage) / "model"
    write_average([model_dir, other], [1 - stage.merge.weight, stage.merge.weight], model_dir)
    log.info("%s: saved weights averaged with %s's (weight %.2f)", stage.name, stage.merge.stage, stage.merge.weight)


def _lineage(run_dir: Path, upstream: str, stage: TrainStageConfig, datasets: dict[str, DatasetRecords],
             trainer) -> pa.Table | None:
    """The records each step consumed (``embed_core.train.engine.lineage``), with the upstream record files
    they are rows of; None for a trainer that trains on examples derived from records (AutoRegEmbed)."""
    if not getattr(trainer, "lineage", False):
        return None
    outputs = (read_manifest(run_dir, upstream) or {"outputs": {}})["outputs"]
    files = {n: {"file": f"{n}.parquet", "sha256": outputs.get(f"{n}.parquet", {}).get("sha256"), "records": d.size}
             for n, d in datasets.items()}
    best = getattr(trainer, "best", None)
    model_step = best["step"] if best and stage.dev is not None and stage.dev.select == "best" else trainer.step
    return lineage_table(trainer.consumed, {"upstream": upstream, "datasets": files, "steps": trainer.step,
                                            "model_step": model_step, "grad_accum": stage.grad_accum,
                                            "processes": getattr(trainer, "world", 1),
                                            **({"origin_weight": stage.origin_weight} if stage.origin_weight else {})})


def _hardware(cfg, trainer) -> dict[str, Any]:
    """Where and how the stage trained, for its summary and manifest: the device (its name on
    CUDA), the compute precision, the stored weights' dtype and the sharding."""
    import torch

    device = getattr(trainer, "device", torch.device("cpu"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"device": name, "precision": "bf16 autocast" if getattr(trainer, "bf16", False) else "fp32",
            "weights": cfg.weights_dtype, "sharding": "deepspeed" if cfg.deepspeed is not None else cfg.sharding}


def _autoregembed_trainer(config: RunConfig, run_dir: Path, stage: TrainStageConfig,
                          datasets: dict[str, DatasetRecords], init: str, ckpt_dir: Path):
    from embed_core.train.engine.autoregembed.data import cda_examples, ic_examples
    from embed_core.train.engine.autoregembed.trainer import AutoRegEmbedTrainer

    cfg = _cfg(config)
    arc = cfg.autoregembed
    decoder = resolve_model_path(arc.decoder or cfg.base_model)
    if stage.mode == "autoregembed_ic":
        examples = ic_examples(datasets, arc)
    else:
        examples = cda_examples(datasets, arc, positive_level=arc.positive_level, seed=config.seed)
    trainer = AutoRegEmbedTrainer(cfg, stage, examples, init_model=init, decoder_model=decoder,
                                  checkpoint_dir=ckpt_dir, seed=config.seed, log=log.info)
    if stage.mode == "autoregembed_cda":
        trainer.reference = reference_scores(run_dir, stage, trainer, init, decoder, examples, arc)
        log.info("%s: reference scores for %d examples (%s)", stage.name, len(examples), f"reference-{stage.name}")
    return trainer


REFERENCE_SCHEMA = pa.schema([("example", pa.int64()), ("query", pa.string()), ("positive", pa.string()),
                              ("ref_pos", pa.float64()), ("ref_neg", pa.list_(pa.float64()))])


def reference_scores(run_dir: Path, stage: TrainStageConfig, trainer, init: str, decoder: str, examples: list,
                     arc) -> tuple[Any, Any]:
    """log p_ref(d⁺|e_q) and log p_ref(d⁻ᵢ|e_q) of every CDA example under the stage's initial encoder:
    read from ``reference-<stage>/`` when its key matches, else computed and written there, by rank 0
    alone (``embed_core.dist.ranks``); the other ranks read what it committed."""
    from embed_core.artifacts import stage_is_intact

    name = f"reference-{stage.name}"
    blob = json.dumps({"init": model_fingerprint(init, "compress", arc.context_max_length, False),
                       "decoder": model_fingerprint(decoder, "lm", arc.target_max_length, False),
                       "examples": hashlib.sha256(json.dumps([list(map(str, e.__dict__.values())) for e in examples])
                                                  .encode()).hexdigest(),
                       "autoregembed": config_hash(arc), "code": code_identity(__name__, LIBRARIES)}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()

    def read() -> tuple[Any, Any]:
        committed(run_dir, name, key)
        return _read_reference(run_dir / name)

    def compute() -> tuple[Any, Any]:
        if stage_is_intact(run_dir, name, key):
            return _read_reference(run_dir / name)
        return _write_reference(run_dir, name, key, stage, trainer, init, decoder, examples)

    return on_main_rank(name, compute, read)


def _read_reference(directory: Path) -> tuple[Any, Any]:
    import pyarrow.parquet as pq
    import torch

    table = pq.read_table(directory / "scores.parquet")
    return (torch.tensor(table.column("ref_pos").to_pylist(), dtype=torch.float32),
            torch.tensor(table.column("ref_neg").to_pylist(), dtype=torch.float32))


def _write_reference(run_dir: Path, name: str, key: str, stage: TrainStageConfig, trainer, init: str, decoder: str,
                     examples: list) -> tuple[Any, Any]:
    """Rank 0: the reference scores computed with the trainer's (initial) encoder and committed."""
    t0 = time.perf_counter()
    ref_pos, ref_neg = trainer.reference_scores()
    table = pa.Table.from_pylist([{"example": i, "query": e.query, "positive": e.positive, "ref_pos": float(p),
                                   "ref_neg": [float(x) for x in n]}
                                  for i, (e, p, n) in enumerate(zip(examples, ref_pos, ref_neg))], schema=REFERENCE_SCHEMA)
    with StageWriter(run_dir, name) as writer:
        writer.write_table("scores.parquet", table, kind="reference_scores")
        writer.commit({"input_fingerprint": key, "stage_name": stage.name, "init_model": init, "decoder": decoder,
                       "counts": {"examples": len(examples), "negatives": int(ref_neg.shape[1])},
                       "timings_s": {"total": round(time.perf_counter() - t0, 3)}})
    return ref_pos, ref_neg

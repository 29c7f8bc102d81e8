"""The evaluate stage's body (declared in ``stage.py``): MTEB on local task data for the base model and the run's trained models.

Writes ``<run_dir>/evaluate/``:
* ``results.parquet`` — one row per (model, task, split, subset, metric) with every scalar mteb
  reports, ``main`` marking the task's main score; metrics are mteb's own;
* ``results/embedpipe__<model label>/<model fingerprint>/`` — mteb's own result cache layout
  (``<task>.json``, ``model_meta.json``, ``run_settings.jsonl``): ``mteb.ResultCache(<run_dir>/evaluate)
  .load_results(require_model_meta=True)`` and mteb's tooling read it;
* ``sizes.parquet`` — with ``evaluate.dims`` / ``precisions`` (or a model's trained Matryoshka dims): one row per
  (model, task, dim, precision, rescore) with the main score and the bytes per vector
  (``embed_core.evaluate.sizes``);
* ``report.md`` and ``plots/*.png`` (see ``embed_core.evaluate.report``);
* ``model/`` — the release: the run's final trained model (hard links to the train stage's files)
  with its model card (README.md) completed by the evaluation table, ready for
  ``SentenceTransformer("<run_dir>/evaluate/model")`` or an upload to the Hub;
* ``manifest.json`` — models (path, fingerprint, settings), tasks, texts encoded, timings.

Results accumulate: evaluating another model keeps the other models' rows from the previous
evaluate artifact, and re-evaluating a model replaces its rows. Embeddings are cached per model
fingerprint (shared with mine): the run's trained models in ``<run_dir>/cache/embeddings/``, the base
model and other fixed models machine-wide, so a rerun or a fresh run directory encodes nothing again.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from embed_core import numbers
from embed_core.artifacts import StageWriter, model_artifact_dir, read_manifest, stage_is_intact
from embed_core.config import RunConfig, config_hash
from embed_core.evaluate.config import EvaluateConfig
from embed_core.scoring.config import SCORING_LIBRARIES, EvalTaskSpec
from embed_core.evaluate.release import check_release, release_section
from embed_core.scoring.tasks import check_main_score
from embed_core.model.config import EngineConfig
from embed_core.engine import engine_session
from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.fingerprint import Fingerprint, sha256_file
from embed_core.manifests import EvaluateManifest, Manifest, TrainManifest
from embed_core.model.card import CARD_FACTS, read_card_facts, write_card
from embed_core.model.embedding_cache import cache_location
from embed_core.model.encoder import model_fingerprint, resolve_model_path, uses_bf16
from embed_core.evaluate.stage import NAME as STAGE
from embed_core.model.settings import read_model_settings, sentence_transformers_prompts
from embed_core.paths import files_within, resolve_within
from embed_core.stage_dirs import instance_name, stage_name_of, trained_model_dirs

log = logging.getLogger("embedpipe.evaluate")
# Libraries whose versions are part of this stage's code identity (embed_core.fingerprint).
LIBRARIES = SCORING_LIBRARIES
RESULTS = "results.parquet"
GEOMETRY = "geometry.parquet"
RESULT_SCHEMA = pa.schema([
    ("model", pa.string()), ("model_path", pa.string()), ("fingerprint", pa.string()),
    ("task", pa.string()), ("task_type", pa.string()), ("split", pa.string()), ("subset", pa.string()),
    ("metric", pa.string()), ("value", pa.float64()), ("main", pa.bool_()),
])
SIZES = "sizes.parquet"  # scores by embedding size and precision (embed_core.evaluate.sizes); report.SIZES_FILE
SIZE_SCHEMA = pa.schema([
    ("model", pa.string()), ("task", pa.string()), ("task_type", pa.string()), ("metric", pa.string()),
    ("dim", pa.int64()), ("precision", pa.string()), ("rescore", pa.int64()),
    ("rescore_with", pa.string()), ("bytes_per_vector", pa.int64()),
    ("value", pa.float64()),
])


def _cfg(config: RunConfig) -> EvaluateConfig:
    if config.evaluate is None:
        raise ConfigError("the run config has no 'evaluate' section")
    return config.evaluate


def trained_models(run_dir: Path, config: RunConfig | None = None) -> dict[str, str]:
    """label -> model directory for every finished train stage in the run, in stage order
    (``<run_dir>/train-<stage>/model``, labelled by the stage name); with ``config``, only its train
    stages (not, e.g., the variants a sweep trained into the same run directory)."""
    wanted = {instance_name(s.name) for s in config.train.stages} if config is not None and config.train else None
    found: dict[str, tuple[float, str]] = {}
    for model_dir in trained_model_dirs(run_dir):
        if wanted is not None and model_dir.parent.name not in wanted:
            continue
        if (model_dir / "config.json").exists() and (model_dir.parent / "manifest.json").exists():
            files_within(model_dir)  # a link out of the model directory is refused before anything reads it
            found[stage_name_of(model_dir.parent.name)] = ((model_dir.parent / "manifest.json").stat().st_mtime,
                                                           str(model_dir))
    return {label: path for label, (_, path) in sorted(found.items(), key=lambda kv: kv[1][0])}


def default_models(cfg) -> list[str]:
    """What evaluate scores when no model is named (``--model``): the config's ``evaluate.models``,
    else the base model and every trained stage's model. The one answer for the pipeline,
    ``embedpipe evaluate`` and the ``embedpipe-evaluate`` deployment, so a rerun of evaluate alone
    scores what the pipeline would and ``status`` stays fresh."""
    return list(cfg.models) if cfg.models else ["base", "trained"]


def resolve_models(config: RunConfig, run_dir: Path, models: list[str] | None = None, *,
                   materialize: bool = True) -> dict[str, str]:
    """label -> local model path for 'base', 'trained' and explicit paths (``materialize=False``:
    model names as given, for fingerprints that must not de-quantise a GGUF model)."""
    cfg = _cfg(config)
    resolve = resolve_model_path if materialize else str
    out: dict[str, str] = {}
    for item in models or default_models(cfg):
        if item == "base":
            out["base"] = resolve(cfg.base_model)
        elif item == "trained":
            out.update(trained_models(run_dir, config))
        else:
            path = resolve(item)
            p = Path(path)
            # a train stage's <run>/train-<stage>/model is labelled by its stage
            out[stage_name_of(p.parent.name) if p.name == "model" else (p.name or "model")] = path
    if not out:
        raise ConfigError("evaluate: no model to evaluate (no trained checkpoint in the run yet?)")
    return out


def input_dirs(config: RunConfig, run_dir: str | Path, models: list[str] | None = None) -> list[Path]:
    """The stage directories holding the trained models to evaluate ('trained': the config's train
    stages that have run; a model path whose directory has a manifest beside it): each is checked
    against its manifest before anything is scored or released."""
    run_dir = Path(run_dir)
    cfg = _cfg(config)
    dirs: list[Path] = []
    for item in models or default_models(cfg):
        if item == "trained":
            names = [instance_name(s.name) for s in config.train.stages] if config.train else \
                [p.parent.name for p in trained_model_dirs(run_dir)]
            dirs += [run_dir / n for n in names if (run_dir / n / "manifest.json").is_file()]
            continue
        trained = model_artifact_dir(cfg.base_model if item == "base" else item, run_dir)
        dirs += [trained] if trained is not None else []
    return dirs


def select_tasks(cfg: EvaluateConfig, names: list[str] | None) -> list[EvalTaskSpec]:
    if not names:
        return list(cfg.tasks)
    known = {t.name: t for t in cfg.tasks}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"evaluate: unknown task {unknown[0]!r}; configured: {', '.join(known)}")
    return [known[n] for n in names]


def data_files(config: RunConfig, spec: EvalTaskSpec) -> list[Path]:
    """Every local file a task reads (its data, its classifier's train file), folders walked."""
    paths = spec.path if isinstance(spec.path, list) else [spec.path]
    files = [config.resolve(p) for p in paths]
    if spec.train_path:
        files.append(config.resolve(spec.train_path))
    out: list[Path] = []
    for f in files:
        out.extend(files_within(f) if f.is_dir() else [f])
    return out


def model_precision(precision: str, path: str) -> str:
    """The precision a model is encoded in: ``evaluate.precision``, or for ``trained`` the one its
    train stage computed in (its manifest's ``hardware.precision``): a model trained under bf16
    autocast is encoded as ``auto`` (bf16 where this device has it natively, CUDA or AMX /
    AVX512-BF16, else fp32: emulated bf16 is several times slower), any other model (trained in
    fp32, the base model, a path without a train manifest) in fp32."""
    if precision != "trained":
        return precision
    stage = Path(path).parent
    manifest = read_manifest(stage.parent, stage.name) if (stage / "manifest.json").is_file() else None
    trained = ((manifest or {}).get("hardware") or {}).get("precision", "")
    return "auto" if str(trained).startswith("bf16") else "fp32"


def task_data_hashes(config: RunConfig, specs: list[EvalTaskSpec]) -> dict[str, dict[str, str]]:
    """task -> {file: sha256 or "missing"}, each file keyed by its path under data_root, so the same
    data keys the same whether data_root is written relative (a config) or absolute (the run
    directory's config.yaml)."""
    root = Path(config.data_root).expanduser()
    return {s.name: {(str(f.relative_to(root)) if f.is_relative_to(root) else str(f)): sha256_file(f) if f.exists()
                     else "missing" for f in data_files(config, s)} for s in specs}


def _model_fp(path: str, precision: str) -> str:
    import torch

    settings = read_model_settings(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return model_fingerprint(path, settings.pooling, settings.max_length,
                             uses_bf16(model_precision(precision, path), device))


def input_fingerprint(config: RunConfig, run_dir: str | Path, models: list[str] | None = None,
                      tasks: list[str] | None = None) -> Fingerprint:
    """Model fingerprints + task specs + data file hashes + code identity (mteb's version included)."""
    cfg = _cfg(config)
    resolved = resolve_models(config, Path(run_dir), models, materialize=False)
    specs = select_tasks(cfg, tasks)
    data = task_data_hashes(config, specs)
    fps = {label: _model_fp(path, cfg.precision) for label, path in resolved.items()}
    return Fingerprint.of(STAGE, __name__, LIBRARIES, {
        "models": fps, "tasks": [s.model_dump(mode="json") for s in specs], "data": data,
        "config": config_hash(cfg.model_copy(update={"engine": EngineConfig()})),  # any engine: the same scores
        "seed": config.seed}, details={"models": fps})


def _scalar_rows(task_result, metadata, label: str, path: str, fingerprint: str) -> list[dict[str, Any]]:
    """Every scalar metric mteb reported, one row each; ``main`` marks the task's main score."""
    rows = []
    main_name = metadata.main_score
    for split, subsets in task_result.scores.items():
        for scores in subsets:
            base = {"model": label, "model_path": path, "fingerprint": fingerprint, "task": task_result.task_name,
                    "task_type": metadata.type, "split": split, "subset": scores.get("hf_subset", "default")}
            metrics = {k: float(v) for k, v in scores.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "main_score"}
            if main_name not in metrics and "main_score" in scores:
                metrics[main_name] = float(scores["main_score"])
            if main_name in metrics:
                check_main_score(task_result.task_name, main_name, metrics[main_name])
            rows += [{**base, "metric": k, "value": v, "main": k == main_name} for k, v in metrics.items()]
    return rows


def guard_task_names(config: RunConfig) -> list[str]:
    """The tasks scored first (``order_tasks``): the release gate's guard tasks, else every configured
    task, in the config's order."""
    guards = config.release.guard_tasks if config.release is not None else None
    return list(guards or [t.name for t in _cfg(config).tasks])


def evaluate_model(label: str, path: str, specs: list[EvalTaskSpec], config: RunConfig, run_dir: Path,
                   first: list[str] | None = None):
    """Run mteb on ``specs`` for one model; returns (result rows, mteb TaskResults, the model's mteb
    ModelMeta, stats, rows of the sizes table (empty without evaluate.dims / precisions to score)).
    The tasks named in ``first`` (default ``guard_task_names``; those among ``specs``) are encoded
    and scored first, then the others; each group's texts are encoded before mteb scores it, every
    distinct text once, longest first (``EvalModel.prefetch``)."""
    from embed_core.scoring.model import EvalModel
    from embed_core.evaluate.sizes import sizes_of
    from embed_core.scoring.requests import order_tasks
    from embed_core.scoring.tasks import build_task

    cfg = _cfg(config)
    root, max_bytes = cache_location(path, run_dir, config.embedding_cache)
    model = EvalModel(path, label=label, cache_root=root, batch_size=cfg.batch_size,
                      precision=model_precision(cfg.precision, path), cache_max_bytes=max_bytes, engine=cfg.engine)
    sizes = sizes_of(cfg.dims, model.settings.matryoshka_dims, model.dim, label)
    names = {s.name for s in specs}
    guard = [n for n in (guard_task_names(config) if first is None else first) if n in names]
    ordered = order_tasks(specs, guard)
    out: dict[str, Any] = {"path": path, "rows": [], "size_rows": [], "task_results": [], "seconds": {}, "prefetched": 0}
    for group in (ordered[:len(guard)], ordered[len(guard):]):
        t0 = time.perf_counter()
        tasks = {spec.name: build_task(spec, config.resolve, seed=config.seed) for spec in group}
        prefetched = model.prefetch(list(tasks.values()))
        out["prefetched"] += prefetched
        if group:
            log.info("evaluate %s: %d texts of %s encoded (%.1f s)", label, prefetched, ", ".join(tasks),
                     time.perf_counter() - t0)
        for spec in group:
            _score_task(model, spec, tasks[spec.name], sizes, cfg, out)
    stats = {"label": label, "path": path, "fingerprint": model.fingerprint,
             "settings": {"pooling": model.settings.pooling, "max_length": model.settings.max_length,
                          "use_instructions": model.settings.use_instructions, "source": model.settings.source},
             "texts_encoded": model.texts_encoded, "texts_prefetched": out["prefetched"],
             "texts_missed_by_prefetch": model.scoring_misses, "cache_size": len(model.cache),
             "task_order": [s.name for s in ordered], "seconds": out["seconds"]}
    return out["rows"], out["task_results"], model.mteb_model_meta, stats, out["size_rows"]


def _score_task(model, spec: EvalTaskSpec, task, sizes: list[int], cfg: EvaluateConfig, out: dict[str, Any]) -> None:
    """mteb's scores of one task (and its sizes-table rows), appended to ``out``."""
    import mteb

    t0 = time.perf_counter()
    scored_sizes = len(sizes) > 1 or list(cfg.precisions) != ["float32"]
    model.recorded = [] if scored_sizes else None
    result = mteb.evaluate(model, task, cache=None, overwrite_strategy="always", show_progress_bar=False)
    rows = []
    for task_result in result.task_results:
        rows += _scalar_rows(task_result, task.metadata, model.label, out["path"], model.fingerprint)
        out["task_results"].append(task_result)
    out["rows"] += rows
    main = [r for r in rows if r["task"] == spec.name and r["main"]]
    if scored_sizes and main:
        out["size_rows"] += _size_rows(model, task, main[0], sizes, cfg)
    model.recorded = None
    task.unload_data()  # loaded by the prefetch, kept for the sizes' evaluations
    out["seconds"][spec.name] = round(time.perf_counter() - t0, 2)
    log.info("evaluate %s on %s: %s = %s (%.1f s)", model.label, spec.name, task.metadata.main_score,
             numbers.score(main[0]["value"] if main else None), out["seconds"][spec.name])


def _size_rows(model, task, main: dict[str, Any], sizes: list[int], cfg: EvaluateConfig) -> list[dict[str, Any]]:
    """The sizes table's rows of one model and task (``embed_core.evaluate.sizes``): the full float32
    row is the task's main score, every other variant is scored again on the same embeddings."""
    import numpy as np

    from embed_core.evaluate.sizes import bytes_per_vector, score_variant, variants

    recorded = np.concatenate(model.recorded) if model.recorded else None
    out = []
    for variant in variants(sizes, list(cfg.precisions), cfg.rescore_multiplier, task.metadata.type == "Retrieval"):
        dim, precision, rescore = variant
        value = main["value"] if variant == (sizes[0], "float32", 0) else \
            check_main_score(main["task"], main["metric"], score_variant(model, task, variant, recorded,
                                                                         cfg.rescore_with, cfg.rescore_top_k))
        out.append({"model": main["model"], "task": main["task"], "task_type": main["task_type"],
                    "metric": main["metric"], "dim": dim, "precision": precision, "rescore": rescore,
                    "rescore_with": cfg.rescore_with if rescore else None,
                    "bytes_per_vector": bytes_per_vector(dim, precision), "value": value})
        log.info("evaluate %s on %s at %d dims, %s%s: %s", main["model"], main["task"], dim, precision,
                 f" rescored ×{rescore} with {cfg.rescore_with}" if rescore else "", numbers.score(value))
    return out


MTEB_RESULTS = "results"  # mteb's ResultCache keeps results under <cache_path>/results/


def _previous(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
    """Rows and mteb result-cache files of the current evaluate artifact (if intact), to carry over."""
    if not stage_is_intact(run_dir, STAGE):
        return [], {}
    stage_dir = run_dir / STAGE
    names = list(Manifest.read(run_dir, STAGE).outputs)  # only what the manifest lists, never a link out
    rows = pq.read_table(resolve_within(stage_dir, RESULTS)).to_pylist() if RESULTS in names else []
    files = {name: resolve_within(stage_dir, name).read_bytes() for name in names
             if Path(name).parts[0] == MTEB_RESULTS}
    return rows, files


def _previous_sizes(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of the current evaluate artifact's sizes table (if intact and it has one)."""
    if not stage_is_intact(run_dir, STAGE) or SIZES not in Manifest.read(run_dir, STAGE).outputs:
        return []
    return pq.read_table(resolve_within(run_dir / STAGE, SIZES)).to_pylist()


def _carried(files: dict[str, bytes], metas: dict[str, Any], task_names: set[str]) -> dict[str, bytes]:
    """Previous result-cache files that stay: other models', and an evaluated model's other tasks
    when its fingerprint (mteb revision) is unchanged."""
    out = {}
    for name, blob in files.items():
        parts = Path(name).parts  # results/<model as path>/<revision>/<file>
        meta = next((m for m in metas.values() if m.model_name_as_path() == parts[1]), None)
        if meta is not None and (parts[2] != meta.revision or Path(name).stem in task_names):
            continue
        out[name] = blob
    return out


def model_geometries(config: RunConfig, models: dict[str, str]) -> list[dict[str, Any]]:
    """Token geometry (CoDiEmb §4) of every model on the configured STS task's sentences."""
    from embed_core.scoring.data import _read_pairs
    from embed_core.evaluate.geometry import model_geometry

    geo = _cfg(config).geometry
    if geo is None:
        return []
    spec = next(t for t in _cfg(config).tasks if t.name == geo.task)
    texts = list(dict.fromkeys(t for row in _read_pairs(spec, config.resolve) for t in (row["sentence1"], row["sentence2"])))
    texts = texts[:geo.max_texts]
    out = []
    for label, path in models.items():
        t0 = time.perf_counter()
        stats = model_geometry(path, texts, max_length=geo.max_length)
        log.info("geometry %s: %s (%.1f s)", label, stats, time.perf_counter() - t0)
        out.append({"model": label, "task": geo.task, **stats})
    return out


def run_evaluate(config: RunConfig, run_dir: str | Path, models: list[str] | None = None,
                 tasks: list[str] | None = None, fingerprint: Fingerprint | None = None) -> dict[str, Any]:
    import mteb

    from embed_core.evaluate.report import build_report

    cfg = _cfg(config)
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    fingerprint = fingerprint or input_fingerprint(config, run_dir, models, tasks)
    resolved = resolve_models(config, run_dir, models)
    specs = select_tasks(cfg, tasks)

    old_rows, old_files = _previous(run_dir)
    evaluated = set(resolved)
    task_names = {s.name for s in specs}
    rows = [r for r in old_rows if not (r["model"] in evaluated and r["task"] in task_names)]
    # the sizes table accumulates like the results: re-evaluated (model, task) pairs are replaced
    size_rows = [r for r in _previous_sizes(run_dir) if not (r["model"] in evaluated and r["task"] in task_names)]
    model_stats = []
    new_results: list[tuple[Any, Any]] = []
    metas: dict[str, Any] = {}
    with engine_session(cfg.engine):  # engine: ray starts (and stops) a local Ray instance once for all models
        for label, path in resolved.items():
            new_rows, task_results, metas[label], stats, new_sizes = evaluate_model(label, path, specs, config, run_dir)
            rows += new_rows
            size_rows += new_sizes
            new_results += [(metas[label], r) for r in task_results]
            model_stats.append(stats)
    files = _carried(old_files, metas, task_names)

    table = pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)
    geometry = model_geometries(config, resolved)
    previous_geo = Path(run_dir) / STAGE / GEOMETRY
    if geometry and previous_geo.exists():  # like the scores: other models' rows stay
        geometry = [g for g in pq.read_table(previous_geo).to_pylist() if g["model"] not in evaluated] + geometry
    report_md, plots = build_report(table, run_dir=run_dir, title=f"embedpipe evaluation: {config.run_name}",
                                    geometry=geometry, sizes=size_rows)
    with StageWriter(run_dir, STAGE, EvaluateManifest, fingerprint=fingerprint, run_name=config.run_name) as writer:
        writer.write_table(RESULTS, table, kind="results")
        for name, blob in sorted(files.items()):
            writer.write_file(name, blob, kind="mteb_result")
        cache = mteb.ResultCache(writer.staging)
        for meta, task_result in new_results:
            cache.save_to_cache(task_result, meta)
        writer.register_tree(MTEB_RESULTS, kind="mteb_result")
        for name, png in plots.items():
            writer.write_file(f"plots/{name}", png, kind="plot")
        if geometry:
            writer.write_table(GEOMETRY, pa.Table.from_pylist(geometry), kind="geometry")
        if size_rows:
            writer.write_table(SIZES, pa.Table.from_pylist(size_rows, schema=SIZE_SCHEMA), kind="results")
        release = _write_release(writer, run_dir, rows, config, size_rows)
        writer.write_file("report.md", (report_md + release_section(release)).encode(), kind="report")
        manifest = writer.commit({
            "models": model_stats,
            "release": release,
            "tasks": [s.name for s in specs],
            "counts": {"texts_encoded": sum(m["texts_encoded"] for m in model_stats), "result_rows": table.num_rows,
                       "main_scores": [{k: r[k] for k in ("model", "task", "metric", "value")} for r in rows
                                       if r["main"]]},
            "timings_s": {"total": round(time.perf_counter() - t0, 3)},
        })
    if cfg.push_to_hub and release is not None and config.release is None:  # with a gate: when it is current
        push_release(run_dir / STAGE / RELEASE, cfg.hub_model_id, private=cfg.hub_private)
    return manifest


def push_release(folder: Path, repo_id: str, *, private: bool = True) -> str:
    """Upload the released model to the Hugging Face Hub; returns the commit URL. Runs after the
    stage committed, so a failure (offline, no token, no permission) loses nothing: the error says
    where the release is and how to upload it by hand."""
    from huggingface_hub import HfApi

    try:
        api = HfApi()
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id,
                                 commit_message="Upload embedding model trained by embedpipe")
    except Exception as exc:  # noqa: BLE001 — offline mode, HTTP and auth errors all end the same way
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise EmbedpipeError(f"evaluate: push_to_hub to {repo_id} failed ({type(exc).__name__}: {detail}); the "
                             f"release is committed in {folder}: upload it with `huggingface-cli upload {repo_id} "
                             f"{folder}`") from None
    log.info("evaluate: pushed %s to the Hub: %s", folder, info)
    return str(info)


RELEASE = "model"
_REWRITTEN = ("README.md", CARD_FACTS)


def _write_release(writer: StageWriter, run_dir: Path, rows: list[dict[str, Any]],
                   config: RunConfig, size_rows: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """Stage ``model/``: the last trained model of the run, if it has scores, with its card rendered
    again with the evaluation table (its scores next to the base model's). Files are hard links
    (artifacts are never modified in place, so sharing inodes is safe), copies across filesystems."""
    trained = trained_models(run_dir, config)
    scored = {r["model"] for r in rows if r["main"]}
    kept = {lab: why for lab in scored & set(trained) if (why := _untrained(Path(trained[lab]))) is not None}
    for lab, why in sorted(kept.items()):  # its start model, saved again: nothing to release
        log.info("evaluate: %s is not released: it was not trained (%s)", lab, why)
    label = next((lab for lab in reversed(trained) if lab in scored and lab not in kept), None)
    if label is None:
        return None
    source = Path(trained[label])
    facts = read_card_facts(source)
    if facts is None:  # a model saved before cards existed
        return None
    target = writer.staging / RELEASE
    target.mkdir(parents=True, exist_ok=True)
    check = check_release(source, TrainManifest.read(source.parent.parent, source.parent.name), _cfg(config).release,
                          target)
    for rel in released_files(source):
        path = resolve_within(source, rel)  # a link out of the model directory is refused, never released
        if str(rel) in _REWRITTEN:
            continue
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target / rel)
        except OSError:
            shutil.copy2(path, target / rel)
    scores = [r for r in rows if r["main"] and r["model"] in (label, "base")]
    dim_scores = [r for r in size_rows or [] if r["model"] == label and r["precision"] == "float32"]
    write_card(target, facts, sentence_transformers_prompts(read_model_settings(source)), scores, dim_scores)
    writer.register_tree(RELEASE, kind="model")
    return {"model": label, "source": str(source), "path": RELEASE, "check": check}


def _untrained(model_dir: Path) -> str | None:
    """Why the train stage of ``model_dir`` kept its start model untrained (None: it trained, or the
    model is no stage's)."""
    manifest = read_manifest(model_dir.parent.parent, model_dir.parent.name)
    return (manifest or {}).get("untrained")


def released_files(model_dir: Path) -> list[Path]:
    """The files of a trained model (``<run>/train-<stage>/model``) the release copies: those its
    train stage's manifest lists under ``model/``, as paths relative to ``model_dir`` (a file put
    there afterwards, a link included, is not the trained model and is not released)."""
    manifest = read_manifest(model_dir.parent.parent, model_dir.parent.name)
    if manifest is None:
        raise EmbedpipeError(f"{model_dir.parent}: no readable manifest.json; the trained model cannot be released "
                             f"(run `embedpipe train` again)")
    prefix = f"{model_dir.name}/"
    return sorted(Path(name[len(prefix):]) for name in Manifest.of(manifest).hashes(prefix=prefix))


def main_scores(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / STAGE / RESULTS
    if not path.exists():
        return []
    return [r for r in pq.read_table(path).to_pylist() if r["main"]]

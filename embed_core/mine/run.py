"""The mine stage's body (declared in ``stage.py``): prepare's records → the same records with mined hard negatives.

Reads ``<run_dir>/prepare`` through its manifest, writes ``<run_dir>/mine/<dataset>.parquet``
(every dataset; those without a mined task pass through unchanged), ``_scores.parquet`` (score
distributions: positives, kept negatives, candidates removed by the margin), ``score_hist.png``
and ``manifest.json`` (counts, index choice and parameters, model fingerprint, timings).
Embeddings are cached per model fingerprint and dtype (shared with evaluate): the base model's in the
machine-wide cache, other models' in ``<run_dir>/cache/embeddings/`` (``embed_core.model.embedding_cache``).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from embed_core.artifacts import StageWriter, model_artifact_dir, output_hashes, read_corpora, read_records
from embed_core.config import RunConfig, config_hash
from embed_core.mine.config import MineConfig
from embed_core.model.config import EngineConfig
from embed_core.engine import engine_session, ray_encode
from embed_core.errors import ConfigError
from embed_core.manifests import MineManifest, RemineManifest
from embed_core.schema import CORPUS_KIND
from embed_core.fingerprint import Fingerprint, sha256_file
from embed_core.mine.miner import eligible, mine_records, negative_sources
from embed_core.mine.teacher import teacher_fingerprint, teacher_scorer
from embed_core.mine.stage import NAME as STAGE
from embed_core.model.embedding_cache import LazyCachedEmbed, model_embed
from embed_core.model.encoder import default_device_type, model_fingerprint, model_source, uses_bf16
from embed_core.model.settings import read_model_settings
from embed_core.plots import pyplot, to_png
from embed_core.prepare.convert.beir import load_corpus
from embed_core.prepare.readers import root_for
from embed_core.schema import records_to_table, table_to_records

log = logging.getLogger("embedpipe.mine")
# Libraries whose versions are part of this stage's code identity (embed_core.fingerprint).
LIBRARIES = ("torch", "transformers", "faiss-cpu", "faiss-gpu", "numpy")


def _cfg(config: RunConfig) -> MineConfig:
    if config.mine is None:
        raise ConfigError("the run config has no 'mine' section")
    return config.mine


def _encoder(cfg: MineConfig, path: str, dim: int):
    """texts -> embeddings on the configured engine (the model loads on first use)."""
    if cfg.engine.kind == "ray":
        return lambda texts: ray_encode(texts, model=path, pooling=cfg.pooling, max_length=cfg.max_length,
                                        precision=cfg.precision, batch_size=cfg.batch_size, dim=dim, engine=cfg.engine)
    from embed_core.model.encoder import Encoder

    encoder = Encoder(path, pooling=cfg.pooling, max_length=cfg.max_length, precision=cfg.precision)
    return lambda texts: encoder.encode(texts, batch_size=cfg.batch_size, show_progress=True)


def _cached_embed(config: RunConfig, run_dir: Path, cfg: MineConfig) -> LazyCachedEmbed:
    """texts -> embeddings under ``cfg``'s model through the run's cache (the model is resolved and
    loaded only when something needs encoding: a GGUF model is de-quantised then)."""
    return model_embed(cfg.model, run_dir, config.embedding_cache, pooling=cfg.pooling, max_length=cfg.max_length,
                       bf16=lambda: uses_bf16(cfg.precision, _encode_device(cfg)), dtype=cfg.cache_dtype,
                       make_encoder=lambda path, dim: _encoder(cfg, path, dim))


def _encode_device(cfg: MineConfig) -> str:
    """The device type the texts are encoded on (it decides bf16 under precision: auto)."""
    if cfg.engine.kind == "ray":
        return "cuda" if cfg.engine.num_gpus_per_worker > 0 else "cpu"
    return default_device_type()


def input_dirs(config: RunConfig, run_dir: str | Path, *, upstream: str) -> list[Path]:
    """The stage directories mining reads: its records upstream, and the stage that trained the
    mining model when it is a trained one (checked against its manifest before use)."""
    trained = model_artifact_dir(_cfg(config).model, run_dir)
    return [Path(run_dir) / upstream, *([trained] if trained is not None else [])]


def input_fingerprint(config: RunConfig, run_dir: str | Path, *, upstream: str) -> Fingerprint:
    """Upstream output hashes + mine config + model fingerprint + corpus file hashes."""
    return mining_fingerprint(config, run_dir, _cfg(config), STAGE, upstream=upstream)


def mining_fingerprint(config: RunConfig, run_dir: str | Path, cfg: MineConfig, instance: str, *,
                       upstream: str) -> Fingerprint:
    """The fingerprint of mining ``upstream``'s records with ``cfg`` into ``instance`` (the mine
    stage, or a re-mining step before a training stage): its records, settings, the model's
    fingerprint (its weights: a retrained model is mined with again) and the corpora."""
    up = output_hashes(Path(run_dir), upstream)  # synthesize's records when it runs, else prepare's
    bf16 = uses_bf16(cfg.precision, _encode_device(cfg))
    model_fp = model_fingerprint(cfg.model, cfg.pooling, cfg.max_length, bf16)
    # a teacher's weights are part of the key too (only when there is one: older keys stay valid)
    teacher = {"teacher": teacher_fingerprint(cfg.teacher, bf16)} if cfg.teacher is not None else {}
    corpora = {}
    for ds, path in cfg.corpora.items():
        d = config.resolve(path)
        cfile = d / "corpus.jsonl" if (d / "corpus.jsonl").exists() else d / "corpus.jsonl.gz"
        corpora[ds] = sha256_file(cfile) if cfile.exists() else "missing"
    corpora.update({f"passages:{n}": h for n, h in _passage_pools(Path(run_dir)).items()})  # none: keys as before
    return Fingerprint.of(instance, __name__, LIBRARIES, {
        "upstream": up,
        "config": config_hash(cfg.model_copy(update={"engine": EngineConfig()})),  # any engine: the same negatives
        "model": model_fp, "corpora": corpora, "seed": config.seed, **teacher},
        details={"model_fingerprint": model_fp, **teacher})


def _passage_pools(run_dir: Path) -> dict[str, str]:
    """Corpus source name -> the sha256 of its passages (prepare's ``corpus-<name>.parquet``, the
    default pool of the dataset of queries generated for them); {} when prepare wrote none."""
    from embed_core.prepare.stage import NAME as PREPARE

    return {n.removeprefix("corpus-").removesuffix(".parquet"): sha256
            for n, sha256 in output_hashes(run_dir, PREPARE, CORPUS_KIND, required=False).items()}


def _pool(config: RunConfig, run_dir: Path, cfg: MineConfig, dataset: str) -> list[str] | None:
    """The candidate pool of ``dataset``: its ``mine.corpora`` BEIR corpus; else, for a corpus
    source's generated queries, all of its passages; else None (the dataset's own texts)."""
    if dataset in cfg.corpora:
        return _corpus_texts(config, cfg.corpora[dataset])
    if dataset not in _passage_pools(run_dir):
        return None
    from embed_core.prepare.stage import NAME as PREPARE

    return read_corpora(run_dir, PREPARE)[dataset].column("text").to_pylist()


def _corpus_texts(config: RunConfig, path: str) -> list[str]:
    d = config.resolve(path)
    for name in ("corpus.jsonl", "corpus.jsonl.gz"):
        if (d / name).exists():
            docs, errors = load_corpus(d / name, f"{path}/{name}", root_for(config.resolve, path))
            if errors:
                log.warning("mine: %d bad corpus rows skipped (first: %s)", len(errors), errors[0])
            return list(docs.values())
    raise ConfigError(f"mine.corpora: no corpus.jsonl(.gz) in {d}")


def _plot(scores: list[dict[str, Any]]) -> bytes:
    plt = pyplot()
    datasets = sorted({s["dataset"] for s in scores})
    fig, axes = plt.subplots(len(datasets), 1, figsize=(7, 2.6 * max(1, len(datasets))), squeeze=False)
    for ax, ds in zip(axes[:, 0], datasets):
        for kind, color in (("positive", "tab:green"), ("kept_negative", "tab:blue"), ("filtered", "tab:red")):
            xs = [s["score"] for s in scores if s["dataset"] == ds and s["kind"] == kind]
            if xs:
                ax.hist(xs, bins=40, range=(-0.2, 1.0), alpha=0.55, color=color, label=f"{kind} ({len(xs)})")
        ax.set_title(f"{ds}: cosine scores", fontsize=10)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("cosine similarity to the query")
    return to_png(fig)


def run_mine(config: RunConfig, run_dir: str | Path, fingerprint: Fingerprint | None = None, *,
             upstream: str) -> dict[str, Any]:
    """Mine hard negatives for the records of ``upstream`` (a stage directory); the manifest."""
    return mine_into(config, run_dir, _cfg(config), STAGE, fingerprint, upstream=upstream, step=MineManifest)


def mine_into(config: RunConfig, run_dir: str | Path, cfg: MineConfig, instance: str,
              fingerprint: Fingerprint | None = None, *, upstream: str,
              step: type[MineManifest] = RemineManifest) -> dict[str, Any]:
    """Mine the records of ``upstream`` with ``cfg`` (its model, window and margins) and commit them
    as stage directory ``instance``; the manifest. ``step``: the mine stage's, or (the default) a
    re-mining step's before a training stage."""
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    fingerprint = fingerprint or mining_fingerprint(config, run_dir, cfg, instance, upstream=upstream)
    tables = read_records(run_dir, upstream)

    embed = _cached_embed(config, run_dir, cfg)
    settings = read_model_settings(model_source(cfg.model))  # a model trained with instructions mines with them

    out_tables: dict[str, pa.Table] = {}
    per_dataset: list[dict[str, Any]] = []
    score_rows: list[dict[str, Any]] = []
    # opened first: an on-disk index lives in its scratch
    with StageWriter(run_dir, instance, step, fingerprint=fingerprint, run_name=config.run_name) as writer:
        with engine_session(cfg.engine):  # a local Ray instance lives as long as the loop (engine: ray)
            for name, table in sorted(tables.items()):
                dataset = name.removesuffix(".parquet")
                records = table_to_records(table)
                wanted = cfg.datasets is None or dataset in cfg.datasets
                if not wanted or not any(eligible(r, cfg) for r in records):
                    out_tables[name] = table
                    per_dataset.append({"dataset": dataset, "records": len(records), "mined": False,
                                        "negatives_by_source": negative_sources(records, records)})
                    continue
                t_ds = time.perf_counter()
                corpus = _pool(config, run_dir, cfg, dataset)
                index_dir = writer.scratch / f"index-{dataset}" if cfg.index.on_disk else None
                teacher = (teacher_scorer(config, run_dir, cfg, records, _cached_embed)
                           if cfg.teacher is not None else None)
                mined, stats = mine_records(records, embed, cfg, corpus, index_dir=index_dir, seed=config.seed,
                                            settings=settings, teacher=teacher)
                if index_dir is not None:  # the on-disk index's files, no longer needed
                    shutil.rmtree(index_dir, ignore_errors=True)
                out_tables[name] = records_to_table(mined)
                summary = stats.summary()
                per_dataset.append({"dataset": dataset, "records": len(records), "mined": True,
                                    "pool": "corpus" if corpus is not None else "dataset texts",
                                    "negatives_by_source": negative_sources(records, mined),
                                    "seconds": round(time.perf_counter() - t_ds, 2), **summary})
                if stats.teacher_dropped:
                    log.info("mine %s: the teacher dropped %d candidates as false negatives, e.g. %s", dataset,
                             stats.teacher_dropped, "; ".join(stats.teacher_dropped_examples))
                if stats.too_few:
                    log.warning("mine %s: %d records got fewer than %d negatives, e.g. %s", dataset, stats.too_few,
                                cfg.num_negatives, ", ".join(stats.too_few_examples))
                for kind, xs in (("positive", stats.positive_scores), ("kept_negative", stats.kept_scores),
                                 ("filtered", stats.filtered_scores)):
                    score_rows += [{"dataset": dataset, "kind": kind, "score": float(x)} for x in xs]

        for name, table in out_tables.items():
            writer.write_table(name, table, kind="records")
        writer.write_table("_scores.parquet", pa.Table.from_pylist(
            score_rows, schema=pa.schema([("dataset", pa.string()), ("kind", pa.string()), ("score", pa.float64())])),
            kind="stats")
        if score_rows:
            writer.write_file("score_hist.png", _plot(score_rows), kind="plot")
        manifest = writer.commit({
            "upstream": upstream,
            "model": {"path": cfg.model, "fingerprint": fingerprint.details["model_fingerprint"], "pooling": cfg.pooling,
                      "max_length": cfg.max_length, "precision": cfg.precision,
                      "instructions": settings.use_instructions},
            "settings": cfg.model_dump(mode="json"),
            **({"teacher": {**cfg.teacher.model_dump(mode="json"),
                            "fingerprint": fingerprint.details.get("teacher")}} if cfg.teacher is not None else {}),
            "counts": {"datasets": per_dataset,
                       "texts_encoded": embed.cache.encoded_texts if embed.cache else 0,
                       "cache_size": len(embed.cache) if embed.cache else None},
            "timings_s": {"total": round(time.perf_counter() - t0, 3)},
        })
    return manifest

"""The error-driven synthesis step before a training stage (``synth-<stage>/``; the train stage
declares it, ``embed_core.train.stage``): score prepare's dev records with the model the stage
starts from, select the training records nearest to the worst (``targeted.py``), and synthesize
from those only with the run's synthesize section (``run.synthesize_into``).

Writes what the synthesize stage writes (every record of its upstream plus the kept new ones,
failures, filtered answers, samples) and ``_targets.parquet``: one row per selected training
record, with the dev record that selected it, how badly the model got that one wrong and why. The
manifest's ``targeted`` section counts failures and selected records per dataset. The LLM's
answers are cached by prompt (``<run_dir>/cache/llm.sqlite`` or ``request_cache``, shared with the synthesize stage).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from embed_core.artifacts import output_hashes, read_records
from embed_core.config import RunConfig, config_hash
from embed_core.errors import ConfigError
from embed_core.fingerprint import Fingerprint
from embed_core.manifests import SynthManifest
from embed_core.model.settings import instructed, read_model_settings
from embed_core.prepare.cleaning import normalize_text
from embed_core.schema import table_to_records
from embed_core.stage_dirs import PREPARE
from embed_core.synthesize.config import SynthesizeConfig, TargetedConfig, not_in_key
from embed_core.synthesize.targeted import failures_of, select_records

log = logging.getLogger("embedpipe.synthesize")
LIBRARIES = ("openai", "torch", "transformers", "numpy")
TARGETS = "_targets.parquet"
TARGET_FIELDS = {"dataset": pa.string(), "task": pa.string(), "dev_id": pa.string(), "dev_text": pa.string(),
                 "severity": pa.float64(), "detail": pa.string(), "record_id": pa.string(), "record_query": pa.string()}


def _stage(config: RunConfig, stage_name: str) -> TargetedConfig:
    return next(s for s in config.train.stages if s.name == stage_name).targeted_synthesis


def synth_settings(config: RunConfig, targeted: TargetedConfig) -> SynthesizeConfig:
    """The run's synthesize settings for the selected records: the step's strategies, and a hard
    negative for every selected retrieval record."""
    return config.synthesize.model_copy(update={"strategies": targeted.strategies, "hard_negative_fraction": 1.0,
                                                "max_records_per_dataset": None, "datasets": None})


def _model_fp(config: RunConfig, model: str) -> str:
    from embed_core.model.encoder import model_fingerprint

    return model_fingerprint(model, config.train.pooling, config.train.max_length, False)


def targeted_fingerprint(config: RunConfig, run_dir: str | Path, stage_name: str, instance: str, model: str, *,
                         upstream: str) -> Fingerprint:
    """The records it reads (upstream's and prepare's dev records), the model that scores the dev
    records (its weights), the step's and synthesize's settings and the prompt templates."""
    from embed_core.synthesize.prompts import load_templates, template_versions

    run_dir = Path(run_dir)
    records, dev = output_hashes(run_dir, upstream, "records"), output_hashes(run_dir, PREPARE, prefix="dev/")
    targeted = _stage(config, stage_name)
    cfg = synth_settings(config, targeted)
    templates = load_templates(cfg.prompt_dir)
    model_fp = _model_fp(config, model)
    return Fingerprint.of(instance, __name__, LIBRARIES, {
        "upstream": records, "dev": dev,
        "model": model_fp, "targeted": config_hash(targeted), "synthesize": config_hash(cfg, exclude=not_in_key(cfg)),
        "prompts": {n: [t.version, t.digest] for n, t in templates.items()},
        "contamination": [s.model_dump(mode="json") for s in config.prepare.contamination], "seed": config.seed},
        details={"model_fingerprint": model_fp, "prompt_versions": template_versions(templates)})


def _embedder(config: RunConfig, run_dir: Path, model: str, model_fp: str):
    """texts -> L2-normalised embeddings under ``model`` (the run's embedding cache; loaded on first use)."""
    from embed_core.model.embedding_cache import LazyCachedEmbed, open_cache
    from embed_core.model.encoder import Encoder, model_dim

    def make_encoder(cache):
        encoder = Encoder(model, pooling=config.train.pooling, max_length=config.train.max_length, precision="fp32")
        return lambda texts: encoder.encode(texts, batch_size=64)

    return LazyCachedEmbed(
        lambda: open_cache(model, run_dir, config.embedding_cache, model_fp, model_dim(model), "float16"), make_encoder)


def run_targeted(config: RunConfig, run_dir: str | Path, stage_name: str, instance: str, model: str,
                 fingerprint: Fingerprint | None = None, *, upstream: str) -> dict[str, Any]:
    """Find the failures, select the records, synthesize from them; commit ``instance``."""
    from embed_core.synthesize.run import synthesize_into

    run_dir = Path(run_dir)
    targeted = _stage(config, stage_name)
    fingerprint = fingerprint or targeted_fingerprint(config, run_dir, stage_name, instance, model, upstream=upstream)
    dev_tables = read_records(run_dir, PREPARE, kind="dev_records")
    train_tables = read_records(run_dir, upstream)
    embed = _embedder(config, run_dir, model, fingerprint.details["model_fingerprint"])
    settings = read_model_settings(model)  # a model trained with instructions is scored with them
    train, failures, dev_texts, records = {}, [], set(), []
    for dataset in targeted.datasets:
        dev_table = dev_tables.get(f"dev/{dataset}.parquet")
        if dev_table is None or dev_table.num_rows == 0:
            raise ConfigError(f"train.stages[{stage_name}].targeted_synthesis.datasets: prepare set aside no dev "
                              f"records for {dataset!r} (give its source dev_fraction or dev_path)")
        dev = table_to_records(dev_table)
        dev_texts |= {normalize_text(t) for r in dev for t in r.texts()}
        train[dataset] = table_to_records(train_tables[f"{dataset}.parquet"]) \
            if f"{dataset}.parquet" in train_tables else []
        documents, queries = instructed([*dev, *train[dataset]], embed, settings)
        failures += failures_of(dataset, dev, train[dataset], queries, targeted, documents)
        records += [*dev, *train[dataset]]
    _, queries = instructed(records, embed, settings)  # failures and training records, as queries
    chosen = select_records(failures, train, dev_texts, queries, targeted)
    only: dict[str, set[str]] = {}
    for failure, record in chosen:
        only.setdefault(failure.dataset, set()).add(record.id)
    counts = {ds: {"failures": sum(f.dataset == ds for f in failures), "selected": len(only.get(ds, ()))}
              for ds in targeted.datasets}
    log.info("%s: %s", instance, ", ".join(f"{ds} {c['failures']} dev failures -> {c['selected']} training records"
                                           for ds, c in counts.items()))
    rows = [{"dataset": f.dataset, "task": f.task, "dev_id": f.dev_id, "dev_text": f.text, "severity": f.severity,
             "detail": f.detail, "record_id": r.id, "record_query": r.query} for f, r in chosen]
    extra = {"targeted": {"model": model, "model_fingerprint": fingerprint.details["model_fingerprint"],
                          "settings": targeted.model_dump(mode="json"), "datasets": counts}}
    return synthesize_into(config, run_dir, synth_settings(config, targeted), instance, fingerprint,
                           upstream=upstream, step=SynthManifest, only=only, extra=extra,
                           tables={TARGETS: pa.Table.from_pylist(rows, schema=pa.schema(list(TARGET_FIELDS.items())))})

"""The synthesize stage's body (declared in ``stage.py``; requests in ``jobs.py``, filters in
``filters.py``): prepare's records → the same records plus LLM-made ones (QZhou §4, §6.1).

Strategies and task rules (QZhou §4.1–4.3 and §6.1):

* ``paraphrase`` (structural diversity). retrieval: rewrite the (query, positive) pair and add it;
  nli / sts / pair_classification: rewrite the row's first sentence and add a copy of the row with
  it (scores and labels still hold); classification: rewrite the text, keep its label.
* ``augmentation`` (semantic diversity), retrieval only: a new (query, positive) pair on another
  aspect of the same domain. NLI and classification get none (it would make labels ambiguous).
* ``hard_negative``, retrieval only, for ``hard_negative_fraction`` of the records (QZhou: 30%; the
  mine stage fills the rest): a passage on the query's topic that does not answer it, put first
  in the record's negatives (the record's origin becomes ``llm_negative``).

Only datasets with at most ``max_dataset_rows`` records are touched (QZhou: fewer than ~60k).
Every answer is validated (``embed_core.synthesize.prompts``), then filtered: length limits, copies of
the source, duplicates of texts the dataset already has, text copied from the prompt's few-shot
examples, the prepare stage's contamination sets,
and embedding-similarity bounds (a rewrite stays close to its source, a generated pair's query and
positive agree, a generated negative scores below the positive and above a floor). Kept records
have ``origin`` set and ``source_ref`` of the record they came from; ids are ``<source id>~para``
/ ``~aug``.

Writes ``<run_dir>/synthesize/<dataset>.parquet`` (every dataset; untouched ones pass through),
``_failures.parquet`` (requests that gave no valid answer: reason, detail and the raw reply),
``_filtered.parquet`` (answers a filter removed, with the reason and scores), ``_samples.parquet``
(source vs. kept generated text), ``_queries.parquet`` (with corpus sources: each kept generated
query's passage, kind, persona and judge score), with ``calibration`` ``calibration.parquet`` and
``report.md`` (the query filters' fitted thresholds, precision, recall and keep rate:
``calibrate_step.py``) and ``manifest.json`` (requests, cache hits, tokens, failures by
reason, kept vs. filtered per strategy). Requests are cached in ``<run_dir>/cache/llm.sqlite`` (or ``request_cache``).
When more than ``max_failed_share`` of the requests got no answer from the server (an outage), the
stage writes nothing and fails with one line, so Prefect's retry applies.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from embed_core.artifacts import StageWriter, output_hashes, read_corpora, read_records
from embed_core.config import RunConfig, config_hash
from embed_core.synthesize.config import SynthesizeConfig, not_in_key
from embed_core.errors import ConfigError, EmbedpipeError, printable
from embed_core.manifests import SynthesizeManifest
from embed_core.fingerprint import Fingerprint
from embed_core.prepare.cleaning import normalize_text
from embed_core.schema import records_to_table, table_to_records
from embed_core.synthesize.filters import Candidate, filter_candidates, to_candidate
from embed_core.synthesize.jobs import Servers, generate, plan_jobs
from embed_core.synthesize.calibrate_step import Calibrated, calibrate_queries, likelihood_filter
from embed_core.synthesize.judge import Judged, judge_pair_scores, judge_queries
from embed_core.synthesize.queries import STRATEGY as QUERIES, plan_query_jobs, query_candidates
from embed_core.synthesize.queries import round_trip_filter, word_filter
from embed_core.synthesize.queries import query_dropped
from embed_core.synthesize.prompts import load_templates, template_versions
from embed_core.synthesize.stage import NAME as STAGE, calibration_section

log = logging.getLogger("embedpipe.synthesize")
# Libraries whose versions are part of this stage's code identity (embed_core.fingerprint).
LIBRARIES = ("openai", "torch", "transformers")


def _cfg(config: RunConfig) -> SynthesizeConfig:
    if config.synthesize is None:
        raise ConfigError("the run config has no 'synthesize' section")
    return config.synthesize


def input_fingerprint(config: RunConfig, run_dir: str | Path, *, upstream: str) -> Fingerprint:
    """Upstream output hashes + synthesize config + prompt templates (version and bytes) + filter model.

    The LLM's weights are not hashed (a remote server's cannot be): the model *name* is in the
    config, and the request cache is keyed by it.
    """
    from embed_core.model.encoder import model_fingerprint

    cfg = _cfg(config)
    up = output_hashes(Path(run_dir), upstream)
    templates = load_templates(cfg.prompt_dir)
    filter_fp = model_fingerprint(cfg.filter.model, "mean", cfg.filter.max_length, False)
    rt = cfg.queries.round_trip
    round_trip = {} if QUERIES not in cfg.strategies or rt is None else {"round_trip_model": model_fingerprint(
        round_trip_model(config, cfg), rt.pooling, rt.max_length, _round_trip_bf16(cfg))}
    return Fingerprint.of(STAGE, __name__, LIBRARIES, {
        "upstream": up, "config": config_hash(cfg, exclude=not_in_key(cfg)),
        "prompts": {n: [t.version, t.digest] for n, t in templates.items()}, "filter_model": filter_fp, **round_trip,
        "contamination": [s.model_dump(mode="json") for s in config.prepare.contamination], "seed": config.seed},
        details={"prompt_versions": template_versions(templates)})


def round_trip_model(config: RunConfig, cfg: SynthesizeConfig) -> str:
    """The model round-trip consistency ranks with ('base': the run's base model)."""
    name = cfg.queries.round_trip.model if cfg.queries.round_trip else "default"
    if name == "base":
        return config.train.base_model if config.train is not None else "default"
    return name


def _corpora(cfg: SynthesizeConfig, run_dir: Path, upstream: str) -> dict[str, pa.Table]:
    """The corpus artifacts of ``upstream`` (prepare's ``corpus-<name>.parquet``) when the strategy
    ``queries`` is on, else none."""
    if QUERIES not in cfg.strategies:
        return {}
    return read_corpora(run_dir, upstream)


def run_synthesize(config: RunConfig, run_dir: str | Path, fingerprint: Fingerprint | None = None, *,
                   upstream: str) -> dict[str, Any]:
    """Run the synthesize stage on the records of ``upstream`` (a stage directory) and return its
    manifest."""
    fingerprint = fingerprint or input_fingerprint(config, run_dir, upstream=upstream)
    return synthesize_into(config, run_dir, _cfg(config), STAGE, fingerprint, upstream=upstream, step=SynthesizeManifest)


def synthesize_into(config: RunConfig, run_dir: str | Path, cfg: SynthesizeConfig, instance: str,
                    fingerprint: Fingerprint, *, upstream: str, step: type[SynthesizeManifest],
                    only: dict[str, set[str]] | None = None,
                    extra: dict[str, Any] | None = None, tables: dict[str, pa.Table] | None = None) -> dict[str, Any]:
    """Synthesize from the records of ``upstream`` with ``cfg`` and commit every record plus the
    kept new ones as stage directory ``instance``; ``only``: dataset -> the record ids to
    synthesize from (all small enough datasets' records without it); ``step``: the synthesize
    stage's manifest class or the targeted step's; ``extra``: more manifest
    sections, ``tables``: more stats tables. The manifest."""
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    records, chosen = _chosen_datasets(cfg, run_dir, upstream)
    if only is not None:
        chosen = [ds for ds in records if only.get(ds)]
    templates = load_templates(cfg.prompt_dir)
    jobs = [j for ds in chosen for j in plan_jobs(
        cfg, ds, [r for r in records[ds] if only is None or r.id in only[ds]], templates, config.seed)]
    corpora = _corpora(cfg, run_dir, upstream) if only is None else {}
    jobs += plan_query_jobs(cfg, corpora, templates, config.seed)
    log.info("%s: %d requests planned over %d datasets", instance, len(jobs), len(chosen))

    with Servers(cfg, run_dir) as servers:  # one launch of the local servers for generation and the judge
        t_gen = time.perf_counter()
        outcomes, client_stats = (generate(cfg, jobs, run_dir, config.seed, servers=servers) if jobs
                                  else ([], {"requests": 0}))
        gen_s = time.perf_counter() - t_gen
        launched = client_stats.get("server", {}).get("base_urls")
        _refuse_an_outage(cfg, outcomes, ", ".join(launched) if launched else None)
        _refuse_malformed(cfg, outcomes, "the generation model")
        judge_scores = _judge_scores(cfg, templates, run_dir, config.seed, client_stats, servers)
        kept, filtered, calibrated = _filtered(config, cfg, records, chosen, outcomes, corpora, run_dir,
                                               judge_scores, servers)
        kept, filtered, judged = (_judge(calibrated.cfg if calibrated else cfg, kept, filtered, templates, run_dir,
                                         config.seed, _spent(client_stats, calibrated), servers)
                                  if corpora else (kept, filtered, None))
    by_ds: dict[str, list[Candidate]] = defaultdict(list)
    for c in kept:
        by_ds[c.outcome.job.dataset].append(c)
    failures = [{"dataset": o.job.dataset, "source_id": o.job.record.id, "strategy": o.job.strategy,
                 "prompt": f"{o.job.template.name}@{o.job.template.version}", "reason": o.reason,
                 "detail": o.detail, "raw": o.raw, "attempts": o.attempts} for o in outcomes if o.answer is None]

    with StageWriter(run_dir, instance, step, fingerprint=fingerprint, run_name=config.run_name) as writer:
        for ds in sorted(set(records) | set(by_ds)):
            recs = records.get(ds, [])
            negs = {c.record.id: c.record for c in by_ds.get(ds, []) if c.outcome.job.strategy == "hard_negative"}
            new = [c.record for c in by_ds.get(ds, []) if c.outcome.job.strategy != "hard_negative"]
            writer.write_table(f"{ds}.parquet", records_to_table([negs.get(r.id, r) for r in recs] + new),
                               kind="records")
        writer.write_table("_failures.parquet", _table(failures, FAILURE_FIELDS), kind="stats")
        writer.write_table("_filtered.parquet", _table(filtered, FILTERED_FIELDS), kind="stats")
        writer.write_table("_samples.parquet", _table(_samples(kept), SAMPLE_FIELDS), kind="stats")
        if corpora:
            writer.write_table("_queries.parquet", _table(_query_rows(kept, judged), QUERY_FIELDS), kind="stats")
        if calibrated is not None:
            writer.write_table("calibration.parquet", calibrated.table(), kind="stats")
            writer.write_file("report.md", (f"# {instance}\n\n" + calibration_section(calibrated.section())).encode(),
                              kind="report")
        for name, table in (tables or {}).items():
            writer.write_table(name, table, kind="stats")
        manifest = writer.commit({
            "llm": {"model": cfg.server.model, "mode": cfg.server.mode, "base_url": cfg.server.base_url,
                    "base_urls": cfg.server.base_urls,
                    "launch": cfg.server.launch, "api_key_env": cfg.server.api_key_env},
            "prompt_versions": fingerprint.details["prompt_versions"],
            "settings": cfg.model_dump(mode="json"),
            "counts": {"datasets": [{"dataset": ds, "records": len(records.get(ds, [])), "synthesized": ds in chosen,
                                     "added": sum(1 for c in by_ds.get(ds, []) if c.outcome.job.strategy != "hard_negative"),
                                     **({"corpus": True} if ds in corpora else {}),
                                     "llm_negatives": sum(1 for c in by_ds.get(ds, []) if c.outcome.job.strategy == "hard_negative")}
                                    for ds in sorted(set(records) | set(by_ds))],
                       "strategies": _strategy_counts(outcomes, filtered, kept),
                       "client": client_stats, **({"judge_client": judged.client} if judged else {}),
                       "failed": len(failures), "filtered": len(filtered), "kept": len(kept)},
            "timings_s": {"generate": round(gen_s, 3), "total": round(time.perf_counter() - t0, 3)},
            **({"queries": _query_report(corpora, outcomes, filtered, kept, judged)} if corpora else {}),
            **({"calibration": calibrated.section()} if calibrated is not None else {}),
            **(extra or {}),
        })
    return manifest


def _judge(cfg: SynthesizeConfig, kept: list[Candidate], filtered: list[dict[str, Any]], templates: dict,
           run_dir: Path, seed: int, client_stats: dict[str, Any],
           servers: Servers) -> tuple[list[Candidate], list[dict], Judged | None]:
    """Step 4, with ``queries.judge``: the LLM judge over the generated queries the other filters
    kept (``judge.py``); its drops join ``filtered``. An outage of the judge's requests fails the
    stage like one of the generation requests."""
    if cfg.queries.judge is None:
        return kept, filtered, None
    queries = [c for c in kept if c.outcome.job.strategy == QUERIES]
    judged = judge_queries(cfg, queries, templates, run_dir, seed, client_stats, servers)
    _refuse_an_outage(cfg, judged.outcomes, judged.client.get("server", {}).get("base_url"))
    _refuse_malformed(cfg, judged.outcomes, "the judge")
    rows = [query_dropped(c, reason, scores) for c, reason, scores in judged.dropped]
    return [c for c in kept if c.outcome.job.strategy != QUERIES] + judged.kept, filtered + rows, judged


def _refuse_an_outage(cfg: SynthesizeConfig, outcomes: list, launched_url: str | None) -> None:
    """Fail before anything is committed when more than ``max_failed_share`` of the requests got no
    answer from the server (an unparseable answer is the model's, a budget stop the run's choice):
    the error says how many, the first reason and the server."""
    asked = [o for o in outcomes if o.reason != "budget"]
    failed = [o for o in asked if o.answer is None and o.reason != "malformed"]
    if not failed or len(failed) <= cfg.max_failed_share * len(asked):
        return
    url = launched_url or cfg.server.base_url or ", ".join(cfg.server.base_urls) or "(no base_url)"
    first = failed[0]
    detail = " ".join(f"{first.reason}: {first.detail}".split())[:200]
    raise EmbedpipeError(f"synthesize: {len(failed)} of {len(asked)} requests to {url} got no answer (first: {detail}), "
                         f"more than synthesize.max_failed_share {cfg.max_failed_share}; nothing was committed: check "
                         "the server and run again (the answers so far are cached)")


def _refuse_malformed(cfg: SynthesizeConfig, outcomes: list, who: str) -> None:
    """Fail before anything is committed when more than ``max_malformed_share`` of the answered
    requests got an answer that does not parse or validate: the line says how many, and the first
    raw answer (escaped, cut), so a model that answers prose or a judge that answers ``maybe`` is
    not committed as a finished stage with nothing in it."""
    answered = [o for o in outcomes if o.answer is not None or o.reason == "malformed"]
    malformed = [o for o in answered if o.answer is None]
    if not malformed or len(malformed) <= cfg.max_malformed_share * len(answered):
        return
    first = malformed[0]
    said = printable(" ".join(str(first.raw or "").split()), 80)
    raise EmbedpipeError(f"synthesize: {len(malformed)} of {len(answered)} answers of {who} do not parse or validate "
                         f"(first: {' '.join(first.detail.split())[:120]}; it answered {said!r}), more than "
                         f"synthesize.max_malformed_share {cfg.max_malformed_share}; nothing was committed: use a "
                         "model that follows the prompt's format, or adapt the prompts (prompt_dir)")


def _chosen_datasets(cfg: SynthesizeConfig, run_dir: Path, upstream: str) -> tuple[dict[str, list], list[str]]:
    """Step 1: the upstream records per dataset, and the datasets small enough to synthesize for."""
    tables = read_records(run_dir, upstream)
    records = {name.removesuffix(".parquet"): table_to_records(t) for name, t in sorted(tables.items())}
    chosen = [ds for ds, recs in records.items()
              if (cfg.datasets is None or ds in cfg.datasets) and len(recs) <= cfg.max_dataset_rows]
    if cfg.datasets:
        unknown = sorted(set(cfg.datasets) - set(records))
        if unknown:
            raise ConfigError(f"synthesize.datasets: no dataset named {', '.join(unknown)} in {run_dir / upstream}")
    return records, chosen


def _filtered(config: RunConfig, cfg: SynthesizeConfig, records: dict[str, list], chosen: list[str],
              outcomes: list, corpora: dict[str, pa.Table], run_dir: Path, judge_scores,
              servers: Servers) -> tuple[list[Candidate], list[dict[str, Any]], Calibrated | None]:
    """Step 3: the answered requests as candidates, through the filters (``filters.py``; generated
    queries then through the word filter, with ``calibration`` the calibration of the query filters
    (``calibrate_step.py``) and the likelihood filter, and round-trip consistency)."""
    from embed_core.prepare.run import collect_eval_texts

    existing = {ds: {normalize_text(t) for r in records[ds] for t in r.texts()} for ds in chosen}
    existing.update({name: {normalize_text(t) for t in table.column("text").to_pylist()}
                     for name, table in corpora.items()})  # a query that copies a passage is a duplicate
    answered = [o for o in outcomes if o.answer is not None]
    candidates = [c for o in answered for c in (query_candidates(o) if o.job.strategy == QUERIES else [to_candidate(o)])]
    kept, filtered = filter_candidates(cfg, candidates, existing, collect_eval_texts(config),
                                       _embedder(cfg.filter.model, "mean", cfg.filter.max_length))
    queries = [c for c in kept if c.outcome.job.strategy == QUERIES]
    if not corpora:
        return kept, filtered, None
    kept_queries, dropped = word_filter(cfg, queries)
    embed_for = lambda: _round_trip_embed(config, cfg, run_dir)  # noqa: E731
    calibrated = None
    if cfg.calibration is not None:
        calibrated = calibrate_queries(cfg, [r for ds in chosen for r in records[ds]], kept_queries, corpora,
                                       seed=config.seed, embed_for=embed_for, judge_scores=judge_scores,
                                       servers=servers)
        kept_queries, more = likelihood_filter(calibrated, kept_queries)
        dropped += more
    kept_queries, more = round_trip_filter(calibrated.cfg if calibrated else cfg, kept_queries, corpora, embed_for)
    return [c for c in kept if c.outcome.job.strategy != QUERIES] + kept_queries, filtered + dropped + more, calibrated


def _judge_scores(cfg: SynthesizeConfig, templates: dict, run_dir: Path, seed: int, client_stats: dict[str, Any],
                  servers: Servers):
    """pairs -> the judge's scores and stats, for calibration; an outage of its requests fails the
    stage like one of the generation requests."""

    def scores(pairs: list[tuple[str, str]]) -> tuple[list[float], dict[str, Any]]:
        got, stats, outcomes = judge_pair_scores(cfg, pairs, templates, run_dir, seed, client_stats, servers)
        _refuse_an_outage(cfg, outcomes, stats.get("server", {}).get("base_url"))
        return got, stats

    return scores


def _spent(client_stats: dict[str, Any], calibrated: Calibrated | None) -> dict[str, Any]:
    """The requests and tokens spent so far, calibration's judge requests included (for the budget)."""
    extra = calibrated.client if calibrated is not None else {}
    return {**client_stats, **{k: client_stats.get(k, 0) + extra.get(k, 0) for k in ("requests", "tokens")}}


def _round_trip_bf16(cfg: SynthesizeConfig) -> bool:
    """Whether the round trip encodes in bf16 on this machine (its key and its cache say the same)."""
    from embed_core.model.encoder import default_device_type, uses_bf16

    return uses_bf16(cfg.queries.round_trip.precision, default_device_type())


def _round_trip_embed(config: RunConfig, cfg: SynthesizeConfig, run_dir: Path):
    """texts -> embeddings for round-trip consistency, through the run's embedding cache (keyed like
    mine's: with the same model and settings, mine reads the corpus's embeddings instead of
    encoding it again)."""
    from embed_core.mine.config import MineConfig
    from embed_core.model.embedding_cache import model_embed

    rt = cfg.queries.round_trip

    def make_encoder(path: str, dim: int):
        from embed_core.model.encoder import Encoder

        encoder = Encoder(path, pooling=rt.pooling, max_length=rt.max_length, precision=rt.precision)
        return lambda texts: encoder.encode(texts, batch_size=64)

    # stored as mine stores its embeddings, so that mine finds them
    dtype = config.mine.cache_dtype if config.mine is not None else MineConfig.model_fields["cache_dtype"].default
    return model_embed(round_trip_model(config, cfg), run_dir, config.embedding_cache, pooling=rt.pooling,
                       max_length=rt.max_length, bf16=lambda: _round_trip_bf16(cfg),
                       dtype=dtype, make_encoder=make_encoder)


def _embedder(model: str, pooling: str, max_length: int):
    """An embed function over ``model``, loaded at its first call."""
    encoder = None

    def embed(texts: list[str]) -> np.ndarray:
        nonlocal encoder
        if encoder is None:
            from embed_core.model.encoder import Encoder

            encoder = Encoder(model, pooling=pooling, max_length=max_length, precision="fp32")
        return encoder.encode(texts, batch_size=64)

    return embed


def _query_rows(kept: list[Candidate], judged: Judged | None) -> list[dict[str, Any]]:
    """``_queries.parquet``: per kept generated query, its passage, kind, persona and judge score (the
    record schema has no room for them)."""
    return [{"id": c.record.id, "dataset": c.record.dataset, "passage_id": c.outcome.job.record.id,
             "type": c.outcome.job.values["type"], "persona": c.outcome.job.values.get("persona"),
             "judge": judged.scores.get(c.record.id) if judged else None}
            for c in kept if c.outcome.job.strategy == QUERIES]


def _query_report(corpora: dict[str, pa.Table], outcomes: list, filtered: list[dict[str, Any]],
                  kept: list[Candidate], judged: Judged | None) -> dict[str, Any]:
    """What query generation did, per corpus: passages asked about, queries generated, judged, kept
    and dropped by filter, and a few kept and dropped examples (the stage report shows them)."""
    rows = {r["id"]: r for r in _query_rows(kept, judged)}
    out = {}
    for name, table in sorted(corpora.items()):
        asked = [o for o in outcomes if o.job.strategy == QUERIES and o.job.dataset == name]
        mine = [c for c in kept if c.outcome.job.strategy == QUERIES and c.record.dataset == name]
        dropped = [r for r in filtered if r["strategy"] == QUERIES and r["dataset"] == name]
        out[name] = {"passages": table.num_rows, "passages_asked": len({o.job.record.id for o in asked}),
                     "requests": len(asked), "answered": sum(o.answer is not None for o in asked),
                     "generated": sum(len(o.answer.queries) for o in asked if o.answer is not None),
                     "judged": sum(o.job.dataset == name for o in judged.outcomes) if judged else None,
                     "kept": len(mine), "dropped": dict(Counter(r["reason"] for r in dropped)),
                     "kept_examples": [{"query": c.record.query, "passage": c.record.positives[0][:300],
                                        "type": c.outcome.job.values["type"],
                                        **{k: rows[c.record.id][k] for k in ("persona", "judge")
                                           if rows[c.record.id][k] is not None}} for c in mine[:5]],
                     "dropped_examples": [{"reason": r["reason"], "generated": r["generated"], "scores": r["scores"]}
                                          for r in dropped[:5]]}
    return out


def _strategy_counts(outcomes: list, filtered: list[dict[str, Any]], kept: list[Candidate]) -> dict[str, dict]:
    strategies: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        s = strategies[o.job.strategy]
        s["requested"] += 1
        s["answered" if o.answer is not None else f"failed:{o.reason}"] += 1
    for row in filtered:
        strategies[row["strategy"]][f"filtered:{row['reason']}"] += 1
    for c in kept:
        strategies[c.outcome.job.strategy]["kept"] += 1
    return {k: dict(v) for k, v in sorted(strategies.items())}


def _samples(kept: list[Candidate]) -> list[dict[str, Any]]:
    """Up to three kept answers per dataset and strategy, before and after."""
    samples = []
    for (ds, strategy), group in _group(kept).items():
        for c in group[:3]:
            samples.append({"dataset": ds, "strategy": strategy, "source_id": c.outcome.job.record.id,
                            "before": json.dumps(c.outcome.job.values, ensure_ascii=False),
                            "after": json.dumps(c.generated, ensure_ascii=False)})
    return samples


def _group(kept: list[Candidate]) -> dict[tuple[str, str], list[Candidate]]:
    out: dict[tuple[str, str], list[Candidate]] = defaultdict(list)
    for c in kept:
        out[(c.outcome.job.dataset, c.outcome.job.strategy)].append(c)
    return out


FAILURE_FIELDS = {"dataset": pa.string(), "source_id": pa.string(), "strategy": pa.string(), "prompt": pa.string(),
                  "reason": pa.string(), "detail": pa.string(), "raw": pa.string(), "attempts": pa.int64()}
FILTERED_FIELDS = {"dataset": pa.string(), "source_id": pa.string(), "strategy": pa.string(), "reason": pa.string(),
                   "generated": pa.string(), "scores": pa.string()}
QUERY_FIELDS = {"id": pa.string(), "dataset": pa.string(), "passage_id": pa.string(), "type": pa.string(),
                "persona": pa.string(), "judge": pa.float64()}
SAMPLE_FIELDS = {"dataset": pa.string(), "strategy": pa.string(), "source_id": pa.string(), "before": pa.string(),
                 "after": pa.string()}


def _table(rows: list[dict[str, Any]], fields: dict[str, pa.DataType]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=pa.schema(list(fields.items())))

"""The synthesize stage: prepare's records → the same records plus LLM-made ones (QZhou §4, §6.1).

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
(source vs. kept generated text) and ``manifest.json`` (requests, cache hits, tokens, failures by
reason, kept vs. filtered per strategy). Requests are cached in ``<run_dir>/cache/llm.sqlite``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from embed_core.artifacts import StageWriter, read_manifest, read_records
from embed_core.config import RunConfig, SynthesizeConfig, config_hash
from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.fingerprint import Fingerprint
from embed_core.prepare.cleaning import EvalTexts, contaminated_field, normalize_text
from embed_core.progress import Progress
from embed_core.schema import Record, records_to_table, table_to_records
from embed_core.stages import records_upstream
from embed_core.synthesize.cache import RequestCache
from embed_core.synthesize.client import LLMClient, RequestFailed
from embed_core.synthesize.prompts import MalformedAnswer, PromptTemplate, load_templates, template_versions

log = logging.getLogger("embedpipe.synthesize")
STAGE = "synthesize"
# Libraries whose versions are part of this stage's code identity (embed_core.fingerprint).
LIBRARIES = ("openai", "torch", "transformers")
SENTENCE_TASKS = frozenset({"nli", "sts", "pair_classification", "classification"})


def _cfg(config: RunConfig) -> SynthesizeConfig:
    if config.synthesize is None:
        raise ConfigError("the run config has no 'synthesize' section")
    return config.synthesize


def input_fingerprint(config: RunConfig, run_dir: str | Path) -> Fingerprint:
    """Upstream output hashes + synthesize config + prompt templates (version and bytes) + filter model.

    The LLM's weights are not hashed (a remote server's cannot be): the model *name* is in the
    config, and the request cache is keyed by it.
    """
    from embed_core.model.encoder import model_fingerprint

    cfg = _cfg(config)
    up = records_upstream(config, STAGE)
    upstream = read_manifest(Path(run_dir), up)
    if upstream is None:
        raise EmbedpipeError(f"{Path(run_dir) / up}: no manifest.json — run the {up} stage first")
    templates = load_templates(cfg.prompt_dir)
    filter_fp = model_fingerprint(cfg.filter.model, "mean", cfg.filter.max_length, False)
    return Fingerprint.of(STAGE, __name__, LIBRARIES, {
        "upstream": {n: i["sha256"] for n, i in upstream["outputs"].items()}, "config": config_hash(cfg),
        "prompts": {n: [t.version, t.digest] for n, t in templates.items()}, "filter_model": filter_fp,
        "contamination": [s.model_dump(mode="json") for s in config.prepare.contamination], "seed": config.seed},
        details={"prompt_versions": template_versions(templates)})


@dataclass
class Job:
    strategy: str
    dataset: str
    record: Record
    template: PromptTemplate
    values: dict[str, str]


@dataclass
class Outcome:
    job: Job
    answer: Any = None            # validated answer model, or None
    reason: str = ""              # failure reason when answer is None
    detail: str = ""
    raw: str | None = None
    attempts: int = 0


def _selected_for_negative(record_id: str, seed: int, fraction: float) -> bool:
    """Deterministic per-record draw (stable across reruns and record order)."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{record_id}".encode()).digest()[:8], "big")
    return h / 2 ** 64 < fraction


def plan_jobs(cfg: SynthesizeConfig, dataset: str, records: list[Record], templates: dict[str, PromptTemplate],
              seed: int) -> list[Job]:
    jobs: list[Job] = []
    originals = [r for r in records if r.origin == "original"]
    if cfg.max_records_per_dataset is not None:
        originals = originals[: cfg.max_records_per_dataset]
    for rec in originals:
        if rec.task == "retrieval" and rec.positives:
            values = {"query": rec.query, "positive": rec.positives[0]}
            if "paraphrase" in cfg.strategies:
                jobs.append(Job("paraphrase", dataset, rec, templates["paraphrase-retrieval"], values))
            if "augmentation" in cfg.strategies:
                jobs.append(Job("augmentation", dataset, rec, templates["augmentation-retrieval"], values))
            if "hard_negative" in cfg.strategies and _selected_for_negative(rec.id, seed, cfg.hard_negative_fraction):
                jobs.append(Job("hard_negative", dataset, rec, templates["hard_negative-retrieval"], values))
        elif rec.task in SENTENCE_TASKS and "paraphrase" in cfg.strategies:
            jobs.append(Job("paraphrase", dataset, rec, templates["paraphrase-sentence"], {"query": rec.query}))
    return jobs


async def _run_job(client: LLMClient, job: Job, mode: str, max_parse_retries: int) -> Outcome:
    tpl = job.template
    prompt = tpl.render(mode, job.values)
    last_error, last_raw = "", None
    for attempt in range(max_parse_retries + 1):
        try:
            answer = await client.complete(prompt_name=tpl.name, prompt_version=tpl.version, prompt=prompt,
                                           stop=tpl.stop, attempt=attempt, schema=tpl.answer_schema())
        except RequestFailed as exc:
            return Outcome(job, reason=exc.reason, detail=exc.detail, raw=last_raw, attempts=attempt + 1)
        try:
            return Outcome(job, answer=tpl.parse(mode, answer.text), raw=answer.text, attempts=attempt + 1)
        except MalformedAnswer as exc:
            last_error, last_raw = str(exc), answer.text
    return Outcome(job, reason="malformed", detail=last_error, raw=last_raw, attempts=max_parse_retries + 1)


async def _run_jobs(client: LLMClient, jobs: list[Job], mode: str, max_parse_retries: int) -> list[Outcome]:
    bar = Progress("synthesize", total=len(jobs), unit="jobs", logger=log)
    failed = 0

    async def one(job: Job) -> Outcome:
        nonlocal failed
        outcome = None
        try:
            outcome = await _run_job(client, job, mode, max_parse_retries)
            return outcome
        finally:
            failed += outcome is None or outcome.answer is None
            bar.update(1, requests=client.stats.requests, in_flight=client.in_flight, failed=failed)

    try:
        return list(await asyncio.gather(*(one(j) for j in jobs)))
    finally:
        bar.close()
        await client.aclose()


def generate(cfg: SynthesizeConfig, jobs: list[Job], run_dir: Path, seed: int) -> tuple[list[Outcome], dict[str, Any]]:
    """Ask the LLM for every job (cache first); launches the local llama.cpp server if configured
    and only if some request is not cached."""
    from embed_core.synthesize.server import LlamaCppServer, resolve_gguf

    cache = RequestCache(run_dir / "cache" / "llm.sqlite")
    server: LlamaCppServer | None = None
    server_info: dict[str, Any] = {"launched": False}

    async def launch() -> str:
        nonlocal server
        if cfg.server.launch != "llama_cpp":
            return cfg.server.base_url or ""
        server = LlamaCppServer(resolve_gguf(cfg.server.gguf), model_alias=cfg.server.model, port=cfg.server.port,
                                n_ctx=cfg.server.n_ctx, log_path=run_dir / "logs" / "llama-server.log",
                                startup_timeout_s=cfg.server.startup_timeout_s, n_threads=cfg.server.n_threads)
        t0 = time.perf_counter()
        url = await asyncio.to_thread(server.start)
        server_info.update(launched=True, startup_s=round(time.perf_counter() - t0, 2), gguf=server.gguf.name,
                           base_url=url)
        return url

    client = LLMClient(cfg.server, cfg.sampling, cache, max_requests=cfg.max_requests, max_tokens=cfg.max_tokens,
                       before_first_request=launch, seed=seed)
    try:
        outcomes = asyncio.run(_run_jobs(client, jobs, cfg.server.mode, cfg.max_parse_retries))
    finally:
        if server is not None:
            server.stop()
        cache_size = len(cache)
        cache.close()
    return outcomes, {**client.stats.as_dict(), "cache_size": cache_size, "server": server_info}


# ---------------------------------------------------------------- candidates and filters

@dataclass
class Candidate:
    outcome: Outcome
    record: Record                        # the record to write (new, or the source with a negative)
    generated: dict[str, str]             # field -> generated text
    pairs: list[tuple[str, str, str]]     # (check name, text a, text b) similarities to compute


def to_candidate(o: Outcome) -> Candidate:
    rec, a, strategy = o.job.record, o.answer, o.job.strategy
    if strategy == "hard_negative":
        scores = [] if not rec.negative_scores else [float("nan")] + list(rec.negative_scores)
        new = replace(rec, negatives=[a.negative, *rec.negatives], negative_scores=scores, origin="llm_negative")
        return Candidate(o, new, {"negative": a.negative},
                         [("negative", rec.query, a.negative), ("positive", rec.query, rec.positives[0])])
    if rec.task == "retrieval":
        suffix = "para" if strategy == "paraphrase" else "aug"
        new = Record(id=f"{rec.id}~{suffix}", dataset=rec.dataset, task=rec.task, instruction=rec.instruction,
                     query=a.query, positives=[a.positive],
                     positive_scores=list(rec.positive_scores[:1]) if strategy == "paraphrase" else [],
                     negatives=list(rec.negatives) if strategy == "paraphrase" else [],
                     negative_scores=list(rec.negative_scores) if strategy == "paraphrase" else [],
                     origin=strategy, source_ref=rec.source_ref)
        checks = [("pair", a.query, a.positive)]
        if strategy == "paraphrase":
            checks += [("query_rewrite", rec.query, a.query), ("positive_rewrite", rec.positives[0], a.positive)]
        return Candidate(o, new, {"query": a.query, "positive": a.positive}, checks)
    new = replace(rec, id=f"{rec.id}~para", query=a.text, origin="paraphrase")
    return Candidate(o, new, {"query": a.text}, [("query_rewrite", rec.query, a.text)])


def filter_candidates(cfg: SynthesizeConfig, candidates: list[Candidate], existing: dict[str, set[str]],
                      evals: EvalTexts, embed) -> tuple[list[Candidate], list[dict[str, Any]]]:
    """(kept, filtered rows). ``existing``: normalised texts per dataset (grows with kept texts)."""
    f = cfg.filter
    filtered: list[dict[str, Any]] = []

    def drop(c: Candidate, reason: str, scores: dict[str, float] | None = None) -> None:
        filtered.append({"dataset": c.outcome.job.dataset, "source_id": c.outcome.job.record.id,
                         "strategy": c.outcome.job.strategy, "reason": reason,
                         "generated": json.dumps(c.generated, ensure_ascii=False),
                         "scores": json.dumps(scores or {})})

    survivors = []
    for c in candidates:  # cheap checks first: over-long text is never embedded
        texts = list(c.generated.values())
        if any(len(t) < f.min_chars for t in texts):
            drop(c, "too_short")
        elif any(len(t) > f.max_chars for t in texts):
            drop(c, "too_long")
        else:
            survivors.append(c)

    unique = sorted({t for c in survivors for _, a, b in c.pairs for t in (a, b)})
    vecs = dict(zip(unique, embed(unique))) if unique else {}
    kept = []
    for c in survivors:  # in order: a text kept earlier makes a later identical one a duplicate
        src, ds = c.outcome.job.record, c.outcome.job.dataset
        s = {name: float(np.dot(vecs[a], vecs[b])) for name, a, b in c.pairs}
        if c.outcome.job.strategy == "paraphrase" and normalize_text(c.record.query) == normalize_text(src.query):
            drop(c, "copy_of_source")
        elif any(normalize_text(t) in existing[ds] for t in c.generated.values()):
            drop(c, "duplicate")
        elif _copies_prompt(c):
            drop(c, "copied_from_prompt")
        elif (fld := contaminated_field(c.record, evals)) is not None:
            drop(c, f"contaminated:{fld}")
        elif s.get("query_rewrite", 1.0) < f.paraphrase_min_sim or s.get("positive_rewrite", 1.0) < f.paraphrase_min_sim:
            drop(c, "rewrite_drifted", s)
        elif "pair" in s and s["pair"] < f.pair_min_sim:
            drop(c, "low_query_positive", s)
        elif "negative" in s and s["negative"] >= s["positive"] - f.negative_margin:
            drop(c, "negative_not_below_positive", s)
        elif "negative" in s and s["negative"] < f.negative_min_sim:
            drop(c, "negative_below_floor", s)
        else:
            if "negative" in s and c.record.negative_scores:
                c.record.negative_scores[0] = s["negative"]
            existing[ds].update(normalize_text(t) for t in c.generated.values())
            kept.append(c)
    return kept, filtered


def _copies_prompt(c: Candidate) -> bool:
    """Small base models often repeat a few-shot example instead of answering (seen with Gemma-3-270M)."""
    tpl = c.outcome.job.template
    prompt = normalize_text(" ".join([tpl.completion, tpl.chat_system, tpl.chat_user]))
    return any(len(t) >= 20 and normalize_text(t) in prompt for t in c.generated.values())


# ---------------------------------------------------------------- the stage

def run_synthesize(config: RunConfig, run_dir: str | Path, fingerprint: Fingerprint | None = None) -> dict[str, Any]:
    from embed_core.prepare.stage import collect_eval_texts

    cfg = _cfg(config)
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    fingerprint = fingerprint or input_fingerprint(config, run_dir)
    templates = load_templates(cfg.prompt_dir)
    up = records_upstream(config, STAGE)
    tables = read_records(run_dir, up)
    records = {name.removesuffix(".parquet"): table_to_records(t) for name, t in sorted(tables.items())}
    chosen = [ds for ds, recs in records.items()
              if (cfg.datasets is None or ds in cfg.datasets) and len(recs) <= cfg.max_dataset_rows]
    if cfg.datasets:
        unknown = sorted(set(cfg.datasets) - set(records))
        if unknown:
            raise ConfigError(f"synthesize.datasets: no dataset named {', '.join(unknown)} in {run_dir / up}")
    jobs = [j for ds in chosen for j in plan_jobs(cfg, ds, records[ds], templates, config.seed)]
    log.info("synthesize: %d requests planned over %d datasets", len(jobs), len(chosen))

    t_gen = time.perf_counter()
    outcomes, client_stats = generate(cfg, jobs, run_dir, config.seed) if jobs else ([], {"requests": 0})
    gen_s = time.perf_counter() - t_gen

    encoder = None

    def embed(texts: list[str]) -> np.ndarray:
        nonlocal encoder
        if encoder is None:
            from embed_core.model.encoder import Encoder

            encoder = Encoder(cfg.filter.model, pooling="mean", max_length=cfg.filter.max_length, precision="fp32")
        return encoder.encode(texts, batch_size=64)

    existing = {ds: {normalize_text(t) for r in records[ds] for t in r.texts()} for ds in chosen}
    evals = collect_eval_texts(config)
    answered = [o for o in outcomes if o.answer is not None]
    kept, filtered = filter_candidates(cfg, [to_candidate(o) for o in answered], existing, evals, embed)

    by_ds: dict[str, list[Candidate]] = defaultdict(list)
    for c in kept:
        by_ds[c.outcome.job.dataset].append(c)
    out_tables: dict[str, pa.Table] = {}
    for ds, recs in records.items():
        negs = {c.record.id: c.record for c in by_ds.get(ds, []) if c.outcome.job.strategy == "hard_negative"}
        new = [c.record for c in by_ds.get(ds, []) if c.outcome.job.strategy != "hard_negative"]
        out_tables[f"{ds}.parquet"] = records_to_table([negs.get(r.id, r) for r in recs] + new)

    strategies: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        s = strategies[o.job.strategy]
        s["requested"] += 1
        s["answered" if o.answer is not None else f"failed:{o.reason}"] += 1
    for row in filtered:
        strategies[row["strategy"]][f"filtered:{row['reason']}"] += 1
    for c in kept:
        strategies[c.outcome.job.strategy]["kept"] += 1
    failures = [{"dataset": o.job.dataset, "source_id": o.job.record.id, "strategy": o.job.strategy,
                 "prompt": f"{o.job.template.name}@{o.job.template.version}", "reason": o.reason,
                 "detail": o.detail, "raw": o.raw, "attempts": o.attempts} for o in outcomes if o.answer is None]
    samples = []
    for (ds, strategy), group in _group(kept).items():
        for c in group[:3]:
            src = c.outcome.job.record
            samples.append({"dataset": ds, "strategy": strategy, "source_id": src.id,
                            "before": json.dumps(c.outcome.job.values, ensure_ascii=False),
                            "after": json.dumps(c.generated, ensure_ascii=False)})

    with StageWriter(run_dir, STAGE) as writer:
        for name, table in out_tables.items():
            writer.write_table(name, table, kind="records")
        writer.write_table("_failures.parquet", _table(failures, FAILURE_FIELDS), kind="stats")
        writer.write_table("_filtered.parquet", _table(filtered, FILTERED_FIELDS), kind="stats")
        writer.write_table("_samples.parquet", _table(samples, SAMPLE_FIELDS), kind="stats")
        manifest = writer.commit({
            "run_name": config.run_name,
            "input_fingerprint": fingerprint.key,
            "code": fingerprint.code,
            "llm": {"model": cfg.server.model, "mode": cfg.server.mode, "base_url": cfg.server.base_url,
                    "base_urls": cfg.server.base_urls,
                    "launch": cfg.server.launch, "api_key_env": cfg.server.api_key_env},
            "prompt_versions": fingerprint.details["prompt_versions"],
            "settings": cfg.model_dump(mode="json"),
            "counts": {"datasets": [{"dataset": ds, "records": len(records[ds]), "synthesized": ds in chosen,
                                     "added": sum(1 for c in by_ds.get(ds, []) if c.outcome.job.strategy != "hard_negative"),
                                     "llm_negatives": sum(1 for c in by_ds.get(ds, []) if c.outcome.job.strategy == "hard_negative")}
                                    for ds in records],
                       "strategies": {k: dict(v) for k, v in sorted(strategies.items())},
                       "client": client_stats,
                       "failed": len(failures), "filtered": len(filtered), "kept": len(kept)},
            "timings_s": {"generate": round(gen_s, 3), "total": round(time.perf_counter() - t0, 3)},
        })
    return manifest


def _group(kept: list[Candidate]) -> dict[tuple[str, str], list[Candidate]]:
    out: dict[tuple[str, str], list[Candidate]] = defaultdict(list)
    for c in kept:
        out[(c.outcome.job.dataset, c.outcome.job.strategy)].append(c)
    return out


FAILURE_FIELDS = {"dataset": pa.string(), "source_id": pa.string(), "strategy": pa.string(), "prompt": pa.string(),
                  "reason": pa.string(), "detail": pa.string(), "raw": pa.string(), "attempts": pa.int64()}
FILTERED_FIELDS = {"dataset": pa.string(), "source_id": pa.string(), "strategy": pa.string(), "reason": pa.string(),
                   "generated": pa.string(), "scores": pa.string()}
SAMPLE_FIELDS = {"dataset": pa.string(), "strategy": pa.string(), "source_id": pa.string(), "before": pa.string(),
                 "after": pa.string()}


def _table(rows: list[dict[str, Any]], fields: dict[str, pa.DataType]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=pa.schema(list(fields.items())))


def format_counts(manifest: dict[str, Any]) -> str:
    c = manifest["counts"]
    cl = c["client"]
    lines = [f"{'strategy':<15}{'requested':>10}{'answered':>9}{'kept':>6}  failed / filtered"]
    for name, s in c["strategies"].items():
        other = ", ".join(f"{k} {v}" for k, v in sorted(s.items()) if ":" in k)
        lines.append(f"{name:<15}{s.get('requested', 0):>10}{s.get('answered', 0):>9}{s.get('kept', 0):>6}  {other}")
    lines.append(f"requests {cl.get('requests', 0)} (retries {cl.get('retries', 0)}), cache hits {cl.get('cache_hits', 0)}, "
                 f"tokens {cl.get('tokens', 0)}" + (", budget spent" if cl.get("budget_exhausted") else ""))
    lines.append("added per dataset: " + ", ".join(f"{d['dataset']} +{d['added']} ({d['llm_negatives']} negatives)"
                                                   for d in c["datasets"] if d["synthesized"]))
    return "\n".join(lines)

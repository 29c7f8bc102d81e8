"""The synthesize stage's requests: one job per (record, strategy) the config asks for, sent to the
LLM (request cache first; the local llama.cpp server launched only when a request is not cached)
and parsed into validated answers."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from embed_core.progress import Progress
from embed_core.schema import Record
from embed_core.synthesize.cache import RequestCache
from embed_core.synthesize.client import LLMClient, RequestFailed
from embed_core.synthesize.config import SynthesizeConfig, request_cache_path
from embed_core.synthesize.prompts import MalformedAnswer, PromptTemplate

log = logging.getLogger("embedpipe.synthesize")
SENTENCE_TASKS = frozenset({"nli", "sts", "pair_classification", "classification"})


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


Ask = Callable[[LLMClient, Job, str, int], Awaitable[Outcome]]


async def _run_jobs(client: LLMClient, jobs: list[Job], mode: str, max_parse_retries: int,
                    ask: Ask = _run_job) -> list[Outcome]:
    bar = Progress("synthesize", total=len(jobs), unit="jobs", logger=log)
    failed = 0

    async def one(job: Job) -> Outcome:
        nonlocal failed
        outcome = None
        try:
            outcome = await ask(client, job, mode, max_parse_retries)
            return outcome
        finally:
            failed += outcome is None or outcome.answer is None
            bar.update(1, requests=client.stats.requests, in_flight=client.in_flight, failed=failed)

    try:
        return list(await asyncio.gather(*(one(j) for j in jobs)))
    finally:
        bar.close()
        await client.aclose()


class Servers:
    """Where a stage's requests go, for all its rounds (generation, then the judge): the configured
    URLs, or the local llama.cpp server(s), started at the first request that misses the cache of
    any round and stopped when the stage's ``with`` block ends (so the judge reuses them)."""

    def __init__(self, cfg: SynthesizeConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.info: dict[str, Any] = {"launched": False}
        self._servers = None
        self._urls: list[str] | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc) -> None:
        if self._servers is not None:
            self._servers.stop()
            self._servers = None

    def _start(self) -> list[str]:
        from embed_core.synthesize.server import LlamaCppServers, resolve_gguf, resolve_slots

        with self._lock:
            if self._urls is not None:
                return self._urls
            server = self.cfg.server
            self._servers = LlamaCppServers(resolve_gguf(server.gguf), slots=resolve_slots(server),
                                            model_alias=server.model, port=server.port, n_ctx=server.n_ctx,
                                            log_path=self.run_dir / "logs" / "llama-server.log",
                                            startup_timeout_s=server.startup_timeout_s, n_threads=server.n_threads)
            t0 = time.perf_counter()
            self._urls = self._servers.start()
            self.info.update(launched=True, startup_s=round(time.perf_counter() - t0, 2), gguf=self._servers.gguf.name,
                             base_url=self._urls[0], base_urls=self._urls, slots=len(self._urls),
                             threads_per_slot=self._servers.threads_per_slot)
            return self._urls

    async def urls(self) -> list[str]:
        """The endpoints to send requests to (launching the local servers the first time). They start
        in the calling thread, the stage's own (each round's event loop runs in it): a server dies
        with the thread that started it (``embed_core.procs``), and an executor thread of one
        round's loop would end with that round, taking the judge's server with it."""
        if self.cfg.server.launch != "llama_cpp":
            return [self.cfg.server.base_url] if self.cfg.server.base_url else []
        return self._start()


def generate(cfg: SynthesizeConfig, jobs: list[Job], run_dir: Path, seed: int, *, ask: Ask = _run_job,
             spent: dict[str, Any] | None = None, servers: Servers | None = None) -> tuple[list[Outcome], dict[str, Any]]:
    """Ask the LLM for every job (cache first); launches the local llama.cpp server(s) if configured
    and only if some request is not cached. ``ask``: how one job is asked (the judge's differs);
    ``spent``: client stats of an earlier round of this run, taken off the run budget; ``servers``:
    the stage's servers, shared with its other rounds (without it, this round's own, stopped at its end)."""
    if servers is None:
        with Servers(cfg, run_dir) as own:
            return generate(cfg, jobs, run_dir, seed, ask=ask, spent=spent, servers=own)
    cache = RequestCache(request_cache_path(cfg, run_dir))
    spent = spent or {}
    client = LLMClient(cfg.server, cfg.sampling, cache, before_first_request=servers.urls, seed=seed,
                       max_requests=None if cfg.max_requests is None else max(0, cfg.max_requests - spent.get("requests", 0)),
                       max_tokens=None if cfg.max_tokens is None else max(0, cfg.max_tokens - spent.get("tokens", 0)))
    try:
        outcomes = asyncio.run(_run_jobs(client, jobs, cfg.server.mode, cfg.max_parse_retries, ask))
    finally:
        cache_size = len(cache)
        cache.close()
    return outcomes, {**client.stats.as_dict(), "cache_size": cache_size, "server": dict(servers.info)}

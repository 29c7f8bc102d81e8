"""llama.cpp parallel slots: requests per minute and completion tokens per second of the synthesize
stage's embedded server (packaged Gemma-3-270M) at 1 slot and at N slots (N server processes,
``embed_core.synthesize.server.LlamaCppServers``), the same requests each time, sent concurrently
through the stage's own client (``LLMClient``: the OpenAI client, requests shared among the slots).

    .venv/bin/python tests/benchmarks/bench_llama_slots.py [--requests 24] [--slots 1,2] [--threads 2]

The requests: the packaged ``queries-question`` prompt (completion mode) on the first ``--requests``
SciFact passages, temperature 0 and a fixed ``--max-tokens`` (equal work at every setting: the
completion tokens are printed too). ``--threads`` is the total split among the slots (each gets
``threads // slots``, at least one; default: every core, so 1 slot x 2 threads is compared with 2
slots x 1 thread on 2 cores). Prints one line per setting and ``RATIO slots<N>_vs_1_…`` lines; run it
on an otherwise idle machine (llama.cpp's threads spin, so any other load changes the answer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from embed_core.synthesize.cache import RequestCache
from embed_core.synthesize.client import LLMClient
from embed_core.synthesize.config import LLMServerConfig, SamplingConfig
from embed_core.synthesize.prompts import load_templates
from embed_core.synthesize.queries import persona_note
from embed_core.synthesize.server import LlamaCppServers, resolve_gguf, split_threads

CORPUS = Path(os.environ.get("EMBEDPIPE_DATA", "/work/shared/data")) / "beir" / "scifact" / "corpus.jsonl"


def prompts(n: int) -> tuple[list[str], tuple[str, ...]]:
    """The queries-question completion prompt on the first ``n`` SciFact passages, and its stops."""
    template = load_templates(None)["queries-question"]
    rendered = []
    with CORPUS.open(encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            rendered.append(template.render("completion", {"passage": f"{doc['title']}\n\n{doc['text']}", "k": "1",
                                                         "persona_note": persona_note(None)}))
            if len(rendered) == n:
                break
    return rendered, tuple(template.stop)


async def _send_all(client: LLMClient, batch: list[str], stop: tuple[str, ...]) -> None:
    await asyncio.gather(*(client.complete(prompt_name="bench", prompt_version="1", prompt=p, stop=stop)
                           for p in batch))
    await client.aclose()


def measure(slots: int, threads: int, batch: list[str], stop: tuple[str, ...], args) -> dict:
    """Start ``slots`` servers, warm each up, then time the batch through a fresh (empty-cache) client."""
    server_cfg = LLMServerConfig(model="gemma", launch="llama_cpp", slots=slots, n_threads=max(threads, slots),
                                 max_concurrency=args.concurrency, timeout_s=600, max_retries=0)
    sampling = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=args.max_tokens, seed=0)
    with tempfile.TemporaryDirectory() as tmp, \
            LlamaCppServers(resolve_gguf("default"), slots=slots, model_alias="gemma", n_threads=max(threads, slots),
                            log_path=Path(tmp) / "llama-server.log") as servers:
        urls = servers.base_urls

        async def launched() -> list[str]:
            return urls

        warm = LLMClient(server_cfg, sampling, RequestCache(Path(tmp) / "warm.sqlite"), before_first_request=launched)
        asyncio.run(_send_all(warm, [f"warm-up {i}: {batch[0]}" for i in range(slots)], stop))
        client = LLMClient(server_cfg, sampling, RequestCache(Path(tmp) / "bench.sqlite"),
                           before_first_request=launched)
        t0 = time.perf_counter()
        asyncio.run(_send_all(client, batch, stop))
        seconds = time.perf_counter() - t0
    stats = client.stats
    return {"slots": slots, "threads_per_slot": split_threads(max(threads, slots), slots), "seconds": seconds,
            "requests_per_min": 60 * len(batch) / seconds, "tokens_per_s": stats.completion_tokens / seconds,
            "completion_tokens": stats.completion_tokens, "errors": dict(stats.errors),
            "answered": {u.rsplit(":", 1)[1].split("/")[0]: e["answered"] for u, e in stats.endpoints.items()}}


def main() -> None:
    cores = os.cpu_count() or 1
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=24, help="M: requests per setting (the same ones each time)")
    ap.add_argument("--slots", default=f"1,{max(2, cores)}", help="comma-separated slot counts; the first is the base")
    ap.add_argument("--threads", type=int, default=cores, help="total llama.cpp threads, split among the slots")
    ap.add_argument("--max-tokens", type=int, default=48, help="max completion tokens per request")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight per slot (max_concurrency)")
    args = ap.parse_args()
    batch, stop = prompts(args.requests)
    settings = [int(s) for s in args.slots.split(",")]
    results = []
    for slots in settings:
        r = measure(slots, args.threads, batch, stop, args)
        results.append(r)
        print(f"slots={r['slots']} threads_per_slot={r['threads_per_slot']} requests={len(batch)} "
              f"seconds={r['seconds']:.1f} requests_per_min={r['requests_per_min']:.1f} "
              f"tokens_per_s={r['tokens_per_s']:.1f} completion_tokens={r['completion_tokens']} "
              f"answered_per_port={r['answered']} errors={r['errors']}", flush=True)
    base = results[0]
    for r in results[1:]:
        print(f"RATIO slots{r['slots']}_vs_{base['slots']}_requests_per_min="
              f"{r['requests_per_min'] / base['requests_per_min']:.3f} "
              f"tokens_per_s={r['tokens_per_s'] / base['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()

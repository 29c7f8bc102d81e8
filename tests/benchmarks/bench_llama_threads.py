"""llama.cpp thread count vs a busy machine: generation tokens/s of the embedded Gemma-3-270M server
with the machine idle, with one other process spinning on a core, and with a torch process using
its default thread pool (what the demo runs beside it), for each thread setting.

    .venv/bin/python tests/benchmarks/bench_llama_threads.py [--requests 6]

Prints one line per (threads, load) and ``RATIO busy_vs_idle_<rule>=…`` for the default rule
(``embed_core.synthesize.server.default_threads``) and for all cores. llama.cpp's threads spin at
barriers, so a thread that loses its core stalls the others: the ratio shows what a busy core costs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

from openai import OpenAI

from embed_core.synthesize.server import LlamaCppServer, default_threads, resolve_gguf

PROMPT = ("Rewrite the sentence in other words.\nSentence: A man is playing a guitar on the street.\n"
          "Rewrite: A person plays guitar outdoors.\nSentence: Scientists found a link between sleep and memory.\n"
          "Rewrite:")


def spin(stop) -> None:
    """One core: a plain busy loop."""
    while not stop.is_set():
        pass


def torch_work(stop) -> None:
    """What else runs during a demo: torch encoding with its default thread pool (one thread per core)."""
    import torch

    a = torch.randn(512, 512)
    while not stop.is_set():
        a = torch.tanh(a @ a)


LOADS = {"idle": None, "busy": spin, "torch": torch_work}


def tokens_per_s(base_url: str, requests: int) -> float:
    client = OpenAI(base_url=base_url, api_key="x")
    client.completions.create(model="gemma", prompt=PROMPT, max_tokens=8, temperature=0)  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for i in range(requests):
        r = client.completions.create(model="gemma", prompt=PROMPT, max_tokens=48, temperature=0.7, seed=i)
        tokens += r.usage.completion_tokens
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=6)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    settings = sorted({cores, default_threads()}, reverse=True)
    results: dict[tuple[int, str], float] = {}
    for threads in settings:
        with LlamaCppServer(resolve_gguf("default"), model_alias="gemma", n_threads=threads,
                            log_path=f"/tmp/llama-threads-{threads}.log") as server:
            url = server.base_url  # the with statement started it
            for load, work in LOADS.items():
                stop = multiprocessing.Event()
                spinner = multiprocessing.Process(target=work, args=(stop,)) if work else None
                if spinner:
                    spinner.start()
                try:
                    results[(threads, load)] = tokens_per_s(url, args.requests)
                finally:
                    if spinner:
                        stop.set()
                        spinner.join()
                print(f"threads={threads} load={load} tokens_per_s={results[(threads, load)]:.1f}", flush=True)
    for threads in settings:
        rule = "rule" if threads == default_threads() else "all_cores"
        for load in ("busy", "torch"):
            print(f"RATIO {load}_vs_idle_{rule}_threads{threads}="
                  f"{results[(threads, load)] / results[(threads, 'idle')]:.3f}")
    if len(settings) > 1:
        for load in ("idle", "busy", "torch"):
            print(f"RATIO {load}_rule_vs_all_cores={results[(default_threads(), load)] / results[(cores, load)]:.3f}")


if __name__ == "__main__":
    main()

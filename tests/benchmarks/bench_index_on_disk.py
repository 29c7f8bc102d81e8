"""An IVF index whose lists live on disk (``mine.index.on_disk``) against the same index in memory.

Both sides build ``--factory`` (default ``IVF1024,Flat``) over ``--vectors`` seeded random unit
vectors of 384 dimensions (all-MiniLM-L6-v2's width) through the miner's own ``build_index``, fed
``add_chunk_size`` vectors at a time as the mine stage feeds it (trained on 50,000 other vectors of
the same distribution), then search 2,000 queries for the top 40. Each side runs in its own process. Memory is reported twice: the kernel's peak RSS, which
counts the mapped list file's pages while they are resident (clean file pages the kernel may drop
under pressure), and the peak of anonymous memory (``RssAnon`` sampled every 10 ms: what cannot be
dropped, and what the on-disk lists are meant to keep small). Prints build and search time, both
peaks, whether the two return the same neighbours, and ``RATIO index_on_disk_anon_peak_vs_memory``
(on-disk anonymous peak / in-memory anonymous peak: below 1 is the point)
and ``RATIO index_on_disk_search_vs_memory`` (in-memory search time / on-disk search time).

    python tests/benchmarks/bench_index_on_disk.py [--vectors 1000000] [--factory IVF1024,Flat]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
DIM = 384
CHUNK = 16384


def vectors(start: int, count: int, seed: int = 0) -> np.ndarray:
    """Rows start..start+count of a seeded random unit-vector pool (made chunk by chunk, never whole)."""
    out = np.random.default_rng([seed, start]).standard_normal((count, DIM)).astype(np.float32)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def anon_peak_sampler() -> dict:
    """Sample this process's anonymous resident memory every 10 ms; ``peak["mb"]`` is the largest."""
    peak = {"mb": 0.0}

    def sample():
        while True:
            with open("/proc/self/status") as fh:
                kb = next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:"))
            peak["mb"] = max(peak["mb"], kb / 1024)
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    return peak


def child(on_disk: bool, n: int, factory: str, out: str) -> None:
    from embed_core.mine.config import MineConfig
    from embed_core.mine.miner import build_index

    anon = anon_peak_sampler()
    pool = [str(i) for i in range(n)]
    starts = {str(i): i for i in range(0, n, CHUNK)}

    def embed(texts: list[str]) -> np.ndarray:
        if texts[0] in starts and len(texts) <= CHUNK:  # an add chunk (the training sample is 50,000 texts)
            return vectors(int(texts[0]), len(texts))
        return np.concatenate([vectors(int(t), 1) for t in texts])  # the training sample

    settings = MineConfig(index={"factory": factory, "on_disk": on_disk, "add_chunk_size": CHUNK, "train_size": 50_000,
                                 "gpu": False})
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        index, info = build_index(pool, embed, settings, 42, Path(tmp))
        build = time.perf_counter() - t0
        queries = vectors(10**9, 2000, seed=1)
        t0 = time.perf_counter()
        _, ids = index.search(queries, 40)
        search = time.perf_counter() - t0
        np.save(out, ids)
        time.sleep(0.05)  # one more sample with the index in hand
    print("RESULT " + json.dumps({"build_s": build, "search_s": search, "info": info, "anon_peak_mb": anon["mb"],
                                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def measure(on_disk: bool, n: int, factory: str, out: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", "disk" if on_disk else "memory", "--vectors", str(n),
                           "--factory", factory, "--out", out], capture_output=True, text=True, cwd=REPO)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{'disk' if on_disk else 'memory'} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vectors", type=int, default=1_000_000)
    ap.add_argument("--factory", default="IVF1024,Flat")
    ap.add_argument("--child", choices=["memory", "disk"])
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        child(args.child == "disk", args.vectors, args.factory, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        mem = measure(False, args.vectors, args.factory, f"{tmp}/memory.npy")
        disk = measure(True, args.vectors, args.factory, f"{tmp}/disk.npy")
        same = bool((np.load(f"{tmp}/memory.npy") == np.load(f"{tmp}/disk.npy")).all())
    print(f"{args.vectors:,} vectors x {DIM}, {args.factory}, 2,000 queries, top 40")
    for name, r in (("in memory", mem), ("on disk", disk)):
        print(f"  {name:<10} build {r['build_s']:7.1f} s  search {r['search_s']:6.2f} s  peak RSS {r['peak_rss_mb']:7.0f} MB"
              f"  anonymous peak {r['anon_peak_mb']:7.0f} MB")
    print(f"  on-disk lists: {disk['info']['on_disk']['bytes'] / 1e6:,.0f} MB in {disk['info']['on_disk']['shards']} shards;"
          f" same neighbours: {same}")
    print(f"RATIO index_on_disk_anon_peak_vs_memory={disk['anon_peak_mb'] / mem['anon_peak_mb']:.3f}")
    print(f"RATIO index_on_disk_search_vs_memory={mem['search_s'] / disk['search_s']:.3f}")


if __name__ == "__main__":
    main()

"""Mining at scale: ``engine: ray`` (2 local workers) vs ``local`` over a pool of >= 200k passages,
and an IVF-PQ index vs the exact (Flat) one on the same embeddings.

    python tests/benchmarks/bench_mine_scale.py [--passages 200000] [--factory IVF1024,PQ32] [--precision auto]

Pool: every distinct real text of ../shared/data (bench_mine's large pool, 78,657 texts) topped up
to ``--passages`` with passages made of two of those texts joined (seeded); queries: SciFact train
claims and STS-B train pairs scoring >= 4 (bench_mine's). Model: the packaged all-MiniLM-L6-v2,
window ranks 10-30, margin 0.95, 4 negatives, ``--precision`` as the mine stage's (default auto:
bf16 autocast on CPUs with native bf16; in bf16 the two engines batch differently, so their
negatives may differ in near-ties). Each engine runs in its own process on an empty
embedding cache, so each encodes the whole pool: wall time, the driver's peak RSS and the largest
Ray worker's peak RSS. Then, from the warm cache (no encoding), the Flat and
the IVF-PQ index are built and searched: time, memory of the index, recall@30 of the raw search
(share of the exact top 30 that IVF-PQ returns) and the overlap of the mined negatives.

Prints ``RATIO mine_ray_vs_local`` (local wall / ray wall), ``RATIO ivfpq_recall_at_30`` and
``RATIO ivfpq_vs_flat_search`` (Flat time / IVF-PQ time), and a projection of encoding wall time
for 10M and 50M passages from the measured per-worker throughput (linear in workers: stated, not
measured).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mine import REPO, SHARED, WINDOW, large_pool  # noqa: E402

BATCH = 64


def pool_and_records(passages: int):
    from embed_core.schema import Record

    pairs, texts = large_pool()
    rng = random.Random(0)
    pool = list(texts)
    seen = set(pool)
    while len(pool) < passages:
        joined = f"{rng.choice(texts)} {rng.choice(texts)}"
        if joined not in seen:
            seen.add(joined)
            pool.append(joined)
    grouped: dict[str, list[str]] = {}
    for q, p in pairs:
        grouped.setdefault(q, []).append(p)
    records = [Record(id=f"b:{i}", dataset="b", task="retrieval", query=q, positives=ps, source_ref=f"b:{i}")
               for i, (q, ps) in enumerate(grouped.items())]
    return records, pool[:passages]


def _embedder(kind: str, cache_dir: str, precision: str):
    from embed_core.model.config import EngineConfig
    from embed_core.engine import ray_encode
    from embed_core.model.embedding_cache import EmbeddingCache
    from embed_core.model.encoder import Encoder, default_model_path, model_dim, model_fingerprint, uses_bf16

    path = default_model_path()
    dim = model_dim(path)
    cache = EmbeddingCache(cache_dir, model_fingerprint(path, "mean", 256, uses_bf16(precision, "cpu")), dim, "float32")
    engine = EngineConfig(kind=kind, num_workers=2, batch_size=2048)
    if kind == "ray":
        encode = lambda t: ray_encode(t, model=str(path), pooling="mean", max_length=256, precision=precision,  # noqa: E731
                                      batch_size=BATCH, dim=dim, engine=engine)
    else:
        enc = Encoder(path, max_length=256, precision=precision)
        encode = lambda t: enc.encode(t, batch_size=BATCH)  # noqa: E731
    return (lambda texts: cache.get_or_encode(texts, encode)), engine


def child_engine(kind: str, passages: int, cache_dir: str, precision: str) -> dict:
    from embed_core.engine import engine_session
    from embed_core.mine.config import MineConfig
    from embed_core.mine.miner import mine_records

    records, pool = pool_and_records(passages)
    embed, engine = _embedder(kind, cache_dir, precision)
    t0 = time.perf_counter()
    with engine_session(engine):
        out, stats = mine_records(records, embed, MineConfig(relative_margin=0.95, **WINDOW), corpus=pool, seed=42)
        workers_mb = ray_workers_peak_rss_mb()  # before the session stops them
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "pool": len(pool), "queries": len(records), "added": stats.negatives_added,
            "negatives": {r.query: r.negatives for r in out}, "ray_worker_peak_rss_mb": workers_mb}


def ray_workers_peak_rss_mb() -> float:
    """Largest peak RSS (VmHWM) of this machine's Ray worker processes ("ray::..." command lines):
    the raylet owns them, so the driver's rusage of its children never sees them."""
    peak = 0.0
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::"):
                for line in (proc / "status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]) / 1024)
        except OSError:
            continue
    return peak


def child_index(factory: str, passages: int, cache_dir: str, precision: str) -> dict:
    import faiss
    import numpy as np

    from embed_core.mine.config import IndexConfig, MineConfig
    from embed_core.mine.miner import mine_records

    records, pool = pool_and_records(passages)
    embed, _ = _embedder("local", cache_dir, precision)  # warm: nothing is encoded
    out: dict = {}
    for name, fac in (("flat", "Flat"), ("ivfpq", factory)):
        t0 = time.perf_counter()
        mined, stats = mine_records(records, embed, MineConfig(relative_margin=0.95, index={"factory": fac}, **WINDOW),
                                    corpus=pool, seed=42)
        out[name] = {"mine_s": time.perf_counter() - t0, "negatives": {r.query: r.negatives for r in mined},
                     "index": stats.index}
    # recall@30 of the raw search, on the same vectors and the miner's nprobe
    xb = np.ascontiguousarray(embed(pool), dtype=np.float32)
    xq = np.ascontiguousarray(embed([r.query for r in records]), dtype=np.float32)
    exact = faiss.IndexFlatIP(xb.shape[1])
    exact.add(xb)
    t0 = time.perf_counter()
    _, truth = exact.search(xq, 30)
    flat_search = time.perf_counter() - t0
    index = faiss.index_factory(xb.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    sample = xb[np.random.default_rng(0).choice(len(xb), size=min(len(xb), 100_000), replace=False)]
    t0 = time.perf_counter()
    index.train(sample)
    index.add(xb)
    build = time.perf_counter() - t0
    faiss.ParameterSpace().set_index_parameter(index, "nprobe", IndexConfig().nprobe)
    t0 = time.perf_counter()
    _, approx = index.search(xq, 30)
    approx_search = time.perf_counter() - t0
    recall = float(np.mean([len(set(a) & set(t)) / 30 for a, t in zip(approx.tolist(), truth.tolist())]))
    out.update(recall_at_30=recall, flat_search_s=flat_search, ivfpq_search_s=approx_search, ivfpq_build_s=build,
               flat_bytes=xb.nbytes, ivfpq_bytes=faiss.serialize_index(index).nbytes)
    return out


def measure(args: list[str]) -> dict:
    """Run a child in its own process; its peak RSS and that of its largest descendant from the kernel."""
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    stdout, stderr = proc.communicate()
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{' '.join(args)} failed:\n{stderr[-3000:]}")
    return json.loads(line[7:])


def overlap(a: dict, b: dict) -> float:
    shared = [q for q in a if a[q] and q in b]
    return sum(len(set(a[q]) & set(b[q])) / len(a[q]) for q in shared) / max(1, len(shared))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passages", type=int, default=200_000)
    ap.add_argument("--factory", default="IVF1024,PQ32")
    ap.add_argument("--child", choices=["local", "ray", "index"])
    ap.add_argument("--cache")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    args = ap.parse_args()
    if args.child:
        res = (child_index(args.factory, args.passages, args.cache, args.precision) if args.child == "index"
               else child_engine(args.child, args.passages, args.cache, args.precision))
        res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        res["child_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print("RESULT " + json.dumps(res))
        return
    if not (SHARED / "MANIFEST.md").exists():
        raise SystemExit(f"bench_mine_scale needs {SHARED}")
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--passages", str(args.passages), "--precision", args.precision]
        runs = {kind: measure(["--child", kind, *common, "--cache", f"{tmp}/{kind}"]) for kind in ("local", "ray")}
        idx = measure(["--child", "index", *common, "--factory", args.factory, "--cache", f"{tmp}/local"])
    local, ray = runs["local"], runs["ray"]
    from embed_core.model.encoder import uses_bf16

    print(f"pool {local['pool']:,} passages, {local['queries']:,} queries, window 10-30, 4 negatives, precision "
          f"{args.precision} ({'bf16 autocast' if uses_bf16(args.precision, 'cpu') else 'fp32'})")
    for kind, r in runs.items():
        print(f"  engine {kind:5s}: wall {r['wall_s']:8.1f} s  ({r['pool'] / r['wall_s']:6.1f} passages/s)  "
              f"peak RSS {r['peak_rss_mb']:6.0f} MB (largest Ray worker {r['ray_worker_peak_rss_mb']:6.0f} MB)  "
              f"negatives {r['added']}")
    print(f"  same negatives, ray vs local: {overlap(local['negatives'], ray['negatives']):.4f}")
    print(f"  Flat:  mine {idx['flat']['mine_s']:6.1f} s (warm cache), vectors {idx['flat_bytes'] / 1e6:7.1f} MB, "
          f"search {idx['flat_search_s']:.2f} s")
    print(f"  {args.factory}: mine {idx['ivfpq']['mine_s']:6.1f} s (warm cache), index {idx['ivfpq_bytes'] / 1e6:7.1f} MB, "
          f"build {idx['ivfpq_build_s']:.1f} s, search {idx['ivfpq_search_s']:.2f} s, recall@30 {idx['recall_at_30']:.3f}, "
          f"mined negatives shared with Flat {overlap(idx['flat']['negatives'], idx['ivfpq']['negatives']):.3f}")
    per_worker = ray["pool"] / ray["wall_s"] / 2  # encoding dominates: passages/s of one actor
    print(f"projection (measured {per_worker:.0f} passages/s per worker of this machine; linear in workers, "
          "an assumption; a GPU worker's rate must be measured on one):")
    print("  | passages | " + " | ".join(f"{n} workers" for n in (1, 8, 64)) + " |")
    for n in (10_000_000, 50_000_000):
        print(f"  | {n / 1e6:.0f}M | " + " | ".join(f"{n / (per_worker * w) / 3600:,.1f} h" for w in (1, 8, 64)) + " |")
    print(f"RATIO mine_ray_vs_local={local['wall_s'] / ray['wall_s']:.3f}")
    print(f"RATIO ivfpq_recall_at_30={idx['recall_at_30']:.3f}")
    print(f"RATIO ivfpq_vs_flat_search={idx['flat_search_s'] / idx['ivfpq_search_s']:.3f}")


if __name__ == "__main__":
    main()

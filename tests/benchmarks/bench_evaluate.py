"""Evaluation benchmark: embedpipe's evaluate stage vs mteb's own run of the same tasks
(``mteb.evaluate`` with a plain ``SentenceTransformer``), at equal precision (float32).

Same model (packaged all-MiniLM-L6-v2, max length 256), same tasks built from the same local files
(STS-B test and SciFact test from ../shared/data: ``mteb.get_tasks`` would download them, so both
sides get the task objects ``embed_core.scoring.tasks.build_task`` makes), same batch size 64, both
in fp32 (each side's default). Each side runs in a fresh subprocess with cold caches: an empty run
directory and an empty machine-wide embedding cache for ours, no result cache for mteb. Prints wall
time, peak RSS and the main score of each task for both (they must agree), our time for the same
evaluation in a second fresh run directory (the machine-wide cache now warm: what every run after
the first on a machine pays for the base model), both times and ``RATIO evaluate_vs_mteb=<peer time
/ our cold time>``, and the same ratio of the CPU seconds the timed parts used (``RATIO
evaluate_vs_mteb_cpu_time``: on a machine shared with other work, wall time measures the neighbours too). Where the CPU has native bf16 (AVX512-BF16 / AMX; or with ``--bf16``), ours once
more, cold, with ``precision: bf16`` (autocast; what ``auto`` picks on CUDA and on such CPUs): its
scores against the fp32 ones (the published-score tolerance is ±0.2) and ``RATIO
evaluate_bf16_vs_mteb``; without native bf16 it is emulated and several times slower, so it is skipped.

``--sts-rows``, ``--scifact-queries`` and ``--scifact-corpus`` shrink the tasks (the tasks'
``max_rows`` / ``max_corpus``; both sides get the same task objects) for a quick run on a busy machine.

    python tests/benchmarks/bench_evaluate.py
    python tests/benchmarks/bench_evaluate.py --sts-rows 1000 --scifact-corpus 1000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("EMBEDPIPE_SHARED_DATA", REPO.parent / "shared" / "data"))
BATCH = 64
TASKS = [
    {"name": "STSBenchmark", "type": "sts", "path": "stsb_en/stsb-en-test.csv", "header": False,
     "columns": {"text1": 0, "text2": 1, "score": 2}},
    {"name": "SciFact", "type": "retrieval", "path": "beir/scifact", "split": "test"},
]


def tasks() -> list[dict]:
    """The benchmark's tasks, shrunk as ``BENCH_SIZES`` (set by ``main`` from the options) says."""
    sizes = json.loads(os.environ.get("BENCH_SIZES", "{}"))
    out = [dict(t) for t in TASKS]
    if sizes.get("sts_rows"):
        out[0]["max_rows"] = sizes["sts_rows"]
    if sizes.get("scifact_queries"):
        out[1]["max_rows"] = sizes["scifact_queries"]
    if sizes.get("scifact_corpus"):
        out[1]["max_corpus"] = sizes["scifact_corpus"]
    return out


def config(tmp: str):
    from embed_core.config import RunConfig

    return RunConfig.model_validate({"run_name": "bench", "run_root": tmp, "data_root": str(SHARED),
                                     # prepare is not run: the stage needs a source only to be a valid run
                                     "prepare": {"sources": [{"name": "stsb", "kind": "sts", "header": False,
                                                              "path": "stsb_en/stsb-en-train.csv",
                                                              "columns": {"text1": 0, "text2": 1, "score": 2}}]},
                                     "evaluate": {"models": ["base"], "tasks": tasks(), "batch_size": BATCH}})


def run_ours(tmp: str, precision: str = "fp32") -> dict:
    import mteb  # noqa: F401 — imported before the clock starts, as the peer's are (both sides import it lazily)
    import transformers  # noqa: F401

    from embed_core.evaluate.run import main_scores, run_evaluate

    cfg = config(tmp)
    cfg.evaluate.precision = precision
    t0, c0 = time.perf_counter(), time.process_time()
    run_evaluate(cfg, Path(tmp) / "bench")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()  # a fresh run directory on the same machine: the machine-wide cache is warm
    run_evaluate(cfg, Path(tmp) / "again")
    warm = time.perf_counter() - t0
    return {"wall_s": wall, "cpu_s": cpu, "warm_s": warm, "scores": {r["task"]: r["value"] for r in main_scores(Path(tmp) / "bench")}}


def run_peer(tmp: str) -> dict:
    import mteb
    from sentence_transformers import SentenceTransformer

    from embed_core.scoring.tasks import build_task
    from embed_core.model.encoder import default_model_path

    cfg = config(tmp)
    t0, c0 = time.perf_counter(), time.process_time()
    model = SentenceTransformer(default_model_path(), device="cpu")
    model.max_seq_length = 256
    scores = {}
    for spec in cfg.evaluate.tasks:
        task = build_task(spec, cfg.resolve, seed=cfg.seed)
        result = mteb.evaluate(model, task, cache=None, encode_kwargs={"batch_size": BATCH}, show_progress_bar=False)
        scores[spec.name] = result.task_results[0].get_score()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "scores": scores}


def child(which: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["EMBEDPIPE_CACHE_DIR"] = os.path.join(tmp, "machine-cache")  # cold machine-wide cache
        res = run_peer(tmp) if which == "peer" else run_ours(tmp, "bf16" if which == "ours-bf16" else "fp32")
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(res))


def measure(which: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", which], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                               "TRANSFORMERS_OFFLINE": "1"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{which} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["ours", "ours-bf16", "peer"])
    ap.add_argument("--sts-rows", type=int, help="STS-B test pairs scored (default: all 1,379)")
    ap.add_argument("--scifact-queries", type=int, help="SciFact test queries scored (default: all 300)")
    ap.add_argument("--scifact-corpus", type=int, help="SciFact documents searched: the judged ones plus a seeded "
                    "sample (default: all 5,183)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="also time ours in bf16 (default: where the CPU has native bf16)")
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    if not (SHARED / "MANIFEST.md").exists():
        raise SystemExit(f"bench_evaluate needs {SHARED}")
    from embed_core.model.encoder import cpu_has_bf16

    os.environ["BENCH_SIZES"] = json.dumps({"sts_rows": args.sts_rows, "scifact_queries": args.scifact_queries,
                                            "scifact_corpus": args.scifact_corpus})
    peer, ours = measure("peer"), measure("ours")
    ours16 = measure("ours-bf16") if (cpu_has_bf16() if args.bf16 is None else args.bf16) else None
    sides = [("embedpipe (fp32)", ours), ("embedpipe bf16", ours16), ("mteb + SentenceTransformer (fp32)", peer)]
    for name, r in sides:
        if r is not None:
            scores = ", ".join(f"{t} {100 * v:.2f}" for t, v in r["scores"].items())
            print(f"{name:<34} wall {r['wall_s']:7.1f} s  CPU {r['cpu_s']:7.1f} s  peak RSS {r['peak_rss_mb']:6.0f} MB  "
                  f"{scores}")
    print(f"embedpipe again in a fresh run directory (machine-wide embedding cache warm): {ours['warm_s']:.1f} s")
    print(f"RATIO evaluate_vs_mteb_machine_cache_warm={peer['wall_s'] / ours['warm_s']:.3f}")
    print("fp32 scores, embedpipe minus mteb (points): " + ", ".join(
        f"{t} {100 * (v - peer['scores'][t]):+.4f}" for t, v in ours["scores"].items()))
    print(f"evaluate at equal precision (fp32): embedpipe {ours['wall_s']:.1f} s, mteb {peer['wall_s']:.1f} s")
    print(f"RATIO evaluate_vs_mteb={peer['wall_s'] / ours['wall_s']:.3f}")
    # CPU seconds of the timed part (all threads): less sensitive than wall time to other work on the machine
    print(f"RATIO evaluate_vs_mteb_cpu_time={peer['cpu_s'] / ours['cpu_s']:.3f}")
    if ours16 is not None:
        print("bf16 minus fp32 (points): " + ", ".join(f"{t} {100 * (ours16['scores'][t] - v):+.2f}"
                                                       for t, v in ours["scores"].items()))
        print(f"RATIO evaluate_bf16_vs_mteb={peer['wall_s'] / ours16['wall_s']:.3f}")


if __name__ == "__main__":
    main()

"""Evaluation benchmark: embedpipe's evaluate stage vs plain ``mteb.evaluate`` with a
``SentenceTransformer``.

Same model (packaged all-MiniLM-L6-v2, max length 256), same tasks built from the same local files
(STS-B test and SciFact test from ../shared/data: ``mteb.get_tasks`` would download them, so both
sides get the task objects ``embed_core.scoring.tasks.build_task`` makes), same batch size 64, both
in fp32 (each side's default). Each side runs in a fresh subprocess with cold caches: an empty run directory and an
empty machine-wide embedding cache for ours, no result cache for mteb. Prints wall time, peak RSS
and the main score of each task for both (they must agree), our time for the same evaluation in a
second fresh run directory (the machine-wide cache now warm: what every run after the first on a
machine pays for the base model), then ``RATIO evaluate_vs_mteb=<peer time / our cold time>``.
Then ours once more, cold, with ``precision: bf16`` (autocast; what ``auto`` picks on CUDA and on
CPUs with native bf16): its scores against the fp32 ones (the published-score tolerance is ±0.2)
and ``RATIO evaluate_bf16_vs_mteb``.

    python tests/benchmarks/bench_evaluate.py
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


def config(tmp: str):
    from embed_core.config import RunConfig

    return RunConfig.model_validate({"run_name": "bench", "run_root": tmp, "data_root": str(SHARED),
                                     # prepare is not run: the stage needs a source only to be a valid run
                                     "prepare": {"sources": [{"name": "stsb", "kind": "sts", "header": False,
                                                              "path": "stsb_en/stsb-en-train.csv",
                                                              "columns": {"text1": 0, "text2": 1, "score": 2}}]},
                                     "evaluate": {"models": ["base"], "tasks": TASKS, "batch_size": BATCH}})


def run_ours(tmp: str, precision: str = "fp32") -> dict:
    from embed_core.evaluate.run import main_scores, run_evaluate

    cfg = config(tmp)
    cfg.evaluate.precision = precision
    t0 = time.perf_counter()
    run_evaluate(cfg, Path(tmp) / "bench")
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()  # a fresh run directory on the same machine: the machine-wide cache is warm
    run_evaluate(cfg, Path(tmp) / "again")
    warm = time.perf_counter() - t0
    return {"wall_s": wall, "warm_s": warm, "scores": {r["task"]: r["value"] for r in main_scores(Path(tmp) / "bench")}}


def run_peer(tmp: str) -> dict:
    import mteb
    from sentence_transformers import SentenceTransformer

    from embed_core.scoring.tasks import build_task
    from embed_core.model.encoder import default_model_path

    cfg = config(tmp)
    t0 = time.perf_counter()
    model = SentenceTransformer(default_model_path(), device="cpu")
    model.max_seq_length = 256
    scores = {}
    for spec in cfg.evaluate.tasks:
        task = build_task(spec, cfg.resolve, seed=cfg.seed)
        result = mteb.evaluate(model, task, cache=None, encode_kwargs={"batch_size": BATCH}, show_progress_bar=False)
        scores[spec.name] = result.task_results[0].get_score()
    return {"wall_s": time.perf_counter() - t0, "scores": scores}


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
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    if not (SHARED / "MANIFEST.md").exists():
        raise SystemExit(f"bench_evaluate needs {SHARED}")
    peer, ours, ours16 = measure("peer"), measure("ours"), measure("ours-bf16")
    for name, r in (("embedpipe", ours), ("embedpipe bf16", ours16), ("mteb + SentenceTransformer", peer)):
        scores = ", ".join(f"{t} {100 * v:.2f}" for t, v in r["scores"].items())
        print(f"{name:<27} wall {r['wall_s']:7.1f} s  peak RSS {r['peak_rss_mb']:6.0f} MB  {scores}")
    print(f"embedpipe again in a fresh run directory (machine-wide embedding cache warm): {ours['warm_s']:.1f} s")
    print(f"RATIO evaluate_vs_mteb_machine_cache_warm={peer['wall_s'] / ours['warm_s']:.3f}")
    print("bf16 minus fp32 (points): " + ", ".join(f"{t} {100 * (ours16['scores'][t] - v):+.2f}"
                                                   for t, v in ours["scores"].items()))
    print(f"RATIO evaluate_vs_mteb={peer['wall_s'] / ours['wall_s']:.3f}")
    print(f"RATIO evaluate_bf16_vs_mteb={peer['wall_s'] / ours16['wall_s']:.3f}")


if __name__ == "__main__":
    main()

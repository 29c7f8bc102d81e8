"""Peak RSS per rank of a 2-rank training run as its training set grows 10x (issue 34: ≤ 64 MB growth
from 100k to 1M records), memory-mapped records (``embed_core.train.records``, what the train stage
uses) against the records read into every rank's memory (``load_datasets`` without a cache
directory: the previous behaviour, the peer).

Data: synthetic retrieval records (a 6-word query, one 20-word positive, two 20-word hard
negatives, all distinct texts), written as a prepare stage through ``StageWriter``. Model: the
tiny random-init BERT of the tests. Each run is ``torchrun --standalone --nproc_per_node 2``
(gloo) with this script as the entry (``--child``): every rank loads the datasets, builds the
trainer and takes 5 steps (batch 16 per rank, GradCache off, fp32), then reports its
``ru_maxrss``. The memory-mapped runs convert the Parquet file to Arrow once (rank 0; that copy is
timed and not counted in the ranks' figures, since it happens in the same process: the RSS peak
of the conversion is bounded by a slice of 8,192 rows, and its pages are file-backed).

    python tests/benchmarks/bench_train_records.py [--sizes 100000,1000000] [--work DIR]

Prints a table and ``RATIO mapped_peak_rss_growth_mb=<largest rank's growth from the smallest to
the largest size>`` (acceptance: ≤ 64) and the same for the in-memory peer.
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
MODES = ("mapped", "in-memory")
STEPS = 5


def words(prefix: str, i: int, n: int) -> str:
    return " ".join(f"{prefix}{(i * 7919 + k * 104729) % 99991}" for k in range(n))


def write_stage(run_dir: Path, size: int) -> float:
    """A prepare stage of ``size`` retrieval records; returns seconds taken."""
    from embed_core.artifacts import StageWriter
    from embed_core.schema import RECORD_SCHEMA

    t0 = time.perf_counter()
    with StageWriter(run_dir, "prepare") as w:
        stream = w.stream_table("synthetic.parquet", RECORD_SCHEMA, kind="records", rows_per_group=16384)
        for i in range(size):
            stream.append({"id": f"synthetic/{i}", "dataset": "synthetic", "task": "retrieval",
                           "instruction": "Given a query, retrieve the passage that answers it.",
                           "query": words("q", i, 6), "positives": [words("p", i, 20)], "positive_scores": [],
                           "negatives": [words("n", i, 20), words("m", i, 20)], "negative_scores": [],
                           "negative_labels": [], "weak_positives": [], "label": None, "origin": "original",
                           "source_ref": f"synthetic:{i}"})
        w.commit({"input_fingerprint": f"synthetic-{size}"})
    return time.perf_counter() - t0


def child(mode: str, run_dir: Path, model: Path, out: Path) -> None:
    import torch

    from embed_core.train.config import TrainConfig
    from embed_core.dist.distributed import init_process_group
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer

    train = TrainConfig.model_validate({
        "base_model": str(model), "precision": "fp32", "max_length": 32,
        "stages": [{"name": "s", "steps": STEPS, "batch_size": {"retrieval": 16}, "warmup_steps": 0,
                    "num_hard_negatives": 2, "query_max_length": 16, "passage_max_length": 32,
                    "checkpoint_every": 10**9, "log_every": 10**9}]})
    stage = train.stages[0]
    rank, _ = init_process_group(timeout_s=600)
    t0 = time.perf_counter()
    cache = run_dir / "checkpoints" / "records" if mode == "mapped" else None
    datasets = load_datasets(run_dir, stage, "prepare", cache)
    load_s = time.perf_counter() - t0
    trainer = Trainer(train, stage, datasets, init_model=str(model), checkpoint_dir=run_dir / f"ck-{mode}", seed=0,
                      log=lambda _: None)
    for _ in range(STEPS):
        trainer.train_step()
    (out / f"{mode}-{rank}.json").write_text(json.dumps({
        "rank": rank, "load_s": load_s, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def launch(mode: str, run_dir: Path, model: Path, out: Path) -> list[dict]:
    for old in out.glob(f"{mode}-*.json"):
        old.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--child", mode, "--run-dir", str(run_dir), "--model", str(model), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    files = sorted(out.glob(f"{mode}-*.json"))
    if proc.returncode != 0 or len(files) != 2:
        sys.exit(f"{mode} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    return [json.loads(f.read_text()) for f in files]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="100000,1000000")
    p.add_argument("--work", type=Path)
    p.add_argument("--child", choices=MODES)
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--model", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.child:
        child(args.child, args.run_dir, args.model, args.out)
        return
    from tests.helpers.tiny_model import build_tiny_bert

    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-records-") as tmp:
        work = args.work or Path(tmp)
        model = build_tiny_bert(work / "bert")
        peaks: dict[tuple[str, int], float] = {}
        print(f"{'records':>9} {'mode':<10}{'write s':>9}{'load s (rank 0)':>17}{'peak RSS rank 0':>17}{'rank 1':>8}")
        for size in sizes:
            run_dir = work / f"run-{size}"
            written = write_stage(run_dir, size)
            for mode in MODES:
                rows = sorted(launch(mode, run_dir, model, work), key=lambda r: r["rank"])
                peaks[mode, size] = max(r["peak_rss_mb"] for r in rows)
                print(f"{size:>9} {mode:<10}{written:>9.1f}{rows[0]['load_s']:>17.1f}"
                      f"{rows[0]['peak_rss_mb']:>15.0f} MB{rows[1]['peak_rss_mb']:>5.0f} MB", flush=True)
    for mode in MODES:
        growth = peaks[mode, sizes[-1]] - peaks[mode, sizes[0]]
        print(f"RATIO {mode.replace('-', '_')}_peak_rss_growth_mb={growth:.0f}  "
              f"({sizes[0]:,} -> {sizes[-1]:,} records, largest rank)")


if __name__ == "__main__":
    main()

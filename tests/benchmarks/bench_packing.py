"""Packed vs padded training passes on a length-skewed set, on CPU.

Data: retrieval records pairing an STS-B train sentence (the query, ~10-30 tokens) with a SciFact
passage (title + abstract, ~50-500+ tokens, cut at the passage length), ../shared/data: short
queries and long passages of widely varying length. Model: all-MiniLM-L6-v2 (the packaged
``default``), fp32 on both sides (``precision: fp32``: equal precision), InfoNCE with in-batch
negatives, the trainer's default query / passage lengths (256 / 512).

Two trainers with the same seed draw the same batches: ``packing: off`` (the trainer's padded
passes, length-bucketed: ``length_buckets`` 4) and ``packing: on`` (each text group one packed
pass: rows as wide as its longest text, block-diagonal SDPA mask). Their optimizer steps alternate,
so machine load affects both alike; the first step of each is a warm-up and not counted. Throughput
is non-padding tokens through the encoder (forward + backward + optimizer step) per second, as the
trainer logs it; the positions each side computed (padding included) are counted from its passes.

    python tests/benchmarks/bench_packing.py [--steps 4] [--batch-size 16] [--threads N]

Prints a table and ``RATIO packed_vs_padded=<packed tokens/s / padded tokens/s>``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("EMBEDPIPE_SHARED_DATA", REPO.parent / "shared" / "data"))


def load_pairs(seed: int = 0) -> list[tuple[str, str]]:
    """STS-B train sentences as queries, each paired with a SciFact passage drawn at random."""
    with open(SHARED / "stsb_en/stsb-en-train.csv", newline="", encoding="utf-8") as fh:
        queries = [a for a, _b, _score in csv.reader(fh)]
    passages = []
    for line in open(SHARED / "beir/scifact/corpus.jsonl", encoding="utf-8"):
        d = json.loads(line)
        passages.append((d.get("title", "") + " " + d["text"]).strip())
    rng = random.Random(seed)
    return [(q, rng.choice(passages)) for q in queries]


def make_trainer(packing: str, steps: int, batch: int):
    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords
    from embed_core.train.config import TrainConfig, TrainStageConfig
    from embed_core.train.engine.trainer import Trainer

    recs = [Record(id=f"skew:{i}", dataset="skew", task="retrieval", instruction="", query=q, positives=[p],
                   positive_scores=[], negatives=[], negative_scores=[], negative_labels=[], weak_positives=[],
                   label=None, origin="original", source_ref=f"skew:{i}") for i, (q, p) in enumerate(load_pairs())]
    datasets = {"skew": DatasetRecords("skew", records_to_table(recs))}
    stage = TrainStageConfig(name="bench", tasks=["retrieval"], steps=steps, lr=2e-5, warmup_steps=0,
                             batch_size={"retrieval": batch}, num_hard_negatives=0, checkpoint_every=10**9,
                             log_every=10**9, losses={"retrieval": {"name": "infonce", "tau": 0.05}})
    cfg = TrainConfig(use_instructions=False, stages=[stage], precision="fp32", packing=packing)
    trainer = Trainer(cfg, stage, datasets, init_model="default", checkpoint_dir=Path("/tmp/bench-packing-ckpt"),
                      seed=0, log=lambda _: None)
    positions = [0]
    trainer.model.register_forward_hook(lambda _m, args, _out: positions.__setitem__(
        0, positions[0] + args[0]["input_ids"].numel()))
    return trainer, positions


def main() -> None:
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4, help="Measured steps per side (after one warm-up step).")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sides = {name: make_trainer(mode, args.steps + 1, args.batch_size) for name, mode in (("padded", "off"),
                                                                                        ("packed", "on"))}
    totals = {name: {"seconds": 0.0, "tokens": 0, "positions": 0} for name in sides}
    for step in range(args.steps + 1):
        for name, (trainer, positions) in sides.items():
            positions[0] = 0
            t0 = time.perf_counter()
            rows = trainer.train_step()
            seconds = time.perf_counter() - t0
            if step == 0:
                continue  # warm-up
            totals[name]["seconds"] += seconds
            totals[name]["tokens"] += sum(r["tokens"] for r in rows)
            totals[name]["positions"] += positions[0]
    print(f"all-MiniLM-L6-v2, fp32, CPU ({args.threads} threads), batch {args.batch_size} STS-B queries + SciFact "
          f"passages, {args.steps} steps per side after a warm-up, steps alternating")
    print(f"{'side':<8} {'s/step':>7} {'tokens/s':>9} {'tokens':>8} {'positions':>10} {'padding':>8}")
    for name, t in totals.items():
        print(f"{name:<8} {t['seconds'] / args.steps:7.2f} {t['tokens'] / t['seconds']:9.0f} {t['tokens']:8d} "
              f"{t['positions']:10d} {1 - t['tokens'] / t['positions']:7.1%}")
    assert totals["packed"]["tokens"] == totals["padded"]["tokens"], "the two sides drew different batches"
    rate = {name: t["tokens"] / t["seconds"] for name, t in totals.items()}
    print(f"RATIO packed_vs_padded={rate['packed'] / rate['padded']:.3f}")


if __name__ == "__main__":
    main()

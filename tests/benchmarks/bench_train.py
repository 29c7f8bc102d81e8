"""Training throughput: embedpipe's trainer vs sentence-transformers' SentenceTransformerTrainer.

Same model (all-MiniLM-L6-v2), same data (STS-B train pairs with score >= 3 and SciFact train
query–document pairs, ../shared/data), same batch size, same loss (in-batch-negative InfoNCE =
MultipleNegativesRankingLoss, scale 20 = τ 0.05, no hard negatives, no query–query term), same
lr. Throughput is non-padding tokens through the encoder per second, counted from the attention
masks each trainer actually used.

Precision: each side runs at its default, ours ``precision: auto`` (bf16 autocast on CUDA and on
CPUs with native bf16, fp32 elsewhere; the line ``ours precision`` says which) and the peer's
``SentenceTransformerTrainingArguments`` default (fp32). The peer is also measured with
``bf16=True`` (what a user who asks for it gets), printed as a second ratio, so the gain of the
default and the gain left over at equal precision are both on record.

The two samplers draw different batches, and a SciFact batch (256-token documents) has many more
tokens per second of work than an STS-B batch (16-token sentences), so a mixed run's tokens/s
depends on how many of each it happened to draw. Each trainer therefore runs each dataset alone
(``--steps`` batches of it, in its own process: peak RSS is per process), and the combined figure
weights both sides' per-dataset seconds and tokens per step by the same mix, proportional to
dataset size (what a proportional one-dataset-per-batch sampler draws on average).

    python tests/benchmarks/bench_train.py [--steps 12] [--batch-size 32] [--precision auto]

Prints ``RATIO train_vs_sentence_transformers=<our tokens/s / their tokens/s>`` (mixed, both at their
defaults) and ``RATIO train_vs_sentence_transformers_bf16`` (the peer with ``bf16=True``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("EMBEDPIPE_SHARED_DATA", REPO.parent / "shared" / "data"))
MAX_LEN = 256


def load_pairs() -> dict[str, list[tuple[str, str]]]:
    stsb = []
    with open(SHARED / "stsb_en/stsb-en-train.csv", newline="", encoding="utf-8") as fh:
        for a, b, score in csv.reader(fh):
            if float(score) >= 3.0:
                stsb.append((a, b))
    queries = {}
    for line in open(SHARED / "beir/scifact/queries.jsonl", encoding="utf-8"):
        q = json.loads(line)
        queries[q["_id"]] = q["text"]
    docs = {}
    for line in open(SHARED / "beir/scifact/corpus.jsonl", encoding="utf-8"):
        d = json.loads(line)
        docs[d["_id"]] = (d.get("title", "") + " " + d["text"]).strip()
    scifact, seen = [], set()
    for i, line in enumerate(open(SHARED / "beir/scifact/qrels/train.tsv", encoding="utf-8")):
        if i == 0:
            continue
        qid, did, _ = line.strip().split("\t")
        if qid not in seen:
            seen.add(qid)
            scifact.append((queries[qid], docs[did]))
    return {"stsb": stsb, "scifact": scifact}


def run_ours(steps: int, batch: int, dataset: str, precision: str) -> dict:
    import torch

    from embed_core.train.config import TrainConfig, TrainStageConfig
    from embed_core.schema import Record, records_to_table
    from embed_core.train.batches import DatasetRecords
    from embed_core.train.trainer import Trainer

    torch.set_num_threads(os.cpu_count() or 1)
    datasets = {}
    for name, rows in load_pairs().items():
        if name != dataset:
            continue
        recs = [Record(id=f"{name}:{i}", dataset=name, task="retrieval", instruction="", query=a, positives=[b],
                       positive_scores=[], negatives=[], negative_scores=[], negative_labels=[], weak_positives=[],
                       label=None, origin="original", source_ref=f"{name}:{i}") for i, (a, b) in enumerate(rows)]
        datasets[name] = DatasetRecords(name, records_to_table(recs))
    stage = TrainStageConfig(name="bench", tasks=["retrieval"], steps=steps, lr=2e-5, warmup_steps=0, scheduler="linear",
                             batch_size={"retrieval": batch}, num_hard_negatives=0,
                             losses={"retrieval": {"name": "infonce", "tau": 0.05, "query_negatives": False}},
                             alpha=1.0, query_max_length=MAX_LEN, passage_max_length=MAX_LEN, checkpoint_every=10**9,
                             log_every=10**9, max_grad_norm=1.0, weight_decay=0.01)
    cfg = TrainConfig(use_instructions=False, max_length=MAX_LEN, stages=[stage], precision=precision)
    trainer = Trainer(cfg, stage, datasets, init_model="default", checkpoint_dir=Path("/tmp/bench-train-ckpt"), seed=0,
                      log=lambda _: None)
    t0 = time.perf_counter()
    metrics = trainer.fit()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "drawn": _count(m["dataset"] for m in metrics), "tokens": sum(m["tokens"] for m in metrics),
            "bf16": trainer.bf16}


def _count(names) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names:
        out[n] = out.get(n, 0) + 1
    return out


def run_peer(steps: int, batch: int, dataset: str, bf16: bool) -> dict:
    import torch
    from datasets import Dataset, DatasetDict
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.losses import MultipleNegativesRankingLoss
    from sentence_transformers.training_args import MultiDatasetBatchSamplers

    from embed_core.model.encoder import default_model_path

    torch.set_num_threads(os.cpu_count() or 1)
    model = SentenceTransformer(default_model_path(), device="cpu")
    model.max_seq_length = MAX_LEN
    data = DatasetDict({name: Dataset.from_dict({"anchor": [a for a, _ in rows], "positive": [b for _, b in rows]})
                        for name, rows in load_pairs().items() if name == dataset})
    args = SentenceTransformerTrainingArguments(
        output_dir="/tmp/bench-train-st", max_steps=steps, per_device_train_batch_size=batch, learning_rate=2e-5,
        warmup_steps=0, lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=1.0, save_strategy="no",
        report_to="none", logging_steps=10**9, use_cpu=True, seed=0, dataloader_drop_last=True, bf16=bf16,
        multi_dataset_batch_sampler=MultiDatasetBatchSamplers.PROPORTIONAL)

    class CountingMNRL(MultipleNegativesRankingLoss):
        """MNRL that counts the non-padding tokens it is given (the same count our trainer logs)."""

        tokens = 0

        def forward(self, sentence_features, labels=None):
            CountingMNRL.tokens += sum(int(f["attention_mask"].sum()) for f in sentence_features)
            return super().forward(sentence_features, labels)

    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                         loss=CountingMNRL(model, scale=20.0))
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": CountingMNRL.tokens}


def child(which: str, steps: int, batch: int, dataset: str, precision: str) -> None:
    result = (run_ours(steps, batch, dataset, precision) if which == "ours"
              else run_peer(steps, batch, dataset, bf16=which == "peer-bf16"))
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto", help="Our trainer's precision.")
    p.add_argument("--child", choices=["ours", "peer", "peer-bf16"])
    p.add_argument("--dataset", choices=["stsb", "scifact"])
    args = p.parse_args()
    if args.child:
        child(args.child, args.steps, args.batch_size, args.dataset, args.precision)
        return
    sizes = {k: len(v) for k, v in load_pairs().items()}
    share = {k: n / sum(sizes.values()) for k, n in sizes.items()}
    results: dict[str, dict[str, dict]] = {"ours": {}, "peer": {}, "peer-bf16": {}}
    for dataset in sizes:
        for which in results:
            proc = subprocess.run([sys.executable, __file__, "--child", which, "--steps", str(args.steps),
                                   "--batch-size", str(args.batch_size), "--dataset", dataset,
                                   "--precision", args.precision],
                                  capture_output=True, text=True, cwd=REPO,
                                  env={**os.environ, "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{which} on {dataset} failed:\n{proc.stderr[-3000:]}")
            results[which][dataset] = json.loads(line[7:])
    mixed = {}
    print(f"ours precision: {args.precision} -> {'bf16 autocast' if results['ours']['stsb']['bf16'] else 'fp32'}")
    for which, name in (("ours", "embedpipe"), ("peer", "sentence-transformers"), ("peer-bf16", "s-t bf16=True")):
        for dataset, r in results[which].items():
            print(f"{name:<22} {dataset:<8} {r['seconds'] / args.steps:6.2f} s/step  {r['tokens'] / r['seconds']:7.0f} "
                  f"tokens/s  {args.batch_size * args.steps / r['seconds']:6.1f} examples/s  "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB")
        tokens = sum(share[d] * r["tokens"] / args.steps for d, r in results[which].items())
        seconds = sum(share[d] * r["seconds"] / args.steps for d, r in results[which].items())
        mixed[which] = tokens / seconds
        print(f"{name:<22} mixed    {mixed[which]:7.0f} tokens/s (dataset shares {', '.join(f'{d} {v:.2f}' for d, v in share.items())})")
    for dataset in sizes:
        o, q = results["ours"][dataset], results["peer"][dataset]
        print(f"ratio on {dataset}: {(o['tokens'] / o['seconds']) / (q['tokens'] / q['seconds']):.3f}")
    print(f"RATIO train_vs_sentence_transformers={mixed['ours'] / mixed['peer']:.3f}")
    print(f"RATIO train_vs_sentence_transformers_bf16={mixed['ours'] / mixed['peer-bf16']:.3f}")


if __name__ == "__main__":
    main()

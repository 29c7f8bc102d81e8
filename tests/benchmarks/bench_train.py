"""Training throughput: embedpipe's trainer vs sentence-transformers' SentenceTransformerTrainer.

Same model (all-MiniLM-L6-v2), same data (STS-B train pairs with score >= 3 and SciFact train
query–document pairs, ../shared/data), same batch size, same loss (in-batch-negative InfoNCE =
MultipleNegativesRankingLoss, scale 20 = τ 0.05, no hard negatives, no query–query term), same
lr. Throughput is non-padding tokens through the encoder per second, counted from the attention
masks each trainer actually used.

Precision: both sides at the same one, the one a user of this machine would choose: bf16 where the
hardware has it natively (a CPU with AVX512-BF16 or AMX: ours ``precision: bf16`` autocast, the
peer ``bf16=True``), fp32 elsewhere (an AVX2 CPU emulates bf16, which measures nothing a user
would pick). ``--precision fp32|bf16`` forces both sides to one.

The two samplers draw different batches, and a SciFact batch (256-token documents) has many more
tokens per second of work than an STS-B batch (16-token sentences), so a mixed run's tokens/s
depends on how many of each it happened to draw. Each trainer therefore runs each dataset alone
(``--steps`` batches of it after one warm-up step, in its own process: peak RSS is per process),
and the combined figure weights both sides' per-dataset seconds and tokens per step by the same
mix, proportional to dataset size (what a proportional one-dataset-per-batch sampler draws on
average). Each side's step is broken down into data (batch building, tokenizing, collating),
forward (encoder and loss), backward, optimizer (clipping, AdamW, scheduler) and the rest, timed
around the same calls on both sides.

    python tests/benchmarks/bench_train.py [--steps 12] [--batch-size 32] [--precision auto]

Prints ``RATIO train_vs_sentence_transformers=<our tokens/s / their tokens/s>`` (mixed) and one
ratio per dataset, at equal precision.
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


PARTS = ("data", "forward", "backward", "optimizer")


class Clock:
    """Seconds spent inside the wrapped calls, by part, counted from ``start()`` (after warm-up)."""

    def __init__(self) -> None:
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.started: float | None = None

    def start(self) -> None:
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.started = time.perf_counter()

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[part] += time.perf_counter() - t0
        return timed

    def result(self, tokens: int) -> dict:
        seconds = time.perf_counter() - self.started
        return {"seconds": seconds, "tokens": tokens, "parts": {**self.parts, "rest": seconds - sum(self.parts.values())}}


def _settings(pairs: list[str]) -> tuple[dict, dict]:
    """``--set key=value`` pairs as (train-config, stage-config) overrides, by which model has the field."""
    import yaml

    from embed_core.train.config import TrainConfig

    train, stage = {}, {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        (train if key in TrainConfig.model_fields else stage)[key] = yaml.safe_load(value)
    return train, stage


def run_ours(steps: int, batch: int, dataset: str, bf16: bool, settings: list[str] = ()) -> dict:
    import torch

    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords
    from embed_core.train.config import TrainConfig, TrainStageConfig
    from embed_core.train.engine.trainer import Trainer

    torch.set_num_threads(os.cpu_count() or 1)
    rows = load_pairs()[dataset]
    recs = [Record(id=f"{dataset}:{i}", dataset=dataset, task="retrieval", instruction="", query=a, positives=[b],
                   origin="original", source_ref=f"{dataset}:{i}") for i, (a, b) in enumerate(rows)]
    train_set, stage_set = _settings(list(settings))
    stage = TrainStageConfig(name="bench", tasks=["retrieval"], steps=steps + 1, lr=2e-5, warmup_steps=0,
                             scheduler="linear", batch_size={"retrieval": batch}, num_hard_negatives=0,
                             losses={"retrieval": {"name": "infonce", "tau": 0.05, "query_negatives": False}},
                             alpha=1.0, query_max_length=MAX_LEN, passage_max_length=MAX_LEN, checkpoint_every=10**9,
                             log_every=10**9, max_grad_norm=1.0, weight_decay=0.01, **stage_set)
    cfg = TrainConfig(use_instructions=False, max_length=MAX_LEN, stages=[stage], precision="bf16" if bf16 else "fp32",
                      **train_set)
    trainer = Trainer(cfg, stage, {dataset: DatasetRecords(dataset, records_to_table(recs))}, init_model="default",
                      checkpoint_dir=Path("/tmp/bench-train-ckpt"), seed=0, log=lambda _: None)
    clock = Clock()
    trainer.batches.get = clock.wrap("data", trainer.batches.get)
    trainer.passes._run = clock.wrap("forward", trainer.passes._run)
    trainer._loss = clock.wrap("forward", trainer._loss)
    trainer.backend.backward = clock.wrap("backward", trainer.backend.backward)
    trainer._optimizer_step = clock.wrap("optimizer", trainer._optimizer_step)
    trainer.train_step()  # warm-up: first-call allocations, oneDNN kernel selection
    clock.start()
    metrics = trainer.fit().metrics[1:]
    return {**clock.result(sum(m["tokens"] for m in metrics)), "bf16": trainer.bf16}


def run_peer(steps: int, batch: int, dataset: str, bf16: bool) -> dict:
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.losses import MultipleNegativesRankingLoss
    from transformers import TrainerCallback

    from embed_core.model.encoder import default_model_path

    torch.set_num_threads(os.cpu_count() or 1)
    model = SentenceTransformer(default_model_path(), device="cpu")
    model.max_seq_length = MAX_LEN
    rows = load_pairs()[dataset]
    data = Dataset.from_dict({"anchor": [a for a, _ in rows], "positive": [b for _, b in rows]})
    args = SentenceTransformerTrainingArguments(
        output_dir="/tmp/bench-train-st", max_steps=steps + 1, per_device_train_batch_size=batch, learning_rate=2e-5,
        warmup_steps=0, lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=1.0, save_strategy="no",
        report_to="none", logging_steps=10**9, use_cpu=True, seed=0, dataloader_drop_last=True, bf16=bf16)
    clock = Clock()

    class CountingMNRL(MultipleNegativesRankingLoss):
        """MNRL that counts the non-padding tokens it is given (the same count our trainer logs)."""

        tokens = 0

        def forward(self, sentence_features, labels=None):
            if clock.started is not None:
                CountingMNRL.tokens += sum(int(f["attention_mask"].sum()) for f in sentence_features)
            return super().forward(sentence_features, labels)

    class Steps(TrainerCallback):
        """The optimizer part: from clipping to the optimizer's step; the clock starts after step 1."""

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            clock.parts["optimizer"] += time.perf_counter() - self.t0

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                clock.start()

    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                         loss=CountingMNRL(model, scale=20.0), callbacks=[Steps()])
    trainer.get_batch_samples = clock.wrap("data", trainer.get_batch_samples)
    trainer.compute_loss = clock.wrap("forward", trainer.compute_loss)
    trainer.accelerator.backward = clock.wrap("backward", trainer.accelerator.backward)
    trainer._clip_grad_norm = clock.wrap("optimizer", trainer._clip_grad_norm)
    trainer.train()
    return clock.result(CountingMNRL.tokens)


def child(which: str, steps: int, batch: int, dataset: str, bf16: bool, settings: list[str]) -> None:
    result = run_ours(steps, batch, dataset, bf16, settings) if which == "ours" else run_peer(steps, batch, dataset, bf16)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def native_bf16() -> bool:
    from embed_core.model.encoder import cpu_has_bf16

    return cpu_has_bf16()


def _measure(args, bf16: bool) -> dict[str, dict[str, dict]]:
    results: dict[str, dict[str, dict]] = {w: {} for w in ("ours", "peer") if args.only in (None, w)}
    for dataset in args.datasets.split(","):
        for which in results:
            proc = subprocess.run([sys.executable, __file__, "--child", which, "--steps", str(args.steps),
                                   "--batch-size", str(args.batch_size), "--dataset", dataset,
                                   "--precision", "bf16" if bf16 else "fp32",
                                   *[f"--set={x}" for x in args.set]],
                                  capture_output=True, text=True, cwd=REPO,
                                  env={**os.environ, "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{which} on {dataset} failed:\n{proc.stderr[-3000:]}")
            results[which][dataset] = json.loads(line[7:])
    return results


def _report(results: dict[str, dict[str, dict]], steps: int, batch: int, share: dict[str, float]) -> None:
    mixed = {}
    for which, name in (("ours", "embedpipe"), ("peer", "sentence-transformers")):
        if which not in results:
            continue
        for dataset, r in results[which].items():
            parts = "  ".join(f"{k} {v / steps:5.2f}" for k, v in r["parts"].items())
            print(f"{name:<22} {dataset:<8} {r['seconds'] / steps:6.2f} s/step ({parts})  "
                  f"{r['tokens'] / r['seconds']:7.0f} tokens/s  {batch * steps / r['seconds']:6.1f} examples/s  "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB")
        if set(results[which]) != set(share):
            continue
        tokens = sum(share[d] * r["tokens"] / steps for d, r in results[which].items())
        seconds = sum(share[d] * r["seconds"] / steps for d, r in results[which].items())
        mixed[which] = tokens / seconds
        print(f"{name:<22} mixed    {mixed[which]:7.0f} tokens/s (dataset shares "
              f"{', '.join(f'{d} {v:.2f}' for d, v in share.items())})")
    if len(results) < 2:
        return
    for dataset in results["ours"]:
        o, q = results["ours"][dataset], results["peer"][dataset]
        print(f"RATIO train_vs_sentence_transformers_{dataset}={(o['tokens'] / o['seconds']) / (q['tokens'] / q['seconds']):.3f}")
    if len(mixed) == 2:
        print(f"RATIO train_vs_sentence_transformers={mixed['ours'] / mixed['peer']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12, help="Timed steps per side and dataset (after one warm-up step).")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="Both sides' precision; auto: bf16 where the hardware has it natively, else fp32.")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="A train or stage setting of ours (e.g. prefetch=false, length_buckets=1): compare a setting "
                        "against the peer.")
    p.add_argument("--only", choices=["ours", "peer"], help="Run one side (the other's figures are then missing).")
    p.add_argument("--datasets", default="stsb,scifact", help="Comma-separated: stsb, scifact.")
    p.add_argument("--child", choices=["ours", "peer"])
    p.add_argument("--dataset", choices=["stsb", "scifact"])
    args = p.parse_args()
    if args.child:
        child(args.child, args.steps, args.batch_size, args.dataset, args.precision == "bf16", args.set)
        return
    bf16 = native_bf16() if args.precision == "auto" else args.precision == "bf16"
    sizes = {k: len(v) for k, v in load_pairs().items()}
    print(f"precision (both sides): {'bf16' if bf16 else 'fp32'}"
          f"{' (native bf16 on this CPU)' if args.precision == 'auto' and bf16 else ''}; "
          f"{args.steps} timed steps of batch {args.batch_size} per side and dataset"
          + (f"; ours with {', '.join(args.set)}" if args.set else ""))
    _report(_measure(args, bf16), args.steps, args.batch_size, {k: n / sum(sizes.values()) for k, n in sizes.items()})


if __name__ == "__main__":
    main()

"""Memory per process of FSDP2 sharding (``train.sharding: fsdp``) against the unsharded trainer, and
of bf16 storage of a frozen LoRA base (``train.weights_dtype: bf16``) against fp32 (issue 33).

Model: a random-init Qwen3-architecture decoder built in code (no download): hidden 512, 8 layers,
8 attention heads of 64 (4 key/value heads), intermediate 1536, vocabulary 30522 with the packaged
tokenizer: 40.8 M parameters, 15.6 M of them in the token embedding (the table prints the count).
Bidirectional, mean pooling. Data: the demo config's records (``run_prepare`` on
``deployments/configs/demo.yaml``'s prepare section over ``data/``), retrieval datasets only.

Each run is its own process:

* (a) ``unsharded``: one process, ``sharding: none``;
* (b) ``fsdp``: ``torchrun --standalone --nproc_per_node 2`` (gloo on CPU, nccl on CUDA) with
  ``sharding: fsdp``, this script re-invoked as the entry (``--child fsdp``);
  both a full fine-tune in ``precision: fp32`` (like-for-like bytes), GradCache on (chunks of 4
  texts), the same global batch of 8 queries (4 per rank under FSDP) with 1 hard negative each,
  2 optimizer steps;
* (c) ``lora-fp32`` / ``lora-bf16``: one process each, LoRA r 16 on every linear layer of the same
  model, ``weights_dtype: fp32, precision: fp32`` against ``weights_dtype: bf16, precision: bf16``
  (CPU autocast works), same batch and steps.

Counted after the last optimizer step (an optimizer step post-hook, so before ``zero_grad`` drops
the gradients): bytes of parameters, gradients and AdamW state HELD by the process: a DTensor's
local shard under FSDP (``to_local()``), full tensors unsharded. Peak RSS is ``ru_maxrss`` of the
process: it includes the Python / torch / transformers runtime (the ``runtime RSS`` column: RSS
before the model is built) and, under FSDP, the full model each rank loads before sharding it, so
its ratio is informative, not the acceptance figure. The runs use glibc's malloc with its mmap
threshold pinned at 64 KiB (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``), so a freed
tensor goes back to the system and RSS follows what the process holds; glibc's default raises the
threshold to 32 MiB as blocks are freed and keeps them in its heap, and FSDP's gather-and-free of
every layer then shows as RSS (``--default-malloc``: 1.11x to 1.13x the unsharded peak measured on 2 cores).
On CUDA ``torch.cuda.max_memory_allocated`` is printed too.

    python tests/benchmarks/bench_fsdp_memory.py [--steps 2] [--work DIR] [--default-malloc]

Prints ``RATIO fsdp2_state_bytes_vs_unsharded=<largest rank's bytes / unsharded bytes>`` (issue
33's acceptance: ≤ 0.6), ``RATIO fsdp2_peak_rss_vs_unsharded`` (informative),
``RATIO lora_bf16_frozen_weight_bytes_vs_fp32`` (0.5 expected) and
``RATIO lora_bf16_trainable_bytes_vs_fp32`` (1.0 expected: adapters and their state stay fp32).
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
SIZES = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             intermediate_size=1536, max_position_embeddings=512)
GLOBAL_BATCH = 8
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
RUNS = {  # name -> train settings over the shared ones
    "unsharded": {"sharding": "none", "precision": "fp32"},
    "fsdp": {"sharding": "fsdp", "precision": "fp32"},
    "lora-fp32": {"lora": LORA, "weights_dtype": "fp32", "precision": "fp32"},
    "lora-bf16": {"lora": LORA, "weights_dtype": "bf16", "precision": "bf16"},
}


def config_dict(work: Path, run: str, world: int, steps: int) -> dict:
    import yaml

    cfg = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    cfg.update(data_root=str(REPO / "data"), run_root=str(work / "runs"))
    for key in ("synthesize", "mine", "evaluate", "train"):
        cfg.pop(key, None)
    stage = {"name": "s", "tasks": ["retrieval"], "steps": steps, "batch_size": {"retrieval": GLOBAL_BATCH // world},
             "warmup_steps": 0, "num_hard_negatives": 1, "query_max_length": 32, "passage_max_length": 64,
             "grad_cache_chunk": 4, "checkpoint_every": 10**9, "log_every": 10**9}
    cfg["train"] = {"base_model": str(work / "qwen3"), "max_length": 64, "bidirectional": True, "pooling": "mean",
                    "stages": [stage], **RUNS[run]}
    return cfg


def prepare(work: Path) -> None:
    """The demo's prepared records and the model, once, before any run."""
    from embed_core.config import parse_config
    from embed_core.prepare.run import run_prepare
    from tests.helpers.tiny_model import build_tiny_decoder

    build_tiny_decoder(work / "qwen3", "qwen3", **SIZES)
    run_prepare(parse_config(config_dict(work, "unsharded", 1, 1)), work / "runs/demo")


def _rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def held_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of parameters (frozen / trainable), gradients and optimizer state this process holds:
    a DTensor's local shard, a plain tensor whole."""
    import torch
    from torch.distributed.tensor import DTensor

    def nbytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    return {"frozen": sum(nbytes(p) for p in params if not p.requires_grad),
            "trainable": sum(nbytes(p) for p in params if p.requires_grad),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))}


def child(run: str, work: Path, steps: int) -> None:
    import torch

    from embed_core.config import parse_config
    from embed_core.stages import records_upstream
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = parse_config(config_dict(work, run, world, steps))
    stage = config.train.stages[0]
    datasets = load_datasets(work / "runs/demo", stage, records_upstream(config, "train"))
    runtime_rss = _rss_mb()
    t0 = time.perf_counter()
    trainer = Trainer(config.train, stage, datasets, init_model=str(work / "qwen3"),
                      checkpoint_dir=work / f"ck-{run}", seed=0, log=lambda _: None)
    held: dict[str, int] = {}
    trainer.optimizer.register_step_post_hook(lambda opt, *_: held.update(held_bytes(trainer.model, opt)))
    for _ in range(steps):
        trainer.train_step()
    result = {"run": run, "rank": trainer.rank, "world": trainer.world, "seconds": time.perf_counter() - t0,
              # a DTensor's numel is the whole tensor's
              "parameters": sum(p.numel() for p in trainer.model.parameters()),
              "embedding": sum(p.numel() for n, p in trainer.model.named_parameters() if "embed_tokens" in n),
              **held, "runtime_rss_mb": runtime_rss, "rss_after_mb": _rss_mb(),
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "cuda_max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None}
    # a file per process: the ranks share one stdout, where their lines can interleave
    (work / f"result-{run}-{trainer.rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def launch(run: str, work: Path, steps: int, default_malloc: bool) -> list[dict]:
    script = [__file__, "--child", run, "--work", str(work), "--steps", str(steps)]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script]
           if run == "fsdp" else [sys.executable, *script])
    env = {**os.environ, "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "EMBEDPIPE_CACHE_DIR": str(work / "cache")}
    if not default_malloc:  # freed tensors back to the system: RSS follows what is held (docstring)
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    if run == "fsdp":
        env["OMP_NUM_THREADS"] = "1"  # 2 ranks on 2 cores (torchrun's own default, without its warning)
    for old in work.glob(f"result-{run}-*.json"):
        old.unlink()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    files = sorted(work.glob(f"result-{run}-*.json"))
    if proc.returncode != 0 or not files:
        sys.exit(f"{run} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")
    return sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])


def _held(r: dict, *keys: str) -> int:
    return sum(r[k] for k in keys or ("frozen", "trainable", "grads", "optimizer"))


def report(results: dict[str, list[dict]], default_malloc: bool) -> None:
    mb = 2**20
    base = results["unsharded"][0]
    cuda = base["cuda_max_allocated_mb"] is not None
    print(f"model: Qwen3 architecture, {base['parameters'] / 1e6:.1f} M parameters "
          f"({base['embedding'] / 1e6:.1f} M in the token embedding); GradCache chunks of 4, global batch {GLOBAL_BATCH}")
    print(f"{'run':<12}{'rank':>5}{'frozen MB':>11}{'trained MB':>12}{'grads MB':>10}{'AdamW MB':>10}"
          f"{'held MB':>9}{'runtime RSS':>13}{'RSS after':>11}{'peak RSS':>10}{'s':>7}"
          + ("  cuda max alloc MB" if cuda else ""))
    for rows in results.values():
        for r in rows:
            print(f"{r['run']:<12}{r['rank']:>5}{r['frozen'] / mb:>11.1f}{r['trainable'] / mb:>12.1f}"
                  f"{r['grads'] / mb:>10.1f}{r['optimizer'] / mb:>10.1f}{_held(r) / mb:>9.1f}"
                  f"{r['runtime_rss_mb']:>13.0f}{r['rss_after_mb']:>11.0f}{r['peak_rss_mb']:>10.0f}{r['seconds']:>7.1f}"
                  + (f"  {r['cuda_max_allocated_mb']:.0f}" if cuda else ""))
    fsdp, lora32, lora16 = results["fsdp"], results["lora-fp32"][0], results["lora-bf16"][0]
    print("(RSS columns include the Python/torch/transformers runtime; under FSDP each rank loads the whole "
          "model before sharding it, so its peak RSS holds one full fp32 copy of the weights; malloc: "
          f"{'glibc defaults' if default_malloc else 'mmap threshold 64 KiB'})")
    print(f"RATIO fsdp2_state_bytes_vs_unsharded={max(_held(r) for r in fsdp) / _held(base):.3f}")
    print(f"RATIO fsdp2_peak_rss_vs_unsharded={max(r['peak_rss_mb'] for r in fsdp) / base['peak_rss_mb']:.3f}")
    print(f"RATIO lora_bf16_frozen_weight_bytes_vs_fp32={lora16['frozen'] / lora32['frozen']:.3f}")
    trained = ("trainable", "grads", "optimizer")  # adapters, their gradients and AdamW state
    print(f"RATIO lora_bf16_trainable_bytes_vs_fp32={_held(lora16, *trained) / _held(lora32, *trained):.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--work", type=Path, help="Working directory (default: a fresh temporary one).")
    p.add_argument("--default-malloc", action="store_true", help="Leave glibc's malloc thresholds at their defaults.")
    p.add_argument("--child", choices=list(RUNS))
    args = p.parse_args()
    if args.child:
        child(args.child, args.work, args.steps)
        return
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        work = args.work or Path(tmp)  # --work: kept afterwards
        prepare(work)
        results = {run: launch(run, work, args.steps, args.default_malloc) for run in RUNS}
    report(results, args.default_malloc)
    print(f"wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

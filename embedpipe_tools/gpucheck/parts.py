"""The check's parts that run the project's own trainer (``embed_core.train.engine.trainer.Trainer``):
timed training steps (tokens/s, losses, MFU, peak memory), packed against padded passes, FSDP on
one rank against the unsharded run, and the measured peak against the memory planner's.

Tokens/s everywhere: the non-padding tokens put through the encoder with a graph (the trainer's
``tokens`` per step; GradCache's no-graph pass is not counted) over the wall time of the timed
steps, measured after ``warmup`` untimed steps, with the device synchronised at both ends."""

from __future__ import annotations

import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from embedpipe_tools.gpucheck.setup import Batches, Profile


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Free what a finished part left (its model, optimizer, caches) and restart the peak count."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def train_config(model: Path, profile: Profile, batches: Batches, *, steps: int, bidirectional: bool = False,
                 packing: str = "auto", sharding: str = "none"):
    """One retrieval stage (constant lr, no warm-up, no checkpoints within the run) on ``model``."""
    from embed_core.train.config import TrainConfig

    stage = {"name": "gpucheck", "tasks": ["retrieval"], "steps": steps, "lr": 2e-5, "warmup_steps": 0,
             "scheduler": "constant", "batch_size": {"retrieval": batches.batch},
             "num_hard_negatives": profile.negatives, "grad_cache_chunk": batches.chunk,
             "grad_cache_max_tokens": batches.max_tokens, "query_max_length": batches.query_len,
             "passage_max_length": batches.passage_len, "checkpoint_every": 10 ** 9, "log_every": 10 ** 9}
    return TrainConfig.model_validate({
        "base_model": str(model), "pooling": "mean", "bidirectional": bidirectional,
        "max_length": max(batches.query_len, batches.passage_len), "use_instructions": False,
        "precision": profile.precision, "packing": packing, "sharding": sharding, "stages": [stage]})


def run_trainer(train: Any, datasets: dict, device: torch.device, *, steps: int, warmup: int,
                memory: bool = False) -> dict[str, Any]:
    """``warmup`` + ``steps`` optimizer steps of a fresh trainer: tokens/s of the timed steps, every
    step's loss, MFU, and (``memory``) the measured peak bytes of tensors."""
    from embed_core.train.engine.trainer import Trainer

    release(device)
    with tempfile.TemporaryDirectory(prefix="gpucheck-ckpt-") as ckpt:
        trainer = Trainer(train, train.stages[0], datasets, init_model=train.base_model, checkpoint_dir=Path(ckpt),
                          seed=0, log=log)
        warm = [r for _ in range(warmup) for r in trainer.train_step()]
        synchronize(device)
        t0 = time.perf_counter()
        timed = [r for _ in range(steps) for r in trainer.train_step()]
        synchronize(device)
        seconds = time.perf_counter() - t0
        tokens, texts = sum(r["tokens"] for r in timed), sum(r["texts"] for r in timed)
        losses = [float(r["loss"]) for r in warm + timed]
        out = {"steps": steps, "warmup_steps": warmup, "tokens": tokens, "texts": texts, "seconds": round(seconds, 4),
               "tokens_per_s": tokens / seconds if seconds else 0.0, "losses": losses,
               "loss_finite": all(math.isfinite(v) for v in losses),
               "grad_norms": [r["grad_norm"] for r in warm + timed],
               "mfu": trainer.flops.mfu(tokens, texts, seconds, trainer.peak_tflops),
               "peak_tflops": trainer.peak_tflops, "parameters": sum(int(p.numel()) for p in trainer.model.parameters()),
               "non_embedding_parameters": trainer.flops.params,
               "attention": str(getattr(trainer.model._text_config(), "_attn_implementation", None) or "sdpa"),
               "packed": trainer.passes.packs}
        if memory:
            out["measured_peak_bytes"] = (max(r["peak_memory_mb"] for r in warm + timed) * 2 ** 20
                                          if device.type == "cuda" else cpu_peak_bytes(trainer))
            if device.type == "cuda":  # what the caching allocator held at most: an OOM comes from this
                out["measured_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
        del trainer
    release(device)
    return out


def cpu_peak_bytes(trainer: Any, steps: int = 2) -> int:
    """On a CPU, the counterpart of ``torch.cuda.max_memory_allocated``: tensors held before (weights,
    buffers, AdamW state) plus the highest rise the profiler's memory events report over ``steps``
    more steps (as tests/unit/embed_core/train/test_plan.py measures the planner)."""
    from torch.profiler import ProfilerActivity, profile

    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    held = sum(t.numel() * t.element_size() for t in [*trainer.model.parameters(), *trainer.model.buffers(), *state])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            trainer.train_step()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        with open(trace.name, encoding="utf-8") as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return held
    events.sort(key=lambda e: e["ts"])
    zero = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return held + max(e["args"]["Total Allocated"] - zero for e in events)


def planned_peak(train: Any, device: torch.device) -> dict[str, Any]:
    """The memory planner's peak for a retrieval batch of ``train``'s stage on this device, or a reason."""
    try:
        from embed_core.train import plan
    except ImportError as exc:
        return {"planned_bytes": None, "reason": f"no memory planner (embed_core.train.plan: {exc})"}
    shape = plan.model_shape(train.base_model, train.gguf_file)
    task = plan.plan_task(shape, train, train.stages[0], "retrieval", world=1, device=device.type)
    return {"planned_bytes": int(task.peak), "planned_phase": task.phase,
            "planned_at_peak": {k: int(v) for k, v in task.at_peak.items()}}


def memory_vs_plan(train: Any, run: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Measured peak (CUDA: ``max_memory_allocated``, and ``max_memory_reserved`` beside it; CPU:
    the profiler's) against the plan's."""
    measured = run.get("measured_peak_bytes")
    out: dict[str, Any] = {"measured_bytes": int(measured) if measured is not None else None,
                           "measured_by": "torch.cuda.max_memory_allocated" if device.type == "cuda"
                           else "torch.profiler memory events + held tensors"}
    reserved = run.get("measured_reserved_bytes")
    if reserved is not None:
        out["reserved_bytes"] = int(reserved)
    out.update(planned_peak(train, device))
    if out.get("planned_bytes") and measured:
        out["planned_over_measured"] = out["planned_bytes"] / measured
    if out.get("planned_bytes") and reserved:
        out["planned_over_reserved"] = out["planned_bytes"] / reserved
        out["note"] = ("the plan takes every text at its group's max length (most abstracts reach it, claims "
                       "do not); the planner aims at 25 % of the measured peak")
    return out

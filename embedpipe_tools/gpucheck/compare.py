"""Packed against padded passes, and FSDP on one rank against the unsharded run, on the decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from embedpipe_tools.gpucheck.parts import run_trainer, train_config
from embedpipe_tools.gpucheck.setup import Profile


# FSDP's gradient norms against the unsharded run's, relative: rounding only in fp32; bf16 parameters
# against autocast's per-op casts in bf16
GRAD_NORM_TOLERANCE = {"fp32": 1e-3, "bf16": 0.1}


def _losses_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=float("nan"))


def packed_vs_padded(model: Path, datasets: dict, profile: Profile, device: torch.device) -> dict[str, Any]:
    """``packing: on`` (one varlen row under FlashAttention, else rows with a block-diagonal mask)
    against ``packing: off`` (length-bucketed padded passes): tokens/s of each, and their losses,
    which must agree (the same embeddings up to float rounding)."""
    from embed_core.model.packing import flash_attn_imports, resolve_attention

    runs = {}
    for mode in ("on", "off"):
        train = train_config(model, profile, profile.decoder, steps=profile.warmup + profile.compare_steps,
                             bidirectional=True, packing=mode)
        runs[mode] = run_trainer(train, datasets, device, steps=profile.compare_steps, warmup=profile.warmup)
    flash = flash_attn_imports()
    attention = resolve_attention("auto", device.type) or "sdpa"
    return {"packed": _brief(runs["on"]), "padded": _brief(runs["off"]),
            "packed_over_padded": runs["on"]["tokens_per_s"] / runs["off"]["tokens_per_s"],
            "loss_max_abs_diff": _losses_diff(runs["on"]["losses"], runs["off"]["losses"]),
            "flash_attn_importable": flash, "attention": attention,
            "auto_packs": attention.startswith("flash"),
            "note": "packing: auto packs every group under FlashAttention (flash_attn installed, CUDA); "
                    "under SDPA only groups whose packed rows are at most 3/4 of their texts (rows with a "
                    "block-diagonal mask); auto_packs: whether it packs every group"}


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    return {k: run[k] for k in ("tokens_per_s", "tokens", "seconds", "losses", "loss_finite", "attention", "packed")}


def fsdp_one_rank(model: Path, datasets: dict, profile: Profile, device: torch.device,
                  unsharded: dict[str, Any]) -> dict[str, Any]:
    """``sharding: fsdp`` in this one process (a process group of one over an in-memory store):
    its first steps' losses against the unsharded decoder run's first steps (same seed and batches).
    bf16: FSDP computes with bf16 parameters where autocast casts per op, so the losses agree to
    bf16 rounding (``loss_tolerance``); fp32: to float rounding."""
    made_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    train = train_config(model, profile, profile.decoder, steps=profile.warmup + profile.steps, bidirectional=True,
                         sharding="fsdp")
    try:
        run = run_trainer(train, datasets, device, steps=profile.fsdp_steps, warmup=0,
                          memory=device.type == "cuda")  # the profiler would double the CPU run's time
    finally:
        if made_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    reference = unsharded["losses"][:profile.fsdp_steps]
    diff = _losses_diff(run["losses"], reference)
    tolerance = profile.loss_tolerance * max([1.0] + [abs(v) for v in reference])
    # the gradients too (a wrong reduction would hardly move the losses of a few small steps)
    norms, ref_norms = run["grad_norms"], unsharded["grad_norms"][:profile.fsdp_steps]
    norm_diff = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norms, ref_norms)), default=float("nan"))
    return {"steps": run["steps"], "losses": run["losses"], "unsharded_losses": reference,
            "loss_max_abs_diff": diff, "tolerance": tolerance, "grad_norms": norms, "unsharded_grad_norms": ref_norms,
            "grad_norm_max_rel_diff": norm_diff, "grad_norm_tolerance": GRAD_NORM_TOLERANCE[profile.precision],
            "equal_to_unsharded": diff <= tolerance and norm_diff <= GRAD_NORM_TOLERANCE[profile.precision],
            "tokens_per_s": run["tokens_per_s"], "loss_finite": run["loss_finite"],
            "measured_peak_bytes": run.get("measured_peak_bytes")}

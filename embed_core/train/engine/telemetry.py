"""What GPU users read first, per optimizer step: peak memory (allocated and reserved), gradient norm and model FLOPs
utilisation (MFU), beside the loss, learning rate and non-padding tokens/s.

MFU = model FLOPs of the step / seconds / the device's peak FLOP/s (PaLM, Chowdhery et al. 2022,
appendix B). The FLOP model, per non-padding token:

    training FLOPs = c · N + 12 · L · d · s̄

with N the encoder's parameters outside its embedding tables (counted on the model), L layers and
d the hidden size (read from the model config), s̄ the step's mean text length in tokens (the
attention scores and their weighted sum: 2 · 2 · s̄ · d per layer forward, times 3 with the
backward pass), and c = 6 (2 forward + 4 backward) for a full fine-tune, 4 with a frozen base (LoRA:
no weight gradients). GradCache's extra no-graph pass is not model FLOPs (it is recomputation), so
it lowers MFU, as activation checkpointing does. The peak is the device's dense bf16 (or fp32)
tensor throughput from ``PEAK_TFLOPS``, matched on the CUDA device name, or ``train.peak_tflops``;
a CPU has no entry, so its MFU is empty unless ``peak_tflops`` is set.
"""

from __future__ import annotations

import resource
from typing import Any

import torch
from torch import nn

# Dense (no sparsity) peak TFLOP/s per GPU, (bf16 tensor cores, fp32), from the vendors' data sheets.
# Matched in order on torch.cuda.get_device_name(): the first entry whose key is in the name wins.
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H200": (989.4, 66.9), "H100 NVL": (835.0, 60.0), "H100 PCIe": (756.0, 51.2), "H100": (989.4, 66.9),
    "GH200": (989.4, 66.9), "B200": (2250.0, 80.0), "A100": (312.0, 19.5), "A800": (312.0, 19.5),
    "L40S": (362.1, 91.6), "L40": (181.0, 90.5), "L4": (121.0, 30.3), "A10G": (70.0, 31.2), "A10": (125.0, 31.2),
    "RTX 6000 Ada": (364.2, 91.1), "RTX 4090": (165.2, 82.6), "RTX 3090": (71.0, 35.6),
}


def device_peak_tflops(device: torch.device, bf16: bool, override: float | None = None) -> float | None:
    """The device's peak TFLOP/s for the compute precision (``override`` wins); None when unknown."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, single) in PEAK_TFLOPS.items():
        if key in name:
            return half if bf16 else single
    return None


class FlopModel:
    """Training FLOPs per token of one model (see the module docstring)."""

    def __init__(self, model: nn.Module, config: Any):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.layers = int(getattr(text, "num_hidden_layers", 0) or 0)
        self.hidden = int(getattr(text, "hidden_size", 0) or 0)
        embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        params = [p for p in model.parameters() if id(p) not in embedding_ids]
        self.params = sum(_numel(p) for p in params)
        self.trains_all = all(p.requires_grad for p in params)

    def per_token(self, mean_length: float) -> float:
        return (6 if self.trains_all else 4) * self.params + 12 * self.layers * self.hidden * mean_length

    def mfu(self, tokens: int, texts: int, seconds: float, peak_tflops: float | None) -> float | None:
        if not peak_tflops or not seconds or not tokens:
            return None
        flops = tokens * self.per_token(tokens / texts if texts else 0.0)
        return flops / seconds / (peak_tflops * 1e12)


def _numel(p: torch.Tensor) -> int:
    """The whole parameter's size (a sharded DTensor reports its global shape too)."""
    return int(p.numel())


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory since the last call (CUDA: allocated by tensors, then reset), or the
    process's peak resident memory so far (CPU: ``ru_maxrss``, which never goes down)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def peak_memory(device: torch.device) -> dict[str, float | None]:
    """The step's peaks, then reset: ``peak_memory_mb`` (:func:`peak_memory_mb`) and, on CUDA,
    ``peak_reserved_mb``, what the caching allocator held from the device (tensors, their
    fragments, its cached blocks). An out-of-memory error comes when *reserved* reaches the
    device's memory, which can be well before *allocated* does when the shapes change from pass to
    pass (GradCache chunks, length buckets); None on a CPU."""
    if device.type != "cuda":
        return {"peak_memory_mb": peak_memory_mb(device), "peak_reserved_mb": None}
    reserved = torch.cuda.max_memory_reserved(device) / 2 ** 20
    return {"peak_memory_mb": peak_memory_mb(device), "peak_reserved_mb": reserved}  # that one resets both


def total_norm(norm: Any) -> float:
    """A gradient norm as a float (FSDP returns a replicated DTensor)."""
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)

"""Which machine ``make gpu-run`` found: the CUDA device torch sees, or the CPU and whether it has
native bf16 (AVX512-BF16 or AMX: ``precision: auto`` trains in bf16 autocast, and the quality
recipe fits in about an hour) or AVX2 only (4-5 hours), read from /proc/cpuinfo's flags."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")
VERDICTS = {
    "cuda": "CUDA GPU: the whole sequence is sized for one H100 (under 25 minutes)",
    "bf16": "bf16-capable CPU (AVX512-BF16 / AMX): quality.yaml with precision: auto fits in about an hour",
    "avx2": "AVX2-only CPU: quality.yaml takes 4-5 hours here; the quality-scale runs need a GPU or a bf16 CPU",
    "other": "CPU without AVX2: far too slow for the quality-scale runs",
}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    """The CPU's model name and its flags (the first processor's), from /proc/cpuinfo."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    return model, flags


def cpu_class(flags: set[str]) -> str:
    if flags & set(BF16_FLAGS):
        return "bf16"
    return "avx2" if "avx2" in flags else "other"


def describe(cuda: bool, cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The machine, as the report's ``machine``: kind (cuda, bf16, avx2, other), the device or CPU
    name, the CPU's bf16 flags found, the cores, and the verdict line the runner prints."""
    model, flags = cpu_flags(cpuinfo)
    out: dict[str, Any] = {"cpu": model, "cpu_bf16_flags": sorted(flags & set(BF16_FLAGS)),
                           "avx2": "avx2" in flags, "cores": os.cpu_count()}
    if cuda:
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        out.update(kind="cuda", device=torch.cuda.get_device_name(device),
                   device_memory_gib=round(props.total_memory / 2 ** 30, 1), device_count=torch.cuda.device_count())
    else:
        out.update(kind=cpu_class(flags), device=f"CPU: {model}")
    out["verdict"] = VERDICTS[out["kind"]]
    return out

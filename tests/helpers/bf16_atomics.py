"""CUDA's bf16 accumulation, emulated on a CPU: on a GPU, ``index_add_`` and ``scatter_add_`` into
a bf16 tensor add each source row with an atomic add that rounds the running sum to bf16 after every
addition (``gpuAtomicAdd`` on ``__nv_bfloat16``, pytorch/pytorch#84981). The CPU kernels add in
fp32 and round once, hiding the error. ``CudaAccumulation`` is a dispatch mode that runs those ops
the CUDA way (one rounded add per source row, in order) and records every accumulator's dtype."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
ATOMIC_ADDS = {aten.index_add_.default, aten.index_add.default}


def sequential_bf16_index_add(target: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor,
                              alpha=1) -> torch.Tensor:
    """``target.index_add_(dim, index, source)`` with the running sum rounded to bf16 after each row."""
    out = target.movedim(dim, 0)
    src = source.movedim(dim, 0)
    for i, j in enumerate(index.tolist()):
        out[j] = (out[j].float() + alpha * src[i].float()).to(torch.bfloat16)
    return target


class CudaAccumulation(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.accumulators: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ATOMIC_ADDS:
            target = args[0]
            self.accumulators.append(target.dtype)
            if target.dtype == torch.bfloat16:
                if func is aten.index_add.default:
                    target = target.clone()
                return sequential_bf16_index_add(target, *args[1:4], **kwargs)
        if func is aten.sum.dim_IntList:
            self.accumulators.append(kwargs.get("dtype") or args[0].dtype)
        return func(*args, **kwargs)

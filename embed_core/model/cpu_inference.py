"""CPU inference speed in fp32: oneDNN's packed linear layers.

``nn.Linear`` in fp32 calls MKL's sgemm, which on AMD CPUs runs its AVX2 kernels: 154 GFLOP/s on a
2-core AVX-512 EPYC against 297 GFLOP/s for oneDNN's own kernels on the same matrices.
``pack_linear_layers`` swaps every ``nn.Linear`` of an inference-only fp32 model for oneDNN's
``_linear_pointwise`` with its weight reordered once into oneDNN's blocked layout (what
``torch.compile``'s CPU backend emits, without the compile), and fuses the GELU that follows the
feed-forward projection of BERT-style layers into it. The arithmetic stays IEEE fp32; only the
summation order differs (1.7e-7 on all-MiniLM-L6-v2; the tests hold it to 1e-5).

(The oneDNN primitive cache cap that keeps bf16 encoding memory flat is in ``embed_core.model.onednn``.)
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("embedpipe.encode")


def onednn_linear_available() -> bool:
    """Whether this torch build can run oneDNN's packed linear (x86 builds with oneDNN; not ACL/ARM)."""
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return False
    try:
        return not torch.ops.mkldnn._is_mkldnn_acl_supported()
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """``y = act(x W^T + b)`` by oneDNN with ``W`` reordered once; inference only (no autograd)."""

    def __init__(self, linear: nn.Linear, activation: str = "none"):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)
        self.activation = activation
        # oneDNN's exact (erf) GELU is algorithm "none"; the plain linear takes no algorithm
        self._algorithm = "none" if activation == "gelu" else ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.activation, [], self._algorithm)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}"


def _is_exact_gelu(module: nn.Module) -> bool:
    from transformers.activations import GELUActivation

    return isinstance(module, GELUActivation) and getattr(module, "act", None) is nn.functional.gelu


def pack_linear_layers(model: nn.Module) -> int:
    """Replace, in place, every fp32 ``nn.Linear`` of an eval-mode CPU model by ``PackedLinear``;
    a BERT-style feed-forward (``dense`` followed by an exact-GELU ``intermediate_act_fn``) gets the
    GELU fused. Returns how many layers were packed (0 where oneDNN's linear is unavailable)."""
    if not onednn_linear_available():
        return 0
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child.weight.dtype != torch.float32 or child.weight.is_cuda:
                continue
            activation = "none"
            if name == "dense" and _is_exact_gelu(getattr(parent, "intermediate_act_fn", None)):
                activation = "gelu"
                parent.intermediate_act_fn = nn.Identity()
            setattr(parent, name, PackedLinear(child, activation))
            packed += 1
    log.debug("packed %d linear layers for oneDNN", packed)
    return packed

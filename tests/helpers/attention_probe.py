"""Attention implementations registered with transformers' ``AttentionInterface`` (and the SDPA mask
builder under the same name), so a CPU test sees what a CUDA kernel would be asked to do:

* ``embedpipe_probe`` records the ``is_causal`` flag and the mask every attention call receives,
  then computes SDPA's result: the flag is exactly what FlashAttention-2 runs with on a GPU;
* ``embedpipe_causal_only`` computes causal attention whatever it is asked (FlashAttention-2 under
  transformers < 5.2 kept each module's hard-coded ``is_causal = True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROBE = "embedpipe_probe"
CAUSAL_ONLY = "embedpipe_causal_only"


@dataclass
class Call:
    is_causal: Any
    module_is_causal: Any
    mask: Any


@dataclass
class Recorder:
    calls: list[Call] = field(default_factory=list)


RECORDED = Recorder()


def _probe(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    RECORDED.calls.append(Call(kwargs.get("is_causal"), getattr(module, "is_causal", None),
                               None if attention_mask is None else attention_mask.detach().clone()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _causal_only(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs["is_causal"] = True
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, fn in ((PROBE, _probe), (CAUSAL_ONLY, _causal_only)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)

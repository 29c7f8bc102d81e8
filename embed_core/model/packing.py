"""Packed passes (padding-free encoding): the texts of a group laid back to back in a few rows
instead of one padded row each, with attention kept inside each text and pooling per text.

Two layouts, by the model's attention implementation:

* ``varlen`` (FlashAttention-2/3, any implementation whose name holds ``flash``): every text in one
  row ``[1, T]`` with no padding at all; the model gets ``position_ids`` that restart at 0 for every
  text and the ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments, and transformers runs
  its variable-length kernel, which never lets a text see another (no T² mask is built);
* ``rows`` (SDPA, eager): texts bin-packed (best-fit decreasing) into rows as wide as the group's
  longest text, with a 4D block-diagonal mask made by transformers' own mask interface
  (``packed_sequence_mask_function`` on top of the causal or bidirectional pattern), since
  transformers 5 derives a packed-sequence mask from ``position_ids`` only for causal masks
  (``create_causal_mask``) and never for bidirectional ones (encoders, ``is_causal=False``
  decoders). A row's unused tail is one padding segment that attends only to itself.

In both, ``position_ids`` restart at 0 per text (BERT's position embeddings and RoPE follow them),
``token_type_ids`` are packed with the tokens, and ``pool_packed`` pools each text from its own
tokens: mean over its ``pool_mask`` (so an excluded instruction stays out), its first token (cls) or
its last (last_token) — the padded path's numbers, within floating-point summation order.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
from torch import Tensor

from embed_core.errors import ConfigError

# keys of a packed feature dict (Embedder.forward tells packed from padded features by SEGMENTS)
SEGMENTS = "segment_ids"


def uses_varlen_attention(config: Any) -> bool:
    """True when the model's attention implementation is a FlashAttention variant, whose
    variable-length kernel takes packed sequences without a mask."""
    from transformers.utils.generic import is_flash_attention_requested

    return is_flash_attention_requested(config)


ATTENTIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")


def flash_attn_imports() -> bool:
    """Whether the ``flash_attn`` package imports (a wheel built for another torch is found but fails
    to import: its kernels' ABI does not match)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 (ImportError, or an undefined symbol raised as OSError/RuntimeError)
        return False
    return True


def resolve_attention(setting: str, device_type: str) -> str | None:
    """The ``attn_implementation`` to load a trained model with (``train.attention``): auto =
    FlashAttention-2 on CUDA where the ``flash_attn`` package imports (so packed passes run its
    variable-length kernel), else transformers' default (None: SDPA); a named one as it is, with
    flash_attention_2 refused where it cannot run. ``flex_attention`` (torch's FlexAttention,
    compiled) takes packed rows as a block-sparse document mask instead of a dense one: the choice
    on a GPU without flash-attn for long, length-skewed groups."""
    has_flash = device_type == "cuda" and flash_attn_imports()
    if setting == "auto":
        return "flash_attention_2" if has_flash else None
    if setting == "flash_attention_2" and not has_flash:
        raise ConfigError(f"train.attention: flash_attention_2 needs CUDA and a flash-attn package that imports "
                          f"(device: {device_type}); use attention: auto, sdpa or flex_attention here")
    return setting


def attends_causally(model: torch.nn.Module, config: Any) -> bool:
    """Whether the model's self-attention is causal: Gemma-3's ``use_bidirectional_attention`` or a
    config's ``is_causal`` decides (transformers passes ``config.is_causal`` to every attention call),
    else the attention modules' own ``is_causal`` (BERT: False; decoders: True)."""
    if getattr(config, "use_bidirectional_attention", False):
        return False
    flag = getattr(config, "is_causal", None)
    if flag is not None:
        return bool(flag)
    return any(getattr(m, "is_causal", False) is True for m in model.modules())


def best_fit_rows(lengths: list[int], width: int) -> list[tuple[int, int]]:
    """(row, offset) of each text, texts taken longest first into the fullest row they still fit
    (best-fit decreasing), rows ``width`` tokens wide; every length must be <= ``width``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    used: list[int] = []
    place = [(0, 0)] * len(lengths)
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            row = len(used)
            used.append(0)
        else:
            row = free.pop(at)[1]
        place[i] = (row, used[row])
        used[row] += n
        if width - used[row] > 0:
            bisect.insort(free, (width - used[row], row))
    return place


# packing: auto off FlashAttention packs a group when its rows (as wide as its longest text) number
# at most this share of its texts: each packed position costs a little more than a padded one (the
# block-diagonal mask), so packing pays where padding is most of the pass. Measured with
# tests/benchmarks/bench_train.py on a 2-core AVX512-BF16 EPYC (docs/experiments.md): STS-B batches
# (short, skewed: about 0.35 of the texts' rows) 1.8x faster packed in bf16 and 1.45x in fp32;
# SciFact's 256-token passages (one per row) 10 % slower packed.
PACK_ROW_SHARE = 0.75


def packing_pays(lengths: list[int]) -> bool:
    """Whether best-fit rows as wide as the longest of ``lengths`` number at most ``PACK_ROW_SHARE``
    of the texts (``packing: auto`` where the attention needs a mask)."""
    if len(lengths) < 2:
        return False
    rows = 1 + max(r for r, _ in best_fit_rows(lengths, max(lengths)))
    return rows <= PACK_ROW_SHARE * len(lengths)


def pack_features(features: dict[str, Tensor], *, varlen: bool, pad_id: int = 0) -> dict[str, Tensor]:
    """Right-padded ``Embedder.tokenize`` features [B, L] as packed features: ``input_ids``,
    ``position_ids``, ``token_type_ids`` (when given) and ``segment_ids`` (the text of each position,
    -1 for a row's padding tail) as [R, W]; ``token_index``/``token_text``/``token_weight`` (the flat
    position, text and pool weight of each real token), ``first``/``last`` (each text's first and
    last flat position); with ``varlen`` one row and ``cu_seqlens``/``max_seqlen`` for the kernel."""
    mask = features["attention_mask"]
    lengths = mask.sum(dim=1)
    n, total = len(lengths), int(lengths.sum())
    if varlen:
        width, rows = total, 1
        starts = torch.cumsum(lengths, 0) - lengths
    else:
        width = int(lengths.max())
        place = best_fit_rows(lengths.tolist(), width)
        rows = 1 + max(r for r, _ in place)
        starts = torch.tensor([r * width + o for r, o in place], dtype=torch.long)
    text = torch.repeat_interleave(torch.arange(n), lengths)  # the text of each real token
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    dest, src = starts[text] + within, text * mask.size(1) + within
    out: dict[str, Tensor] = {}
    for key, fill in (("input_ids", pad_id), ("token_type_ids", 0)):
        if key in features:
            flat = torch.full((rows * width,), fill, dtype=features[key].dtype)
            flat[dest] = features[key].reshape(-1)[src]
            out[key] = flat.view(rows, width)
    positions = torch.arange(rows * width) % width  # the tail's positions: any in range
    positions[dest] = within
    segments = torch.full((rows * width,), -1, dtype=torch.long)
    segments[dest] = text
    out.update(position_ids=positions.view(rows, width), segment_ids=segments.view(rows, width),
               token_index=dest, token_text=text,
               token_weight=features["pool_mask"].reshape(-1)[src].float(),
               first=starts, last=starts + lengths - 1)
    if varlen:
        out["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0).to(torch.int32)])
        out["max_seqlen"] = int(lengths.max())  # a Python int: reading it back from the device would sync
    return out


def packed_attention_mask(config: Any, segments: Tensor, causal: bool, dtype: torch.dtype) -> Any:
    """The 4D mask of packed rows in the form the model's attention implementation takes (SDPA:
    boolean, eager: additive in ``dtype``), made by transformers' mask interface: each position
    attends to its own segment only, causally or not."""
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        and_masks,
        bidirectional_mask_function,
        causal_mask_function,
        packed_sequence_mask_function,
    )

    implementation = config._attn_implementation
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ConfigError(f"train.packing: attention implementation {implementation!r} takes no packed-sequence "
                          "mask; use sdpa, eager or flash_attention_2, or packing: off")
    base = causal_mask_function if causal else bidirectional_mask_function
    rows, width = segments.shape
    return ALL_MASK_ATTENTION_FUNCTIONS[implementation](
        batch_size=rows, q_length=width, kv_length=width, mask_function=and_masks(base, packed_sequence_mask_function(segments)),
        attention_mask=None, allow_is_causal_skip=False, allow_is_bidirectional_skip=False, dtype=dtype,
        config=config, device=segments.device)


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's attention computes in: autocast's where it is on (the trainer's bf16
    passes, FSDP2's included, whose stored shards stay fp32), else the embedding weights'."""
    weight = model.get_input_embeddings().weight
    if torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type)
    return weight.dtype


def packed_model_inputs(model: torch.nn.Module, config: Any, features: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments for ``model(...)`` on packed features: the kernel's sequence boundaries
    for a varlen layout (``max_seqlen`` a Python int: no device sync), else the block-diagonal mask
    (an eager mask in the dtype attention computes in)."""
    inputs: dict[str, Any] = {k: features[k] for k in ("input_ids", "position_ids", "token_type_ids") if k in features}
    if "cu_seqlens" in features:
        longest = features["max_seqlen"]
        inputs.update(cu_seq_lens_q=features["cu_seqlens"], cu_seq_lens_k=features["cu_seqlens"],
                      max_length_q=longest, max_length_k=longest)
    else:
        inputs["attention_mask"] = packed_attention_mask(config, features[SEGMENTS], attends_causally(model, config),
                                                        compute_dtype(model))
    return inputs


def pool_packed(hidden: Tensor, features: dict[str, Tensor], pooling: str) -> Tensor:
    """Per-text pooling of packed hidden states [R, W, H] to [N, H]: the first or last token of each
    text, or the mean over its tokens weighted by its pool mask (the padded path's
    ``sum(h · m) / max(sum(m), 1e-9)``). The mean's sums and counts accumulate in fp32 whatever the
    hidden states' dtype: in bf16 a count stops at 256 and, on CUDA, every ``index_add_`` into a
    bf16 buffer is an atomic add rounded to 8 bits (pytorch/pytorch#84981)."""
    flat = hidden.reshape(-1, hidden.size(-1))
    if pooling == "cls":
        return flat.index_select(0, features["first"])
    if pooling == "last_token":
        return flat.index_select(0, features["last"])
    n = features["first"].size(0)
    weight = features["token_weight"].to(device=hidden.device, dtype=torch.float32)
    tokens = flat.index_select(0, features["token_index"]).float() * weight[:, None]
    sums = tokens.new_zeros(n, flat.size(-1)).index_add_(0, features["token_text"], tokens)
    counts = weight.new_zeros(n).index_add_(0, features["token_text"], weight)
    return sums / counts.clamp(min=1e-9)[:, None]

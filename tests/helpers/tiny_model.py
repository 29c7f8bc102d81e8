"""A tiny randomly initialised BERT built in code (tests never load real weights from a hub).

It reuses the packaged all-MiniLM-L6-v2 tokenizer files (offline) with a 2-layer, 32-wide model."""

from __future__ import annotations

import shutil
from pathlib import Path


TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _save(model, dest: Path) -> None:
    """``save_pretrained`` as embedpipe saves (without importing DeepSpeed: embed_core/model/compat.py)."""
    from embed_core.model.compat import deepspeed_only_once_imported

    deepspeed_only_once_imported()
    model.save_pretrained(dest)


def _copy_tokenizer(src: Path, dest: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dest / name)


def build_tiny_bert(dest: Path, dropout: float = 0.1) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    from embed_core.model.encoder import default_model_path

    dest.mkdir(parents=True, exist_ok=True)
    src = Path(default_model_path())
    _copy_tokenizer(src, dest)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    _save(BertModel(config), dest)
    return dest


def build_tiny_gemma(dest: Path) -> Path:
    """A tiny randomly initialised Gemma-3 causal LM (the packaged Gemma-3-270M's architecture) with
    the same offline tokenizer, given BOS/EOS so it can serve as a decoder."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tok_dir = build_tiny_bert(dest.parent / f"{dest.name}-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    tokenizer.bos_token, tokenizer.eos_token = "[CLS]", "[SEP]"
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                              sliding_window=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    _save(Gemma3ForCausalLM(config), dest)
    tokenizer.save_pretrained(dest)
    return dest


def build_tiny_decoder(dest: Path, model_type: str = "qwen3", tokenizer_dir: Path | None = None, **sizes) -> Path:
    """A tiny randomly initialised decoder of ``model_type`` (qwen2, qwen3, mistral, llama,
    gemma3_text: the QZhou recipe's family) with the packaged tokenizer: 2 layers, 32 wide unless
    ``sizes`` (config fields: hidden_size, num_hidden_layers, ...) say otherwise."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModel

    tokenizer_dir = tokenizer_dir or build_tiny_bert(dest.parent / f"{dest.name}-tokenizer")
    kw = dict(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0)
    if model_type != "qwen2":
        kw["head_dim"] = 16
    if model_type == "gemma3_text":
        kw["sliding_window"] = 64
    kw.update(sizes)
    torch.manual_seed(0)
    _save(AutoModel.from_config(CONFIG_MAPPING[model_type](**kw)), dest)
    _copy_tokenizer(tokenizer_dir, dest)
    return dest


def build_tiny_causal_lm(dest: Path, model_type: str = "qwen3", *, tied: bool = True,
                         tokenizer_dir: Path | None = None) -> Path:
    """A tiny randomly initialised decoder saved the way real checkpoints of ``model_type`` (qwen2,
    qwen3, llama, mistral) are: as its causal-LM class (``Qwen3ForCausalLM``...), with an
    ``lm_head`` tied to the input embeddings (``tie_word_embeddings``, as Qwen3's small models) or
    untied (as the 7B ones), grouped-query attention (4 heads, 2 KV heads, head_dim 16), 2 layers,
    64 wide, and the packaged tokenizer."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    tokenizer_dir = tokenizer_dir or build_tiny_bert(dest.parent / f"{dest.name}-tokenizer")
    kw = dict(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, tie_word_embeddings=tied)
    if model_type != "qwen2":
        kw["head_dim"] = 16
    torch.manual_seed(0)
    _save(AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**kw)), dest)
    _copy_tokenizer(tokenizer_dir, dest)
    return dest


def build_tiny_cross_encoder(dest: Path) -> Path:
    """A tiny randomly initialised BERT with a one-logit classification head (a cross-encoder's
    shape: sentence-transformers' ``CrossEncoder`` loads it), with the packaged tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from embed_core.model.encoder import default_model_path

    dest.mkdir(parents=True, exist_ok=True)
    _copy_tokenizer(Path(default_model_path()), dest)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1)
    _save(BertForSequenceClassification(config), dest)
    return dest

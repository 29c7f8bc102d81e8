"""The one check a model directory passes before anything loads it (base model, evaluated model,
mined-with model): a directory, with ``config.json``, and safetensors weights that are whole.

A bad directory is refused with one line naming it and saying what to do, instead of a traceback
from deep inside transformers. Pickle-only weights (``pytorch_model.bin``) are refused too: model
directories may come from others and unpickling is code execution (torch's ``weights_only``
loader narrows that, and has had bypasses); converting them once to safetensors is one line.
A directory with a GGUF file is left to transformers' GGUF loader (config and weights in the file).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from embed_core.errors import EmbedpipeError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
CONVERT_HINT = ("convert it once to safetensors (load it with transformers' from_pretrained, trusting its source, "
                "and save_pretrained it: that writes model.safetensors)")


class ModelFilesError(EmbedpipeError):
    """A model directory cannot be loaded: not a model, a file, damaged or unsafe weights."""


def check_model_dir(path: str | Path) -> None:
    """Raise ``ModelFilesError`` unless ``path`` is a loadable model directory (see the module doc)."""
    root = Path(path)
    if root.is_file():
        if root.suffix == ".gguf":
            return
        raise ModelFilesError(f"{root}: is a file, not a model directory; give the directory that holds "
                              "config.json and the weights (or a .gguf file)")
    if not root.is_dir():
        raise ModelFilesError(f"{root}: not a model directory")
    if any(root.glob("*.gguf")):
        return
    if not (root / "config.json").is_file():
        raise ModelFilesError(f"{root}: not a model directory (no config.json); give a Hugging Face or "
                              "sentence-transformers model directory, or 'default' for the packaged model")
    shards = safetensors_files(root)
    if not shards:
        if any(root.glob("pytorch_model*.bin")):
            raise ModelFilesError(f"{root}: has only pickle weights (pytorch_model.bin), which embedpipe does not "
                                  f"load (unpickling can run code); {CONVERT_HINT}")
        raise ModelFilesError(f"{root}: no model weights (model.safetensors) in the directory")
    for shard in shards:
        check_safetensors(shard)


def safetensors_files(root: Path) -> list[Path]:
    """The weight files a directory's model loads: the shards its index names, else ``*.safetensors``."""
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(root.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ModelFilesError(f"{index}: not a safetensors index (weight_map missing or not JSON); "
                              "copy the model again") from None
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise ModelFilesError(f"{root / missing[0]}: weight shard named by {index.name} is missing; copy the model again")
    return [root / n for n in names]


def check_safetensors(path: Path) -> None:
    """A safetensors file whose header parses and whose tensors end exactly at the end of the file
    (a cut-off copy or download fails here, without reading the weights)."""
    size = path.stat().st_size
    damaged = f"{path}: truncated or damaged safetensors file ({size} bytes); copy or download the model again"
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelFilesError(damaged)
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ModelFilesError(damaged)
        try:
            header = json.loads(fh.read(length))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise ModelFilesError(damaged) from None
    if 8 + length + end != size:
        raise ModelFilesError(damaged)

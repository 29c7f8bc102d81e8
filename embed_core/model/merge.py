"""Weight averaging of saved models of one architecture: a training stage's ``merge`` (WiSE-FT,
Wortsman et al. 2022: θ = (1 − w)·θ_stage + w·θ_other, which keeps what the other model was good
at) and a sweep's uniform model soup (Wortsman et al. 2022, "Model soups").

Every model is a directory with ``model.safetensors`` or sharded safetensors
(``model-00001-of-0000N.safetensors`` and the ``model.safetensors.index.json`` that names them,
``embed_core.model.files``); the weights must have the same names and shapes (models trained from
one another do). The average is computed one tensor at a time, read with ``safe_open`` (memory
mapped), summed in fp32 and stored in the first model's dtypes, and written one file at a time in
the first model's layout: the memory held is one output file's tensors, not three copies of the
model.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from embed_core.errors import EmbedpipeError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _label(model: Path) -> Path:
    """How errors name a model's weights: its index where it is sharded, else its one file."""
    return model / INDEX if (model / INDEX).is_file() else model / WEIGHTS


def averaged_files(models: list[Path], weights: list[float]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, its tensors) of Σᵢ weightsᵢ · θᵢ, file by file in the layout of ``models[0]``
    (the weights are used as given: pass ones that sum to 1 for an average)."""
    from safetensors import safe_open

    from embed_core.model.files import tensor_names

    if len(models) != len(weights) or not models:
        raise ValueError("one weight per model, and at least one model")
    models = [Path(m) for m in models]
    layouts = [tensor_names(m) for m in models]
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(path: Path) -> Any:
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return handles[path]

        def shape(layout: dict[str, Path], name: str) -> list[int]:
            return list(handle(layout[name]).get_slice(name).get_shape())

        for model, layout in zip(models[1:], layouts[1:]):
            other = sorted(set(layout) ^ set(layouts[0])) or \
                [n for n in layouts[0] if shape(layout, n) != shape(layouts[0], n)]
            if other:
                raise EmbedpipeError(f"{_label(model)}: cannot be averaged with {_label(models[0])}: the weights "
                                     f"differ in names or shapes (first: {other[0]})")
        files: dict[str, list[str]] = {}
        for name, path in layouts[0].items():
            files.setdefault(path.name, []).append(name)
        for file_name, names in files.items():
            out = {}
            for name in names:
                total, dtype = None, None
                for layout, weight in zip(layouts, weights):
                    tensor = handle(layout[name]).get_tensor(name)
                    dtype = dtype or tensor.dtype
                    part = tensor.float() * weight
                    total = part if total is None else total + part
                out[name] = total.to(dtype).contiguous()
            yield file_name, out


def weighted_average(models: list[Path], weights: list[float]) -> dict[str, Any]:
    """Σᵢ weightsᵢ · θᵢ over the weights of ``models``, all tensors in one dict (``write_average``
    writes them file by file instead)."""
    total: dict[str, Any] = {}
    for _, tensors in averaged_files(models, weights):
        total.update(tensors)
    return total


def write_average(models: list[Path], weights: list[float], out_dir: Path) -> None:
    """Replace ``out_dir``'s weights with the weighted average of ``models``' (``out_dir`` holds a
    complete model of the same architecture: its config, tokenizer and settings stay; it may be
    ``models[0]``), in the layout of ``models[0]`` (one file, or its shards and index)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    first = Path(models[0])
    written: set[str] = set()
    for file_name, tensors in averaged_files(models, weights):
        tmp = out_dir / f".{file_name}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out_dir / file_name)  # models[0]'s file may be this one: read whole before
        written.add(file_name)
    if (first / INDEX).is_file():
        index = json.loads((first / INDEX).read_text(encoding="utf-8"))
        if first.resolve() != out_dir.resolve():
            (out_dir / INDEX).write_text(json.dumps(index, indent=2), encoding="utf-8")
        written.add(INDEX)
    else:
        (out_dir / INDEX).unlink(missing_ok=True)
    for stale in out_dir.glob("*.safetensors"):  # another layout's weights would shadow these
        if stale.name not in written:
            stale.unlink()

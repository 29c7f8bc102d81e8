"""Weight averaging of saved models of one architecture: a training stage's ``merge`` (WiSE-FT,
Wortsman et al. 2022: θ = (1 − w)·θ_stage + w·θ_other, which keeps what the other model was good
at) and a sweep's uniform model soup (Wortsman et al. 2022, "Model soups").

Every model is a directory with ``model.safetensors``; the weights must have the same names and
shapes (models trained from one another do). The sum is taken in fp32 and stored in the first
model's dtypes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embed_core.errors import EmbedpipeError

WEIGHTS = "model.safetensors"


def weighted_average(models: list[Path], weights: list[float]) -> dict[str, Any]:
    """Σᵢ weightsᵢ · θᵢ over the ``model.safetensors`` of ``models`` (the weights are used as
    given: pass ones that sum to 1 for an average)."""
    from safetensors.torch import load_file

    if len(models) != len(weights) or not models:
        raise ValueError("one weight per model, and at least one model")
    total: dict[str, Any] = {}
    dtypes: dict[str, Any] = {}
    for model, weight in zip(models, weights):
        state = load_file(Path(model) / WEIGHTS)
        if total and (set(state) != set(total) or any(state[k].shape != total[k].shape for k in state)):
            other = sorted(set(state) ^ set(total)) or [k for k in state if state[k].shape != total[k].shape]
            raise EmbedpipeError(f"{Path(model) / WEIGHTS}: cannot be averaged with {Path(models[0]) / WEIGHTS}: "
                                 f"the weights differ in names or shapes (first: {other[0]})")
        for name, tensor in state.items():
            dtypes.setdefault(name, tensor.dtype)
            part = tensor.float() * weight
            total[name] = total[name] + part if name in total else part
    return {name: tensor.to(dtypes[name]).contiguous() for name, tensor in total.items()}


def write_average(models: list[Path], weights: list[float], out_dir: Path) -> None:
    """Replace ``out_dir``'s weights with the weighted average of ``models``' (``out_dir`` holds a
    complete model of the same architecture: its config, tokenizer and settings stay)."""
    from safetensors.torch import save_file

    averaged = weighted_average(models, weights)
    save_file(averaged, str(Path(out_dir) / WEIGHTS), metadata={"format": "pt"})

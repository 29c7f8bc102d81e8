"""A trained stage is committed only with finite weights: a run that diverged (a learning rate too
high, a loss that overflowed) ends with one line naming the stage, the first broken tensor and the
step its loss stopped being finite, and the stage's previous artifact stays as it was."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from embed_core.errors import EmbedpipeError


class NonFiniteError(EmbedpipeError):
    """Training produced NaN or infinite weights; nothing was committed."""


def first_nonfinite_step(rows: Iterable[Mapping[str, Any]]) -> int | None:
    """The first logged step whose loss is NaN or infinite, or None."""
    for row in rows:
        loss = row.get("loss")
        if isinstance(loss, float) and not math.isfinite(loss):
            return int(row["step"])
    return None


def check_finite_weights(stage: str, tensors: Iterable[tuple[str, torch.Tensor]], rows: list[Mapping[str, Any]],
                         steps: int) -> None:
    """A ``NonFiniteError`` (one line) when a floating-point tensor of ``tensors`` holds NaN or inf."""
    broken, first = 0, None
    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            broken += 1
            first = first or name
    if not broken:
        return
    since = first_nonfinite_step(rows)
    loss = f"; its loss was not finite from step {since}" if since is not None else ""
    raise NonFiniteError(f"train stage {stage}: {broken} weight tensor{'s' if broken > 1 else ''} hold NaN or "
                         f"infinite values after step {steps} (first: {first}){loss}; nothing was committed and the "
                         "stage's previous model is kept: lower lr (or raise warmup_steps) and rerun")

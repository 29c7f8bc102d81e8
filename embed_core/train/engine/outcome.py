"""What a trainer's ``fit`` returns: the trained run, typed, for the stage's commit to read by fields
(the steps, the metric and dev rows, the kept weights' step, the records consumed, where it ran)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embed_core.train.engine.lineage import Consumed


@dataclass(frozen=True)
class FitOutcome:
    """One finished ``fit`` on one rank."""

    steps: int  # optimizer steps trained
    metrics: list[dict[str, Any]]  # one row per micro-batch (the stage's metrics.parquet)
    dev_rows: list[dict[str, Any]]  # one row per (evaluation step, dev task); empty without dev tasks
    best: dict[str, Any] | None  # {"step", "score"} of the best dev selection score; None without evaluations
    selected_step: int  # the step whose weights the model holds (the best one under dev select: best)
    consumed: list[Consumed] | None  # the records each step consumed; None: trained on derived examples
    world: int  # processes that trained
    device: Any  # torch.device this rank trained on
    bf16: bool  # bf16 autocast
    model: Any  # the trained module (this rank's view; sharded under FSDP)
    state: dict[str, Any] | None  # whole weights gathered for the save (FSDP, save_dtype); None: the model's own

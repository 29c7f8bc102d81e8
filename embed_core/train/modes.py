"""The training modes, one table entry each (``stage.mode``): how the mode builds its trainer, saves
its model and describes its losses, and which of the stage's features it has. The stage's recipe
(``embed_core.train.run``), its commit and the config's validation ask an entry; none of them tests
the mode's name. The module stays light (the config imports it, so it imports nothing of the
stage's): an entry names its functions in ``embed_core.train.trainers``, imported on their call.

* ``build(step, datasets, instructions, checkpoint_dir)``: the trainer, ready to ``fit``;
* ``save(step, outcome, instructions, datasets, model_dir, training)``: the committed model's files;
* ``losses(stage, datasets)``: the losses, as the model card lists them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IMPL = "embed_core.train.trainers"

# (dataset -> instruction, task -> instruction) the model trains with
Instructions = tuple[dict[str, str], dict[str, str]]


@dataclass(frozen=True)
class Mode:
    name: str
    build: Callable[..., Any]  # (step, datasets, instructions, checkpoint_dir) -> trainer
    save: Callable[..., None]  # (step, outcome, instructions, datasets, model_dir, training) -> None
    losses: Callable[..., dict[str, Any]]  # (stage, datasets) -> {task: description}
    no_probe: str | None  # why no probe.npz (the in-training encoder is not the saved layout); None: probed
    dev: bool  # dev evaluation during training (and best-weights selection)
    lineage: bool  # trains on the upstream records themselves (not derived examples): lineage.parquet
    merges: bool  # its saved weights average with another stage's (merge)
    matryoshka: bool  # a Matryoshka loss over prefix dimensions
    shards: bool  # trains under sharding: fsdp
    planned: bool  # the memory plan (embed_core.train.plan) models it


def _impl(function: str) -> Callable[..., Any]:
    """``embed_core.train.trainers.<function>``, imported on the first call (no import edge here)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(IMPL), function)(*args, **kwargs)

    call.__name__ = call.__qualname__ = function
    return call


_AUTOREGEMBED = dict(save=_impl("autoregembed_save"), losses=_impl("autoregembed_losses"), no_probe="autoregembed",
                     dev=False, lineage=False, merges=False, matryoshka=False, shards=False, planned=False)

MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("contrastive", _impl("contrastive_trainer"), _impl("contrastive_save"), _impl("contrastive_losses"),
         no_probe=None, dev=True, lineage=True, merges=True, matryoshka=True, shards=True, planned=True),
    Mode("autoregembed_ic", _impl("ic_trainer"), **_AUTOREGEMBED),
    Mode("autoregembed_cda", _impl("cda_trainer"), **_AUTOREGEMBED),
)}


def mode_of(stage: Any) -> Mode:
    """The table entry of ``stage``'s mode."""
    return MODES[stage.mode]

"""The loss interface: one class per loss, each in its own file under ``embed_core/losses/``.

A loss declares

* ``name`` — what a stage config writes (``losses: {retrieval: {name: pair_bce, scale: 20.0}}``);
* ``tasks`` — the tasks it can train, and ``default_for`` — the tasks it is QZhou's loss for;
* ``Params`` — its parameters, a strict pydantic model with a description on every field (the
  config is validated against it when it is loaded);
* ``layout`` — which texts a batch (``embed_core.losses.batch``) carries for it: ``standard``
  (query, positive, hard negatives; or text pairs with scores), ``hmcl`` (plus a weak positive),
  ``multi_positive`` (K+ positives per query);

and one call: ``loss(embeddings, batch, context) -> scalar``, a pure function of the L2-normalised
embeddings of the batch's text groups. ``context`` carries what is not in the batch: the step
(warm-ups) and ``gather`` (all-gather with gradients across ranks; identity on one process), so
a loss decides itself which of its inputs cross devices; ``count`` adds to the figures the step's
metrics row carries (e.g. the false negatives masked, ``embed_core.losses.false_negatives``).
Adding a loss is one new file with a subclass of ``Loss`` (found by ``embed_core.losses.registry``)
and its hand-computed test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

if TYPE_CHECKING:
    from embed_core.losses.batch import TaskBatch


class LossParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # finite, as every config float


@dataclass(frozen=True)
class LossContext:
    step: int = 0
    warmup_steps: int = 0
    gather: Callable[[Tensor], Tensor] = lambda x: x  # rows of every rank, in rank order (sizes may differ)
    counts: dict[str, int] = field(default_factory=dict)  # figures for the step's metrics row (``count``)

    def count(self, name: str, value: int) -> None:
        """Add ``value`` to the metric ``name`` of this micro-batch (the same on every rank)."""
        self.counts[name] = self.counts.get(name, 0) + value

    def gather_negatives(self, emb: dict[str, Tensor]) -> Tensor:
        """The batch's hard negatives of every rank, flat ``[m, d]`` (empty when there are none):
        a rank without negatives still joins the gather, so the ranks' collectives stay in step."""
        neg = emb.get("negative")
        if neg is None:
            neg = emb["query"].new_zeros(0, emb["query"].size(-1))
        return self.gather(neg)


class Loss:
    name: ClassVar[str]
    tasks: ClassVar[tuple[str, ...]]
    default_for: ClassVar[tuple[str, ...]] = ()
    layout: ClassVar[str] = "standard"
    Params: ClassVar[type[LossParams]] = LossParams

    def __init__(self, params: LossParams | None = None):
        self.params = params if params is not None else self.Params()

    def batch_options(self) -> dict:
        """Extra arguments for the batch layout (e.g. positives per query)."""
        return {}

    def trainable_module(self) -> nn.Module | None:
        """Parameters the loss trains besides the encoder (HMCL's pair-type head): the trainer
        attaches them to the model, so the optimizer, checkpoints and DeepSpeed carry them."""
        return None

    def __call__(self, emb: dict[str, Tensor], batch: "TaskBatch", ctx: LossContext) -> Tensor:
        raise NotImplementedError

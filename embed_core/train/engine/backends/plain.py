"""No sharding: every process holds the whole model; with several processes the gradients are
averaged once per step in buckets while the step's last backward runs (``GradientAverage``)."""

from __future__ import annotations

from torch import Tensor

from embed_core.train.engine.backends.base import Backend
from embed_core.dist.distributed import GradientAverage


class Plain(Backend):
    name = "none"

    def wrap(self, lr_lambda) -> None:
        super().wrap(lr_lambda)
        self.averager = GradientAverage(self.model) if self.world > 1 else None

    def backward(self, loss: Tensor, final: bool) -> None:
        if self.averager is not None:
            self.averager.arm(final)  # only the step's last backward reduces (its gradients are final)
        loss.backward()

    def step(self) -> None:
        if self.averager is not None:
            self.averager.finish()
        super().step()

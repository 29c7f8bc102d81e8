"""``train.sharding: fsdp``: torch FSDP2 (``embed_core.train.sharding``). Every forward gathers the
weights of each layer from all ranks, so forwards are collective; gradients are reduce-scattered
after every backward (``fsdp_sync: every_backward``) or only the step's last (``step``);
checkpoints hold each rank's shard (torch.distributed.checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from embed_core.train import sharding
from embed_core.train.backends.base import Backend
from embed_core.train.checkpoint import load_plain, save_plain


class FSDP(Backend):
    name = "fsdp"
    collective_forward = True

    @classmethod
    def applies(cls, train) -> bool:
        return train.sharding == "fsdp"

    def wrap(self, lr_lambda) -> None:
        sharding.shard(self.model, bf16=self.bf16)  # before the optimizer: it must hold the shards
        super().wrap(lr_lambda)

    def backward(self, loss: Tensor, final: bool) -> None:
        sharding.gradient_sync(self.model, final or self.train.fsdp_sync == "every_backward")
        loss.backward()

    def save_state(self, directory: Path) -> dict[str, Any]:
        groups = sharding.save(directory / "sharded", self.model, self.optimizer)  # each rank its shard
        if self.rank == 0:
            save_plain({"scheduler": self.scheduler.state_dict()}, directory / "state.pt")
        return {"param_groups": groups}

    def load_state(self, directory: Path, meta: dict[str, Any]) -> None:
        state = load_plain(directory / "state.pt", map_location=self.device)
        sharding.load(directory / "sharded", self.model, self.optimizer, meta["param_groups"])
        self.scheduler.load_state_dict(state["scheduler"])

    def save_weights(self, path: Path) -> None:
        sharding.save(path.with_suffix(""), self.model)  # a directory of shards, one per rank

    def load_weights(self, path: Path) -> None:
        sharding.load(path.with_suffix(""), self.model)

    def consolidated_state(self):
        """The encoder's whole weights gathered once to rank 0's CPU (the others get ``{}``), keyed
        like ``Embedder.model.state_dict()``."""
        state = sharding.full_state_dict(self.model)
        return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}

"""``train.sharding: fsdp``: torch FSDP2 (``embed_core.train.engine.sharding``). Every forward gathers the
weights of each layer from all ranks, so forwards are collective; gradients are reduce-scattered
after every backward (``fsdp_sync: every_backward``) or only the step's last (``step``);
checkpoints hold each rank's shard (torch.distributed.checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from embed_core.train.engine import sharding
from embed_core.train.engine.backends.base import Backend, stored
from embed_core.train.engine.checkpoint import load_plain, save_plain


class FSDP(Backend):
    name = "fsdp"
    collective_forward = True

    @classmethod
    def reads_weights(cls, rank: int) -> bool:
        return rank == 0  # the others get their shards from rank 0 (sharding.load_sharded)

    def place(self):
        """Sharded before anything is on the device: rank 0's weights broadcast into every rank's
        shards (``sharding.load_sharded``), on a flat or hybrid mesh (``train.fsdp_mesh``)."""
        mesh = sharding.mesh_for(self.train, self.world, self.device.type)
        self.model = sharding.load_sharded(self.model, device=self.device, bf16=self.bf16, mesh=mesh, rank=self.rank,
                                           stored=lambda m: stored(m, self.train.weights_dtype))
        return self.model

    def wrap(self, lr_lambda) -> None:
        if not sharding.is_sharded(self.model):  # before the optimizer: it must hold the shards
            sharding.shard(self.model, bf16=self.bf16)
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

    def consolidated_state(self, dtype=None):
        """The encoder's whole weights gathered once to rank 0's CPU in ``dtype`` (the others get
        ``{}``), keyed like ``Embedder.model.state_dict()``."""
        state = sharding.full_state_dict(self.model, dtype)
        return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}

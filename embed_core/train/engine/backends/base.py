"""The interface every training back end implements: how the model is wrapped, how a backward pass
and an optimizer step run, and how its state is saved and restored. The trainer's loop calls only
these methods, so it has no branch on the back end (torchtune's ``training/_distributed.py`` keeps
parallelism in one place the same way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from embed_core.train.engine.checkpoint import load_plain, save_plain
from embed_core.train.engine.telemetry import total_norm


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's groups: weight decay on weight matrices, not on biases, norms or 1-d parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def stored(model: torch.nn.Module, weights_dtype: str) -> torch.nn.Module:
    """Trained weights in fp32 (the master copy AdamW updates, whatever dtype the checkpoint had);
    frozen ones (a LoRA base) in ``weights_dtype``."""
    frozen = torch.bfloat16 if weights_dtype == "bf16" else torch.float32
    for p in model.parameters():
        want = torch.float32 if p.requires_grad else frozen
        if p.is_floating_point() and p.dtype != want:
            p.data = p.data.to(want)
    return model


class Backend:
    """One way of training on one or several processes. Built around the model as loaded (on the
    CPU; ``place`` puts it on its device), its AdamW optimizer and its LR scheduler; ``wrap`` is
    called once before training."""

    name: ClassVar[str]
    #: a forward pass is itself a collective (it gathers sharded weights): every rank must make the
    #: same passes (``embed_core.train.engine.passes``), and dev evaluation runs on every rank
    collective_forward: ClassVar[bool] = False

    def __init__(self, model: torch.nn.Module, stage: Any, train: Any, *, device: torch.device, bf16: bool,
                 rank: int, world: int):
        self.model, self.stage, self.train = model, stage, train
        self.device, self.bf16, self.rank, self.world = device, bf16, rank, world
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.grad_norm: float | None = None

    @classmethod
    def reads_weights(cls, rank: int) -> bool:
        """Whether this rank reads the checkpoint's weights (False: it builds the model on the meta
        device and ``place`` gives it its weights)."""
        return True

    def place(self) -> torch.nn.Module:
        """The model on its device in the dtypes it trains in (``stored``); returns it."""
        self.model = stored(self.model, self.train.weights_dtype).to(self.device)
        return self.model

    def wrap(self, lr_lambda: Any) -> None:
        """Shard or wrap the model, then build AdamW and the schedule around what it trains."""
        self.optimizer = torch.optim.AdamW(param_groups(self.model, self.stage.weight_decay), lr=self.stage.lr,
                                           fused=self.device.type in ("cpu", "cuda"))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

    # -- a step ----------------------------------------------------------------------------------
    @property
    def forward(self) -> Any:
        """What encodes a pass's inputs (the model, or a wrapper that must see the forward)."""
        return self.model

    def loss_scale(self) -> float:
        """What a micro-batch's loss is multiplied by before its backward (the mean over the step's
        micro-batches, unless the back end divides itself)."""
        return 1.0 / self.stage.grad_accum

    def backward(self, loss: Tensor, final: bool) -> None:
        """A backward pass; ``final``: the step's last, after which gradients are complete."""
        loss.backward()

    def micro_batch_done(self) -> None:
        """After each micro-batch's passes."""

    def step(self) -> None:
        """The optimizer step (after the step's last micro-batch): clip, step, schedule, zero."""
        if self.stage.max_grad_norm:  # the norm before clipping, as every trainer logs it
            self.grad_norm = total_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                       self.stage.max_grad_norm))
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self.grad_norm = total_norm(torch.nn.utils.get_total_norm(grads)) if grads else None
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- state -----------------------------------------------------------------------------------
    def save_state(self, directory: Path) -> dict[str, Any]:
        """Write the model, optimizer and scheduler state into a checkpoint directory (every rank
        calls it); returns plain data for the checkpoint's ``trainer_state.json``."""
        if self.rank == 0:
            save_plain({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict()}, directory / "state.pt")
        return {}

    def load_state(self, directory: Path, meta: dict[str, Any]) -> None:
        state = load_plain(directory / "state.pt", map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def save_weights(self, path: Path) -> None:
        """The model's weights alone (the best dev step's), by the ranks that evaluate."""
        try:
            save_plain(self.model.state_dict(), path.with_suffix(".tmp"))
        except BaseException:
            path.with_suffix(".tmp").unlink(missing_ok=True)  # a full disk gets its space back
            raise
        path.with_suffix(".tmp").replace(path)

    def load_weights(self, path: Path) -> None:
        self.model.load_state_dict(load_plain(path, map_location=self.device))

    def consolidated_state(self, dtype: torch.dtype | None = None) -> dict[str, Tensor] | None:
        """The whole model's weights for the committed model (floating ones in ``dtype``) when the
        model alone does not hold them (every rank calls it); None: the model saves its own."""
        return None

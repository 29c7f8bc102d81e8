"""``train.deepspeed``: a DeepSpeed engine (ZeRO stage 0-2; ZeRO-3 is refused at load) around model,
optimizer and scheduler. It divides by its gradient accumulation steps, scales losses, clips and
steps at the accumulation boundary itself, and saves its own partitioned checkpoint layout."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import Tensor

from embed_core.errors import ConfigError
from embed_core.train.engine.backends.base import Backend
from embed_core.train.engine.telemetry import total_norm


class DeepSpeed(Backend):
    name = "deepspeed"

    def wrap(self, lr_lambda) -> None:
        """Single-process runs get local rendezvous defaults; multi-process runs come from the
        ``deepspeed``/``torchrun`` launcher's environment. On CPU (``DS_ACCELERATOR=cpu``) gloo."""
        super().wrap(lr_lambda)
        try:
            import deepspeed
        except ImportError:
            raise ConfigError("train.deepspeed is set but deepspeed is not installed: pip install -e '.[deepspeed]'") from None
        import torch

        if "MASTER_PORT" not in os.environ:  # one process: any free port (two runs on a machine never clash)
            from embed_core.procs import free_port

            os.environ["MASTER_PORT"] = str(free_port())
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        if self.device.type == "cpu":
            _skip_cpu_inference_kernel()
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        config = engine_config(self.stage, self.train.deepspeed, bf16=self.bf16)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.model, optimizer=self.optimizer, lr_scheduler=self.scheduler, config=config)

    @property
    def forward(self):
        return self.engine

    def loss_scale(self) -> float:
        return 1.0  # the engine divides by its gradient_accumulation_steps

    def backward(self, loss: Tensor, final: bool) -> None:
        self.engine.backward(loss)

    def micro_batch_done(self) -> None:
        self.engine.step()  # steps the optimizer only at the accumulation boundary
        norm = self.engine.get_global_grad_norm()
        self.grad_norm = None if norm is None else total_norm(norm)

    def step(self) -> None:
        """Done by the engine at the step's last micro-batch."""

    def save_state(self, directory: Path) -> dict[str, Any]:
        self.engine.save_checkpoint(str(directory / "deepspeed"), tag="ds")  # ZeRO partitions: every rank
        return {}

    def load_state(self, directory: Path, meta: dict[str, Any]) -> None:
        self.engine.load_checkpoint(str(directory / "deepspeed"), tag="ds")


def engine_config(stage: Any, user: dict[str, Any], *, bf16: bool) -> dict[str, Any]:
    """DeepSpeed's config: the stage's accumulation and clipping, ``bf16: {enabled: true}`` when the
    trainer computes in bf16 (so ZeRO partitions and communicates bf16 with fp32 master weights,
    as the autocast forward computes), then the user's ``train.deepspeed``, which wins."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": stage.grad_accum,
            **({"gradient_clipping": stage.max_grad_norm} if stage.max_grad_norm else {}),
            **({"bf16": {"enabled": True}} if bf16 else {}), **user}


def _skip_cpu_inference_kernel() -> None:
    """DeepSpeed's CPU communication backend JIT-compiles a shared-memory all-reduce kernel
    (``deepspeed_shm_comm``: about a minute of C++ on 2 cores, again whenever its build flags change)
    as it starts. Only tensor-parallel inference calls it (``inference_all_reduce``); every collective
    of training goes through torch.distributed (gloo). Marked as not buildable, the backend starts
    without it, as it does on a platform that cannot build it."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False

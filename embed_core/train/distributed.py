"""Multi-process training under the standard launchers (``torchrun``, ``deepspeed``, ``accelerate
launch``): each sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and the rendezvous address in every
process's environment. Rank 0 is the main process: it alone takes the run-directory lock, runs
the Prefect task, writes checkpoints and commits the stage; the other ranks train alongside and
wait at barriers.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch


def launched() -> bool:
    """True when a launcher started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """Rank 0 of a launched job, or a plain single process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return env_rank() == 0


def init_process_group(single: bool = False, timeout_s: float | None = None) -> tuple[int, int]:
    """(rank, world size); initialises the default process group once when launched (nccl on
    CUDA, each process on its ``LOCAL_RANK`` device; gloo on CPU), its collectives failing after
    ``timeout_s`` (torch's default when None). ``single``: a plain process gets a process group of
    one too (FSDP shards over a process group), in memory, with no port."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    if launched() and not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(backend, **timeout)
    elif single and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1,
                                             **timeout)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class GradientAverage:
    """What DistributedDataParallel does, once per optimizer step: every gradient summed over the
    ranks and divided by the world size, in buckets of about ``bucket_mb`` that are all-reduced
    (asynchronously) while the step's last backward pass is still running. A parameter's hook
    (``register_post_accumulate_grad_hook``) puts it in the current bucket once its gradient is
    final, which is only in the step's last backward (``arm`` before it): the earlier ones
    (GradCache's other chunks, other micro-batches) only accumulate, which is why this is not a
    DDP wrapper, whose hooks reduce after every backward. ``finish`` reduces what no hook saw (a
    parameter the last backward did not reach) and waits for every bucket."""

    def __init__(self, module: torch.nn.Module, bucket_mb: float = 25.0):
        self.world = torch.distributed.get_world_size()
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.armed = False
        self._bucket: list[torch.Tensor] = []
        self._bucket_size = 0
        self._pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        self._done: set[int] = set()
        self.params = [p for p in module.parameters() if p.requires_grad]
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def arm(self, armed: bool) -> None:
        self.armed = armed

    def _ready(self, p: torch.Tensor) -> None:
        if not self.armed or id(p) in self._done:
            return
        self._done.add(id(p))
        self._bucket.append(p)
        self._bucket_size += p.grad.numel() * p.grad.element_size()
        if self._bucket_size >= self.bucket_bytes:
            self._launch()

    def _launch(self) -> None:
        if self._bucket:
            flat = torch.cat([p.grad.reshape(-1) for p in self._bucket])
            self._pending.append((torch.distributed.all_reduce(flat, async_op=True), flat, self._bucket))
            self._bucket, self._bucket_size = [], 0

    def finish(self) -> None:
        """Every gradient averaged over the ranks (after the step's last backward)."""
        for p in self.params:
            if p.grad is not None and id(p) not in self._done:
                self._bucket.append(p)
        self._launch()
        for work, flat, params in self._pending:
            work.wait()
            flat.div_(self.world)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
                offset += p.grad.numel()
        self._pending, self._done, self.armed = [], set(), False


def mean_over_ranks(value: float) -> float:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t)
    return float(t.item()) / torch.distributed.get_world_size()


def broadcast_from_main(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (any picklable value; the identity in a single process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


_PATIENT: dict[str, Any] = {}


def wait_for_main() -> None:
    """Every rank waits here until rank 0 arrives, however long rank 0's work before it takes (a dev
    evaluation): a barrier on a gloo group of its own whose timeout is a day, where the default
    group's collectives would fail after ``train.dist_timeout_s``. Every rank must call it at the
    same point (the first call creates the group, which is itself collective)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_world_size() == 1:
        return
    if "group" not in _PATIENT:
        _PATIENT["group"] = torch.distributed.new_group(backend="gloo", timeout=timedelta(days=1))
    torch.distributed.barrier(group=_PATIENT["group"])


def destroy_process_group() -> None:
    """Tear down the default process group and the groups made beside it, so that a later
    ``init_process_group`` in this process (the next stage of ``local_ranks``) starts afresh."""
    _PATIENT.clear()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

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


def average_gradients(parameters) -> None:
    """What DistributedDataParallel does after backward, done once per optimizer step: sum every
    gradient over the ranks and divide by the world size. (Explicit rather than a DDP wrapper:
    GradCache runs several backward passes per step, which DDP's bucketed hooks would reduce each
    time.)"""
    world = torch.distributed.get_world_size()
    for p in parameters:
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)
            p.grad.div_(world)


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

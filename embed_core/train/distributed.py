"""Multi-process training under the standard launchers (``torchrun``, ``deepspeed``, ``accelerate
launch``): each sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and the rendezvous address in every
process's environment. Rank 0 is the main process: it alone takes the run-directory lock, runs
the Prefect task, writes checkpoints and commits the stage; the other ranks train alongside and
wait at barriers.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import torch

from embed_core.errors import CollectiveError, register_user_error
from embed_core.train.world import env_rank, launched


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


def _all_reduce(value: float, dtype: torch.dtype, op: Any) -> float:
    """``value`` reduced over the ranks with ``op`` (one all-reduce of one number; itself alone in a
    single process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    t = torch.tensor([value], dtype=dtype)
    if torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t, op=op)
    return t.item()


def mean_over_ranks(value: float) -> float:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    return float(_all_reduce(value, torch.float64, torch.distributed.ReduceOp.SUM)) / torch.distributed.get_world_size()


def max_over_ranks(value: int) -> int:
    """The largest of the ranks' ``value`` (``value`` itself in a single process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    return int(_all_reduce(value, torch.int64, torch.distributed.ReduceOp.MAX))


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


# -- a collective that fails, and the end of a rank -------------------------------------------------

_CONTEXT: dict[str, Any] = {}  # what this process trains now, for the line of a collective that fails


def set_stage(name: str | None) -> None:
    """Name the training stage this process works on from now on (None: none). A collective that
    fails later names it in its one line (:func:`collective_error`); each rank sets its own, when a
    stage starts (``local_ranks`` does, on every rank)."""
    _CONTEXT["stage"] = name


# torch raises a failed collective as a RuntimeError (``DistBackendError`` is one) whose message is
# the C++ library's: gloo's timeout and lost-peer messages, nccl's watchdog timeout
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)\s*ms for (?:send|recv) operation")
_NCCL_TIMEOUT = re.compile(r"OpType=(\w+).*?Timeout\(ms\)=(\d+)", re.S)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited")
_ENDINGS = ("rank_ending_cleanly", "local_ranks")  # what the error passes through on its way out, not its place
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/"  # embed_core/


def collective_error(exc: BaseException) -> CollectiveError | None:
    """``exc``, or an error it was raised from, as one line when it is a collective's failure: a wait
    longer than ``train.dist_timeout_s`` (another rank stalled) or a connection lost to another rank
    (it died). The line names this rank, the stage (:func:`set_stage`) and the operation, where
    torch's own message is a C++ source path and a byte count. None for any other error."""
    for err in _chain(exc):
        if isinstance(err, CollectiveError):
            return err
        if not isinstance(err, RuntimeError):
            continue
        text = str(err)
        gloo, nccl = _GLOO_TIMEOUT.search(text), _NCCL_TIMEOUT.search(text)
        if gloo or nccl:
            seconds = int(gloo.group(1) if gloo else nccl.group(2)) / 1000
            op = _operation(err, nccl.group(1).lower() if nccl else None)
            return CollectiveError(
                f"{_who()}: a collective ({op}) waited longer than train.dist_timeout_s = {seconds:g} s: another "
                "rank stalled or died; its log says which (raise train.dist_timeout_s if a rank legitimately works "
                "that long between collectives)")
        if any(marker in text for marker in _PEER_GONE):
            detail = text.split("] ", 1)[-1].split(". ")[0]  # gloo's sentence, without its C++ source path
            return CollectiveError(f"{_who()}: a collective ({_operation(err, None)}) lost its connection to another "
                                   f"rank, which exited or crashed; its own error or log says why (torch: {detail})")
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors it was raised from or while handling, innermost last."""
    out: list[BaseException] = []
    while exc is not None and exc not in out and len(out) < 16:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _who() -> str:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:  # torn down already: the launcher's (or local_ranks') environment
        rank, world = env_rank(), int(os.environ.get("WORLD_SIZE", "1"))
    stage = _CONTEXT.get("stage")
    return f"training rank {rank} of {world}" + (f", stage {stage}" if stage else "")


def _operation(exc: BaseException, known: str | None) -> str:
    """The collective from the traceback: the torch.distributed function that the code called
    (``all_reduce``, ``barrier``), else the innermost torch.distributed function that waited on it
    (an asynchronous one: FSDP's all-gathers), with the embedpipe function it ran under."""
    calls, tb = [], exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        calls.append((code.co_filename.replace("\\", "/"), code.co_qualname))
        tb = tb.tb_next
    c10d = [name for path, name in calls if path.endswith("torch/distributed/distributed_c10d.py")]
    inner = [name for path, name in calls if "/torch/distributed/" in path and not path.endswith("c10d_logger.py")]
    first = next((i for i, (path, _) in enumerate(calls) if "/torch/distributed/" in path), len(calls))
    ours = [name for path, name in calls[:first] if path.startswith(_PACKAGE) and name not in _ENDINGS]
    op = known or (c10d[0] if c10d else inner[-1] if inner else None)
    return ", ".join(x for x in (op, f"in {ours[-1]}" if ours else None) if x) or "unknown"


register_user_error(lambda exc: None if (err := collective_error(exc)) is None else str(err))


@contextmanager
def rank_ending_cleanly() -> Iterator[None]:
    """The body as one rank of a multi-process training (a launched command, a spawned rank), ended
    the same way whatever way the body ends:

    * a collective's failure raised as its one line (:class:`CollectiveError`), named while the
      process group still tells this rank's place;
    * the process groups destroyed (the default one and ``wait_for_main``'s): a gloo group left to
      the interpreter's exit is torn down by static destructors while its threads still run, and the
      rank aborts ("terminate called without an active exception", SIGABRT) after a successful
      run, so its launcher reports a failure. No barrier first: after a failure the other ranks may
      never come, and a rank must not wait for them to leave;
    * a SIGTERM or SIGINT (the launcher stopping the job) ends it within seconds even while it is
      blocked in a C++ collective, where no Python handler runs (``embed_core.procs.end_on_signals``).
    """
    from embed_core.procs import end_on_signals

    end_on_signals((signal.SIGTERM, signal.SIGINT))
    ok = False
    try:
        yield
        ok = True
    except Exception as exc:  # noqa: BLE001 (re-raised, as its one line when it is a collective's)
        error = collective_error(exc)
        if error is None or error is exc:
            raise
        raise error from exc
    finally:
        if ok:
            destroy_process_group()
        else:
            _destroy_within(10.0)


def _destroy_within(seconds: float) -> None:
    """``destroy_process_group`` after a failure: its errors dropped (the failure is the one to
    report), and at most ``seconds`` waited for it. Destroying waits for the collectives still
    queued (an asynchronous all-gather issued before the failure), each up to the collective
    timeout when its peer lives but stalls; a failed rank must leave sooner."""
    import threading

    def destroy() -> None:
        with suppress(Exception):
            destroy_process_group()

    worker = threading.Thread(target=destroy, daemon=True, name="destroy-process-group")
    worker.start()
    worker.join(seconds)

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
from pathlib import Path
from typing import Any

import torch

from embed_core.errors import CollectiveError, EmbedpipeError, LaunchError, register_user_error
from embed_core.dist.world import Launch, env_rank, launch_contract, launched, local_world_size


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
        job = launch_contract()
        divide_host_threads(job.local_world)
        for key, value in rank_environment(job.local_world).items():  # read by CUDA's, NCCL's, tokenizers' first use
            os.environ.setdefault(key, value)
        if torch.cuda.is_available():
            torch.cuda.set_device(local_device_index(job.local_rank, torch.cuda.device_count()))
        try:
            torch.distributed.init_process_group(backend, **timeout)
        except torch.distributed.DistError as exc:  # the store: a rank that never came, an address never reached
            raise LaunchError(rendezvous_line(job, exc, timeout_s)) from None
    elif single and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1,
                                             **timeout)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def rendezvous_line(job: Launch, exc: BaseException, timeout_s: float | None) -> str:
    """The one line of a rank that could not meet the others at ``MASTER_ADDR:MASTER_PORT``: a rank
    that never came (rank 0 waits for them), or a rank 0 that never listened (the others wait for it)."""
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    detail = detail.split("] ", 1)[-1]  # torch's sentence, without its C++ source path
    within = f"within train.dist_timeout_s = {timeout_s:g} s" if timeout_s else "within torch's default timeout"
    waited = ("the other ranks did not all join" if job.rank == 0 else
              f"rank 0 was not reachable at {job.address}")
    return (f"{who(job.rank, job.world)}: the job's ranks did not meet at MASTER_ADDR:MASTER_PORT = {job.address} "
            f"{within}: {waited} (torch: {detail}); start every rank with the same MASTER_ADDR and MASTER_PORT, "
            "and check that rank 0 is running and its host reachable on that port")


def local_device_index(local_rank: int, visible: int) -> int:
    """The CUDA device index of the rank ``local_rank`` of its node, where ``visible`` devices are
    visible to it: its local rank when the node's devices are all visible, 0 when the scheduler
    gives each rank only its own (per-rank ``CUDA_VISIBLE_DEVICES`` under SLURM or Kubernetes)."""
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    raise LaunchError(f"LOCAL_RANK={local_rank} but this process sees {visible} CUDA devices (0..{visible - 1}): start "
                      f"at most {visible} processes per node (torchrun --nproc_per_node {visible})")


def host_share(local_world: int) -> int:
    """This rank's share of the host's cores (those this process may run on), with
    ``local_world`` ranks on the host: at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world))


def divide_host_threads(local_world: int) -> None:
    """Torch's intra-op threads of this rank set to its share of the host's cores (:func:`host_share`),
    unless ``OMP_NUM_THREADS`` says how many (torchrun sets it to 1 per rank unless the user did):
    without it, ``local_world`` ranks each use every core, and their CPU work (tokenizing, batch
    planning) oversubscribes the host."""
    if "OMP_NUM_THREADS" not in os.environ and local_world > 1:
        torch.set_num_threads(host_share(local_world))


# TORCH_NCCL_TRACE_BUFFER_SIZE: the flight recorder's ring of the last collectives (each rank's log
# of what it issued, dumped when the watchdog times out: who waited in what); about 2000 entries
# cover several optimizer steps of FSDP's per-layer collectives
FLIGHT_RECORDER_ENTRIES = 2000


def rank_environment(local_world: int, dump_prefix: str | None = None) -> dict[str, str]:
    """The variables a training rank runs with, those the user has not set: NCCL's flight recorder
    on and dumped on a watchdog timeout (to ``dump_prefix``<rank>, torch's default /tmp/nccl_trace_rank_
    without one), CUDA's allocator growing its segments instead of fragmenting under GradCache's
    and the length buckets' changing shapes, and the tokenizers' thread pool cut to this rank's
    share of the host's cores. ``TORCH_NCCL_BLOCKING_WAIT`` stays off: it blocks the host in every
    wait and removes FSDP's overlap of communication with computation."""
    env = os.environ
    out: dict[str, str] = {}
    if "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        out["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(FLIGHT_RECORDER_ENTRIES)
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if dump_prefix and "TORCH_FR_DUMP_TEMP_FILE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env:
        out["TORCH_FR_DUMP_TEMP_FILE"] = out["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = dump_prefix  # new name, older torch's
    if "PYTORCH_CUDA_ALLOC_CONF" not in env and "PYTORCH_ALLOC_CONF" not in env:
        out["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if "RAYON_NUM_THREADS" not in env and local_world > 1:
        out["RAYON_NUM_THREADS"] = str(host_share(local_world))
        if host_share(local_world) == 1 and "TOKENIZERS_PARALLELISM" not in env:
            out["TOKENIZERS_PARALLELISM"] = "false"
    return out


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


def check_shared_directory(directory: Path, what: str) -> None:
    """Every rank sees the files rank 0 writes in ``directory`` (the run directory's, where the
    checkpoints, the records and the committed stages are), else a ``LaunchError`` on every rank
    naming the ranks and hosts that do not: rank 0 writes a fresh nonce there, every rank reads it
    once rank 0's broadcast says it is written, and the ranks gather what they read. A node with a
    directory of its own would otherwise train and write checkpoints rank 0 never sees, and fail
    only at the resume or the commit. ``what`` names the check in the line (a stage)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_world_size() == 1:
        return
    import secrets
    import socket

    marker = Path(directory) / f".shared-check-{what}"
    nonce, failed = None, None
    if torch.distributed.get_rank() == 0:
        nonce = secrets.token_hex(16)
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(nonce)
        except OSError as exc:  # raised after the broadcast: the other ranks must not wait for it
            nonce, failed = None, exc
    nonce = broadcast_from_main(nonce)  # received once rank 0 has written it
    if failed is not None:
        raise failed
    if nonce is None:
        raise LaunchError(f"{_who()}: rank 0 could not write in {directory}; its own error says why")
    try:
        seen = marker.read_text() == nonce
    except OSError:
        seen = False
    views: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(views, (seen, socket.gethostname(), str(directory)))
    if torch.distributed.get_rank() == 0:
        marker.unlink(missing_ok=True)  # every rank has read it: the gather is past
    _, main_host, main_dir = views[0]
    blind = [f"{rank} ({host}" + (f", in {path}" if path != main_dir else "") + ")"
             for rank, (ok, host, path) in enumerate(views) if not ok]
    if blind:
        raise LaunchError(f"{_who()}: rank{'s' if len(blind) > 1 else ''} {', '.join(blind)} cannot see the file "
                          f"rank 0 ({main_host}) wrote in {main_dir}: the run directory must be on storage shared by "
                          "every node (NFS, Lustre, a cluster file system), the same path on each")


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
# the C++ library's: gloo's timeout, lost-peer and connect messages, NCCL's timeout (raised in Python
# only under TORCH_NCCL_BLOCKING_WAIT, or once the watchdog aborted the communicator)
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)\s*ms for (?:send|recv) operation")
_NCCL_TIMEOUT = re.compile(r"OpType=(\w+).*?Timeout\(ms\)=(\d+)", re.S)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited")
# gloo connecting the ranks of a group (init_process_group, new_group): a connect to the address a peer
# advertised, refused or unreachable ("[.../gloo/transport/tcp/pair.cc:799] connect [127.0.1.1]:25472:
# Connection refused"), or "Gloo connectFullMesh failed with [...pair.cc:144] no error"
_GLOO_CONNECT = re.compile(r"connect \[([^\]]*)\]:\d+: (Connection refused|No route to host|Network is unreachable|"
                           r"Connection timed out)|connectFullMesh failed")
_GLOO_NO_INTERFACE = re.compile(r"Unable to find address for: (\S+)")  # GLOO_SOCKET_IFNAME naming no interface
_ENDINGS = ("rank_ending_cleanly", "local_ranks")  # what the error passes through on its way out, not its place
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/"  # embed_core/


def collective_error(exc: BaseException) -> EmbedpipeError | None:
    """``exc``, or an error it was raised from, as one line when it is a collective's failure: a wait
    longer than ``train.dist_timeout_s`` (another rank stalled), a connection lost to another rank
    (it died), or ranks that cannot connect at all (gloo's network interface, a ``LaunchError``).
    The line names this rank, the stage (:func:`set_stage`) and the operation, where torch's own
    message is a C++ source path and a byte count. None for any other error."""
    for err in _chain(exc):
        if isinstance(err, CollectiveError):
            return err
        if not isinstance(err, RuntimeError):
            continue
        text = str(err)
        gloo, nccl = _GLOO_TIMEOUT.search(text), _NCCL_TIMEOUT.search(text)
        if gloo or nccl:
            seconds = int(gloo.group(1) if gloo else nccl.group(2)) / 1000
            return CollectiveError(timeout_line(_who(), _operation(err, nccl_operation(nccl.group(1)) if nccl else None),
                                                seconds))
        connect = _GLOO_CONNECT.search(text)
        if connect:
            return LaunchError(gloo_connect_line(_who(), connect))
        interface = _GLOO_NO_INTERFACE.search(text)
        if interface:
            return LaunchError(f"{_who()}: GLOO_SOCKET_IFNAME={interface.group(1)} names no network interface of this "
                               "host with an address: name the interface the nodes reach each other on (`ip -br addr` "
                               "lists them), on every node")
        if any(marker in text for marker in _PEER_GONE):
            detail = text.split("] ", 1)[-1].split(". ")[0]  # gloo's sentence, without its C++ source path
            return CollectiveError(f"{_who()}: a collective ({_operation(err, None)}) lost its connection to another "
                                   f"rank, which exited or crashed; its own error or log says why (torch: {detail})")
    return None


def timeout_line(who: str, op: str, seconds: float, ending: str = "its log says which") -> str:
    """The one line of a collective that waited past ``train.dist_timeout_s``."""
    return (f"{who}: a collective ({op}) waited longer than train.dist_timeout_s = {seconds:g} s: another rank stalled "
            f"or died; {ending} (raise train.dist_timeout_s if a rank legitimately works that long between collectives)")


# NCCL's OpType (``WorkNCCL(..., OpType=_ALLGATHER_BASE, ...)``) as the torch.distributed function
_NCCL_OPS = {"ALLREDUCE": "all_reduce", "ALLGATHER": "all_gather", "_ALLGATHER_BASE": "all_gather_into_tensor",
             "REDUCE_SCATTER": "reduce_scatter", "_REDUCE_SCATTER_BASE": "reduce_scatter_tensor",
             "BROADCAST": "broadcast", "BARRIER": "barrier", "ALLTOALL": "all_to_all", "ALLTOALL_BASE": "all_to_all",
             "REDUCE": "reduce", "GATHER": "gather", "SCATTER": "scatter", "SEND": "send", "RECV": "recv",
             "COALESCED": "coalesced collectives"}


def nccl_operation(op_type: str) -> str:
    return _NCCL_OPS.get(op_type, op_type.lower())


def gloo_connect_line(who: str, found: re.Match) -> str:
    """The one line of gloo failing to connect the ranks (``_GLOO_CONNECT`` found in its message)."""
    address = found.group(1)
    detail = f"connect [{address}]: {found.group(2)}" if address is not None else "connectFullMesh failed"
    why = (f"{address} is a loopback address: this host's name resolves to it" if address and address.startswith("127.")
           else "the address gloo took for a rank is not one the other nodes reach")
    named = os.environ.get("GLOO_SOCKET_IFNAME")
    fix = (f"GLOO_SOCKET_IFNAME={named} is set here: check that it names that interface on every node" if named else
           "set GLOO_SOCKET_IFNAME on every node to the network interface the nodes reach each other on (one name, "
           "such as eth0 or ib0: `ip -br addr` lists them), and NCCL_SOCKET_IFNAME likewise")
    return f"{who}: gloo could not connect the ranks ({detail}; {why}); {fix}"


# What NCCL writes to a rank's log (stderr) before its watchdog ends the process (SIGABRT, exit code
# -6: no Python exception is raised, so the line the rank would print never comes). Recorded forms:
#   [rank3]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 3] Watchdog caught collective
#   operation timeout: WorkNCCL(SeqNum=7753, OpType=_REDUCE_SCATTER_BASE, NumelIn=544997376,
#   NumelOut=68124672, Timeout(ms)=600000) ran for 600061 milliseconds before timing out.
#   (torch 2.4+: "[PG ID 0 PG GUID 0(default_pg) Rank 1] ..."; before 2.2 no NumelIn/NumelOut)
# and under TORCH_NCCL_BLOCKING_WAIT=1 "[PG ID 0 PG GUID 0(default_pg) Rank 1] Work WorkNCCL(SeqNum=5,
# OpType=ALLREDUCE, ...) timed out in blocking wait." The watchdog's other fatal ends: an NCCL error
# (a peer gone: "ncclRemoteError", "remote process exited") and its heartbeat monitor.
_WATCHDOG = re.compile(r"(?:Watchdog caught collective operation timeout: |Work )WorkNCCL\(SeqNum=(\d+), OpType=(\w+)"
                       r"[^)]*?Timeout\(ms\)=(\d+)\)(?: ran for (\d+) milliseconds| timed out in blocking wait)")
_NCCL_PEER_GONE = re.compile(r"(ncclRemoteError|remote process exited|NCCL communicator was aborted)")
_HEARTBEAT = re.compile(r"Heartbeat monitor timed out|watchdog got stuck for (\d+) seconds")


def rank_log_failure(text: str, who: str) -> str | None:
    """The one line of a rank that NCCL ended (``text``: its log), naming the rank and stage (``who``),
    the collective and its sequence number, or None when its log has no such text."""
    found = _WATCHDOG.search(text)
    if found:
        seq, op, timeout_ms = found.group(1), nccl_operation(found.group(2)), int(found.group(3))
        ended = ("NCCL's watchdog ended this rank; the rank that did not reach this collective is the one to look at"
                 if found.group(4) else "its log says which")  # ran for N ms: the watchdog; else a blocking wait
        return timeout_line(who, f"{op}, NCCL sequence number {seq}", timeout_ms / 1000, ended)
    if _NCCL_PEER_GONE.search(text):
        return (f"{who}: a collective lost its connection to another rank, which exited or crashed, and NCCL's "
                "watchdog ended this rank; the other ranks' logs say why")
    stuck = _HEARTBEAT.search(text)
    if stuck:
        return (f"{who}: NCCL's watchdog was stuck (a CUDA or NCCL call hung) and its heartbeat monitor ended this "
                "rank; TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC sets how long it waits")
    return None


def who(rank: int, world: int) -> str:
    """``training rank 3 of 8, stage ret``: a rank of this process's job, in the current stage."""
    stage = _CONTEXT.get("stage")
    return f"training rank {rank} of {world}" + (f", stage {stage}" if stage else "")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors it was raised from or while handling, innermost last."""
    out: list[BaseException] = []
    while exc is not None and exc not in out and len(out) < 16:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _who() -> str:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return who(torch.distributed.get_rank(), torch.distributed.get_world_size())
    return who(env_rank(), int(os.environ.get("WORLD_SIZE", "1")))  # torn down already, or not yet up


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

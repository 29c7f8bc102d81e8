"""One training stage on several local processes without a launcher: a Prefect flow run on a GPU
worker with N devices (or ``embedpipe train`` without torchrun) trains with N ranks.

``local_ranks`` makes the calling process rank 0 of a process group of ``train.processes`` (auto:
one per visible CUDA device) and starts ranks 1..N-1 as children (``python -m
embed_core.dist.spawned <spec>``, rendezvous on a free local port, each armed to die with rank 0:
``embed_core.procs``). The children run the body rank 0 names (the train stage's
``run_train_stage``) as a launched rank would, so everything the launchers do holds here too (rank
0 alone writes and commits, and, in a flow run, reports to Prefect; the others train alongside and
wait at barriers). When the stage ends, rank 0 waits for its children and tears the process group
down, so the next training stage (or the next flow on the same worker) starts afresh. A child that fails is one line naming its rank, its
exit code, its own error line and its log (``<run_dir>/checkpoints/.ranks-<stage>/rank-<k>.log``);
when rank 0 fails because a child failed first (its collective lost the connection), the child's
failure is the one reported. Every rank, launched or spawned, names its stage for the line of a
collective that fails (``distributed.set_stage``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, Protocol

import torch

from embed_core.errors import CollectiveError, ConfigError, EmbedpipeError
from embed_core.procs import dying_with_parent, end_on_signals, free_port
from embed_core.stage_dirs import CHECKPOINTS
from embed_core.dist.distributed import (collective_error, destroy_process_group, rank_environment,
                                          rank_log_failure, set_stage, who)
from embed_core.dist.world import launched, world_size

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
FLIGHT_RECORDER = "flight-recorder"  # NCCL's dumps of the ranks' last collectives, rank-<k>, on a watchdog timeout


class ProcessesSetting(Protocol):
    """What the train config section says of its processes (``train.processes``)."""

    processes: int | Literal["auto"]


def training_processes(train: ProcessesSetting) -> int:
    """How many processes train a stage: the launcher's world size when launched, else
    ``train.processes`` (auto: the visible CUDA devices, 1 without CUDA)."""
    if launched():
        return world_size()
    if train.processes == "auto":
        return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    cuda = torch.cuda.is_available()
    has = torch.cuda.device_count() if cuda else os.cpu_count() or 1
    if train.processes > has:
        what = f"{has} CUDA device{'s' if has != 1 else ''}" if cuda else f"{has} CPU core{'s' if has != 1 else ''}"
        raise ConfigError(f"train.processes: {train.processes} processes, but this machine has {what} (one "
                          f"{'device' if cuda else 'core'} per rank at least): use processes: auto or at most {has}, "
                          "or launch on several machines with torchrun")
    return train.processes


@contextmanager
def local_ranks(config, run_dir: Path, stage_name: str, *, body: Callable, upstream: str,
                resume: bool) -> Iterator[None]:
    """Run the body as rank 0 of ``training_processes`` local ranks (nothing to do when launched or
    when one process trains, but to name the stage); the other ranks each call ``body`` (a
    module-level function, named in the spec: ``body(config, run_dir, stage_name, upstream=...,
    resume=...)``)."""
    set_stage(stage_name)
    n = 1 if launched() else training_processes(config.train)
    if n == 1:
        yield
        return
    # rank 0 obeys a SIGTERM (a Prefect worker cancelling the flow run) within seconds even while it
    # waits in a collective; its children, armed with SIGKILL, die with it
    end_on_signals((signal.SIGTERM, signal.SIGINT))
    work = Path(run_dir) / CHECKPOINTS / f".ranks-{stage_name}"
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"body": f"{body.__module__}:{body.__qualname__}",
                                "config": config.model_dump(mode="json"), "run_dir": str(run_dir),
                                "stage": stage_name, "upstream": upstream, "resume": resume}))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n),
           "LOCAL_WORLD_SIZE": str(n), **rank_environment(n, str(work / FLIGHT_RECORDER / "rank-"))}
    (work / FLIGHT_RECORDER).mkdir(exist_ok=True)
    children = []
    for k in range(1, n):
        log = open(work / f"rank-{k}.log", "w")  # noqa: SIM115 (closed with the child)
        children.append((k, log, subprocess.Popen(
            # SIGKILL: a rank blocked in a C++ collective would not run a SIGTERM handler
            dying_with_parent([sys.executable, "-m", "embed_core.dist.spawned", str(spec)], signal.SIGKILL),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,  # a Ctrl-C reaches rank 0, which stops them
            env={**os.environ, **env, "RANK": str(k), "LOCAL_RANK": str(k)})))
    saved = {key: os.environ.get(key) for key in (*RENDEZVOUS, *env)}
    threads = torch.get_num_threads()
    os.environ.update(env, RANK="0", LOCAL_RANK="0")
    try:
        try:
            yield
        except Exception as exc:  # noqa: BLE001 (re-raised: as what ended the stage)
            failure = _failure(children, work, exc)
            if failure is exc:
                raise
            raise failure from exc
        _wait(children, work)
    finally:
        for _, log, child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
            log.close()
        destroy_process_group()
        _restore(saved)
        torch.set_num_threads(threads)  # rank 0 had its share of the host's cores (divide_host_threads)
    shutil.rmtree(work, ignore_errors=True)  # kept, with the ranks' logs, when a rank failed


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _wait(children: list, work: Path) -> None:
    for k, _, child in children:
        code = child.wait()
        if code != 0:
            raise _child_failed(k, len(children) + 1, code, work)


def _failure(children: list, work: Path, exc: Exception) -> BaseException:
    """What ended the stage when rank 0 failed with ``exc``: a child that failed first (rank 0's
    collective then only lost its connection to it; the child's own exit is waited for a moment),
    else ``exc``, a collective's failure as its one line."""
    collective = collective_error(exc)
    if collective is None:
        return exc
    deadline = time.monotonic() + 3
    while True:
        failed = [(k, child.poll()) for k, _, child in children if child.poll() not in (None, 0)]
        if failed:
            return _child_failed(failed[0][0], len(children) + 1, failed[0][1], work)
        if time.monotonic() > deadline:
            return collective
        time.sleep(0.1)


def _child_failed(k: int, world: int, code: int, work: Path) -> EmbedpipeError:
    """The one line of child rank ``k`` that exited with ``code``: its own error line, else what its
    log shows ended it (NCCL's watchdog, which aborts the process before Python can say anything:
    exit code -6; a Python traceback's last line), with its log and flight-recorder dump."""
    log = work / f"rank-{k}.log"
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    dump = work / FLIGHT_RECORDER / f"rank-{k}"
    where = f"its log: {log}" + (f"; NCCL's flight recorder: {dump}" if dump.exists() else "")
    lines = [x for x in text.splitlines() if x.startswith("embedpipe: error: ")]
    if lines:  # the rank's own one line, which names it already
        return EmbedpipeError(f"{lines[-1].removeprefix('embedpipe: error: ')} (exit code {code}; {where})")
    nccl = rank_log_failure(text, who(k, world))
    if nccl is not None:
        return CollectiveError(f"{nccl} (exit code {code}; {where})")
    raised = [m.group(0) for m in _PYTHON_ERROR.finditer(text)]
    said = f": {raised[-1]}" if raised else ""
    return EmbedpipeError(f"{who(k, world)} exited with code {code}{said}; {where}")


# the last line of a Python traceback: "torch.OutOfMemoryError: CUDA out of memory. Tried to ..."
_PYTHON_ERROR = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt): .*$", re.M)

"""``embedpipe train`` under a multi-process launcher (``torchrun``, ``deepspeed``, ``accelerate
launch``): every rank runs the command. Rank 0 runs it as a single process would (the run-dir
lock, the Prefect flow, the commits); the other ranks train alongside it, outside Prefect, and
write nothing. Every other command runs in one process only. Every rank is SIGKILLed by the kernel
when its launcher process dies (``embed_core.procs``): a killed ``torchrun`` leaves no rank behind.
A launcher that stops its ranks (SIGTERM) has them gone within seconds, and every rank ends with
its process groups torn down: ``as_launched_rank``.
"""

from __future__ import annotations

import signal
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from embed_core.errors import EmbedpipeError
from embed_core.stage_dirs import TRAIN

if TYPE_CHECKING:
    from embed_core.config import RunConfig

# deepspeed's launcher appends --local_rank=N; the same value is in LOCAL_RANK, which is what is read
_LAUNCHER_ARGS = ("--local_rank=", "--local-rank=")


def without_launcher_args(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith(_LAUNCHER_ARGS)]


def as_launched_rank() -> AbstractContextManager[None]:
    """The command's body, in a process a launcher started as one of several (nothing otherwise):
    armed at once to die with its launcher (before a slow import: a launcher that dies meanwhile is
    noticed), and ended by ``embed_core.dist.distributed.rank_ending_cleanly``: a failed collective
    as one line, the process groups destroyed at the end whatever the outcome (else a gloo rank can
    abort at interpreter exit after a successful run), a SIGTERM from the launcher obeyed within
    seconds even in a rank blocked in a C++ collective."""
    from embed_core.dist.world import launched

    if not launched():  # torch is not imported for a plain command
        return nullcontext()
    from embed_core.procs import die_with_parent

    die_with_parent(signal.SIGKILL)
    from embed_core.dist.distributed import rank_ending_cleanly

    return rank_ending_cleanly()


def is_other_rank(command: str) -> bool:
    """True in a rank other than 0 of a launched job; a launched command other than train is an error.
    A launched rank (rank 0 too) is armed here to die with its launcher, and its launcher's variables
    checked (``embed_core.dist.world.launch_contract``)."""
    from embed_core.procs import die_with_parent
    from embed_core.dist.world import env_rank, launch_contract, launched  # no torch: most commands never train

    if not launched():
        return False
    if command != "train":
        raise EmbedpipeError(f"embedpipe {command} runs in one process; only `embedpipe train` runs under "
                             "torchrun, deepspeed or accelerate launch")
    die_with_parent(signal.SIGKILL)
    launch_contract()  # the launcher's variables, one line each, before the run directory is touched
    return env_rank() != 0


def train_alongside_rank_0(config: RunConfig, run_dir: str, options: Any, force: bool) -> None:
    """A rank other than 0 of a launched training job: no run-dir lock, no Prefect run, no writes.
    It makes rank 0's decisions from the same run directory (a stage whose artifact is intact for
    its inputs is skipped, unless ``force``) and trains each stage with it; rank 0 commits."""
    from embed_core import stages

    stage = stages.get(TRAIN)
    for instance in stage.instance_names(config, options):
        ctx = stages.context(config, run_dir, stage, instance, options)
        fingerprint, hit = stages.cache_decision(stage, ctx, force)
        if not hit:
            stage.run(ctx, fingerprint)

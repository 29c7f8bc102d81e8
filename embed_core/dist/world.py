"""This process's place in a multi-process job (a launcher's ranks, or the ones ``train.processes``
starts), read from the environment the launcher sets (``WORLD_SIZE``, ``RANK``). No torch: every
command asks before it runs, and most never train.

An environment that cannot be one job is refused with one line (:class:`LaunchError`) instead of
being read as a plain process: ``WORLD_SIZE`` or ``RANK`` that is not a number, a rank outside the
world, and a process that a job scheduler started as one of several tasks without a launcher
(``srun -n 8 python -m flows.cli train``, ``mpirun -np 8 ...``). Such tasks have no ``WORLD_SIZE``,
so each would run the whole command on its own, all of them writing one run directory; the
scheduler's own variables tell them apart from one process that a batch script runs once.

The rest of the launcher's contract — ``LOCAL_RANK`` within ``LOCAL_WORLD_SIZE``, the rendezvous
address ``MASTER_ADDR``/``MASTER_PORT`` — is checked once, by :func:`launch_contract`, when a
rank joins its process group (``embed_core.dist.distributed.init_process_group``), one line each,
as torchrun checks its own arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from embed_core.errors import LaunchError

# (variable, launcher) of a process started as one task of several: srun sets SLURM_STEP_NUM_TASKS
# for the tasks of a job step (a batch script itself has SLURM_NTASKS but no step: it runs once),
# Open MPI's mpirun OMPI_COMM_WORLD_SIZE, MPICH/Intel MPI's hydra and srun --mpi=pmi2 PMI_SIZE
_SCHEDULED_TASKS = (("SLURM_STEP_NUM_TASKS", "SLURM (srun)"), ("OMPI_COMM_WORLD_SIZE", "Open MPI (mpirun)"),
                    ("PMI_SIZE", "MPI (mpirun / mpiexec)"))


def _number(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} in this process's environment is not a number; a launcher (torchrun) "
                          f"sets {name}: unset it, or start the command under torchrun") from None


def world_size() -> int:
    """The number of processes of this process's job (1 outside one); the environment checked first."""
    world = _number("WORLD_SIZE", 0)
    if world == 0:
        _refuse_scheduled_tasks()
        return 1
    if world < 1:
        raise LaunchError(f"WORLD_SIZE={world} in this process's environment: a job has at least one process; "
                          "unset it, or start the command under torchrun")
    rank = _number("RANK", 0)
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is outside WORLD_SIZE={world} (ranks 0..{world - 1}): this process's "
                          "launch environment is inconsistent; start the command under torchrun, which sets both")
    return world


def _refuse_scheduled_tasks() -> None:
    for name, launcher in _SCHEDULED_TASKS:
        tasks = _number(name, 1)
        if tasks > 1:
            raise LaunchError(
                f"this process is one of {tasks} tasks that {launcher} started ({name}={tasks}), but WORLD_SIZE is "
                f"unset: each task would run the whole command on its own, all writing one run directory; start "
                f"training with torchrun, one per node (srun --ntasks-per-node=1 torchrun --nnodes $SLURM_NNODES "
                f"--nproc_per_node 8 ... -m flows.cli train ...), or run the command as one task")


def launched() -> bool:
    """True in a process of a multi-process job."""
    return world_size() > 1


def env_rank() -> int:
    """This process's rank in its job (0 outside one)."""
    return _number("RANK", 0) if launched() else 0


def local_world_size(world: int | None = None) -> int:
    """This node's processes of the job: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun, the trainer's
    own local ranks), else all ``world`` of them (default: the job's) on one node."""
    world = world_size() if world is None else world
    local = _number("LOCAL_WORLD_SIZE", world)
    return local if local > 0 else world


def spans_nodes() -> bool:
    """True where the job's ranks are on more than one machine (a launcher's ``LOCAL_WORLD_SIZE`` below
    its ``WORLD_SIZE``)."""
    return local_world_size() < world_size()


@dataclass(frozen=True)
class Launch:
    """What a launched rank needs to join its job: its place on its node and where the ranks meet."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int

    @property
    def address(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


def launch_contract() -> Launch:
    """The launcher's variables of a launched rank, parsed and checked (one line each, :class:`LaunchError`):
    ``WORLD_SIZE``/``RANK`` (:func:`world_size`), ``LOCAL_WORLD_SIZE`` in 1..WORLD_SIZE, ``LOCAL_RANK``
    in 0..LOCAL_WORLD_SIZE-1, ``MASTER_ADDR`` set and ``MASTER_PORT`` a port number."""
    world = world_size()
    local_world = _number("LOCAL_WORLD_SIZE", world)
    if not 1 <= local_world <= world:
        raise LaunchError(f"LOCAL_WORLD_SIZE={local_world} is outside 1..WORLD_SIZE={world}: this process's launch "
                          "environment is inconsistent; start the command under torchrun, which sets both")
    local = _number("LOCAL_RANK", 0)
    if not 0 <= local < local_world:
        raise LaunchError(f"LOCAL_RANK={local} is outside this node's {local_world} process"
                          f"{'es' if local_world > 1 else ''} (LOCAL_WORLD_SIZE={local_world}, ranks 0..{local_world - 1}): "
                          "this process's launch environment is inconsistent; start the command under torchrun")
    addr = os.environ.get("MASTER_ADDR", "").strip()
    if not addr:
        raise LaunchError(f"MASTER_ADDR is unset in a job of WORLD_SIZE={world}: its ranks have no address to meet "
                          "at; torchrun sets it, else set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port")
    port = _number("MASTER_PORT", 0)
    if not 0 < port < 65536:
        raise LaunchError(f"MASTER_PORT={os.environ.get('MASTER_PORT', '').strip() or 'unset'} in a job of "
                          f"WORLD_SIZE={world} is not a port number (1..65535); torchrun sets it, else set it to a "
                          "free port on rank 0's host")
    return Launch(env_rank(), world, local, local_world, addr, port)

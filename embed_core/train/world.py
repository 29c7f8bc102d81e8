"""This process's place in a multi-process job (a launcher's ranks, or the ones ``train.processes``
starts), read from the environment the launcher sets (``WORLD_SIZE``, ``RANK``). No torch: every
command asks before it runs, and most never train."""

from __future__ import annotations

import os


def launched() -> bool:
    """True in a process of a multi-process job."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def env_rank() -> int:
    """This process's rank in its job (0 outside one)."""
    return int(os.environ.get("RANK", "0"))


def spans_nodes() -> bool:
    """True where the job's ranks are on more than one machine (a launcher's ``LOCAL_WORLD_SIZE`` below
    its ``WORLD_SIZE``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) < world

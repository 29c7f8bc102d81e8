"""Rank 0's dev evaluation can take longer than the collective timeout (``train.dist_timeout_s``):
the other ranks wait for it in ``wait_for_main`` (a barrier of its own without that limit), not in
the next step's collective, which would fail. Two real gloo processes with a 2-second timeout; rank
0 is busy for 5 seconds."""

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow

TIMEOUT_S, BUSY_S = 2, 5


def _rank(rank: int, store: str, out: str, patient: bool) -> None:
    from embed_core.train.distributed import wait_for_main

    # the rendezvous itself with torch's default timeout (two processes can start seconds apart on a
    # loaded machine), the training collectives on a group with the short one
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    steps = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    torch.distributed.barrier()
    try:
        if rank == 0:
            time.sleep(BUSY_S)  # rank 0's long dev evaluation
        if patient:
            wait_for_main()
        t = torch.ones(1)
        torch.distributed.all_reduce(t, group=steps)  # the next step's collective
        result = f"ok {int(t.item())}"
    except Exception as exc:  # noqa: BLE001 (the outcome is what the test reads)
        result = f"failed {type(exc).__name__}"
    Path(out, f"rank{rank}").write_text(result)
    # a gloo group whose collective timed out can abort in its destructor at interpreter exit
    # ("terminate called without an active exception"); the outcome is written, so leave at once
    os._exit(0)


def _run(tmp_path: Path, patient: bool) -> dict[str, str]:
    out = tmp_path / ("patient" if patient else "plain")
    out.mkdir()
    mp.start_processes(_rank, args=(str(out / "store"), str(out), patient), nprocs=2, start_method="spawn")
    return {p.name: p.read_text() for p in sorted(out.glob("rank*"))}


def test_ranks_wait_for_a_dev_evaluation_longer_than_the_collective_timeout(tmp_path):
    assert _run(tmp_path, patient=True) == {"rank0": "ok 2", "rank1": "ok 2"}


def test_without_the_patient_barrier_the_same_wait_fails_at_the_collective_timeout(tmp_path):
    """The control: the timeout is real, so the test above could fail."""
    assert _run(tmp_path, patient=False)["rank1"].startswith("failed")

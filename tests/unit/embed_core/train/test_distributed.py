"""Rank 0's dev evaluation can take longer than the collective timeout (``train.dist_timeout_s``):
the other ranks wait for it in ``wait_for_main`` (a barrier of its own without that limit), not in
the next step's collective, which would fail. Two real gloo processes with a 2-second timeout; rank
0 is busy for 5 seconds."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers.repo import REPO

pytestmark = pytest.mark.slow

TIMEOUT_S, BUSY_S = 2, 5


def _rank(rank: int, store: str, out: str, patient: bool) -> None:
    from embed_core.dist.distributed import wait_for_main

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


def _stalled_collective(rank: int, store: str, out: str) -> None:
    """Rank 0 waits in an all-reduce that rank 1 joins only after the timeout; then rank 1's all-reduce
    finds rank 0 gone. Each writes the line its failure became, and returns: a clean exit."""
    from embed_core.errors import CollectiveError, user_error
    from embed_core.dist.distributed import rank_ending_cleanly, set_stage

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                                         timeout=timedelta(seconds=TIMEOUT_S))
    torch.distributed.barrier()
    set_stage("ret")
    try:
        with rank_ending_cleanly():
            if rank == 1:
                time.sleep(BUSY_S)
            try:
                torch.distributed.all_reduce(torch.ones(1))
            except RuntimeError as exc:  # torch's own error: the CLI's boundary turns it into the same line
                Path(out, f"user_error{rank}").write_text(str(user_error(exc)))
                raise
    except CollectiveError as exc:
        Path(out, f"rank{rank}").write_text(str(exc))
    assert not torch.distributed.is_initialized()  # torn down, though the body failed


def test_a_collective_that_times_out_or_loses_its_peer_is_one_line_naming_the_rank_the_stage_and_the_operation(
        tmp_path):
    mp.start_processes(_stalled_collective, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # raises if a rank does not exit 0
    lines = {p.name: p.read_text() for p in sorted(tmp_path.glob("*[01]"))}
    assert lines["rank0"] == lines["user_error0"] == (
        "training rank 0 of 2, stage ret: a collective (all_reduce) waited longer than train.dist_timeout_s = 2 s: "
        "another rank stalled or died; its log says which (raise train.dist_timeout_s if a rank legitimately works "
        "that long between collectives)")
    assert lines["rank1"] == lines["user_error1"]
    assert lines["rank1"].startswith("training rank 1 of 2, stage ret: a collective (all_reduce) lost its connection "
                                     "to another rank, which exited or crashed; its own error or log says why (torch: ")
    assert "\n" not in lines["rank1"] and "pytorch/third_party" not in lines["rank1"]


_BLOCKED_RANK = """
    import signal, sys, time
    from datetime import timedelta
    import torch
    from embed_core.procs import end_on_signals

    rank = int(sys.argv[1])
    torch.distributed.init_process_group("gloo", init_method="file://STORE", rank=rank, world_size=2,
                                         timeout=timedelta(seconds=120))
    torch.distributed.barrier()
    if rank == 1:
        time.sleep(120)  # never joins the all-reduce
    def stop(*_):  # a handler that would end the process, as Prefect's does during a flow run
        raise SystemExit(143)
    signal.signal(signal.SIGTERM, stop)
    if ARMED:
        end_on_signals((signal.SIGTERM,), grace_s=1)
    print("ready", flush=True)
    torch.distributed.all_reduce(torch.ones(1))  # blocked in gloo's C++ wait: no Python handler runs here
"""


def _sigterm_blocked_rank(tmp_path: Path, armed: bool) -> bool:
    """SIGTERM rank 0 while it waits in a collective; True if it is gone 5 s later."""
    from tests.helpers.procs import gone

    code = _BLOCKED_RANK.replace("STORE", str(tmp_path / f"store-{armed}")).replace("ARMED", str(armed))
    ranks = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(r)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)}) for r in (0, 1)]
    try:
        assert ranks[0].stdout.readline().strip() == "ready"
        time.sleep(1)  # inside the all-reduce
        ranks[0].send_signal(signal.SIGTERM)
        return gone(ranks[0].pid, seconds=5)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_sigterm_ends_a_rank_blocked_in_a_collective_within_seconds_despite_its_python_handler(tmp_path):
    assert _sigterm_blocked_rank(tmp_path, armed=True)


def test_without_end_on_signals_the_same_sigterm_waits_for_the_collective(tmp_path):
    """The control: the Python handler really cannot run, so the test above could fail."""
    assert not _sigterm_blocked_rank(tmp_path, armed=False)

"""Every node must see the run directory rank 0 writes (review F20, test T9): at a training stage's
start rank 0 writes a nonce there and every rank reads it after rank 0's broadcast. Two real gloo
processes given two different run directories (two nodes with node-local disks) both fail with one
line naming the rank that cannot see it; given one directory they pass, and leave nothing behind."""

import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow


def _rank(rank: int, store: str, out: str, dirs: list[str]) -> None:
    from embed_core.errors import user_error
    from embed_core.dist.distributed import check_shared_directory, destroy_process_group, set_stage

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    set_stage("ret")
    try:
        check_shared_directory(Path(dirs[rank]) / "checkpoints", "ret")
        result = "ok"
    except Exception as exc:  # noqa: BLE001 (the outcome is what the test reads)
        result = f"{type(exc).__name__}: {user_error(exc)}"
    Path(out, f"rank{rank}").write_text(result)
    destroy_process_group()


def _run(tmp_path: Path, dirs: list[Path]) -> dict[str, str]:
    out = tmp_path / f"out-{time.monotonic_ns()}"
    out.mkdir()
    mp.start_processes(_rank, args=(str(out / "store"), str(out), [str(d) for d in dirs]), nprocs=2,
                       start_method="spawn")
    return {p.name: p.read_text() for p in sorted(out.glob("rank*"))}


def test_ranks_with_different_run_directories_fail_the_shared_storage_check_with_one_line(tmp_path):
    node0, node1 = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    node1.mkdir(parents=True)  # its own (node-local) directory exists, just not rank 0's
    lines = _run(tmp_path, [node0, node1])
    host = os.uname().nodename
    expected = (f"rank 1 ({host}, in {node1 / 'checkpoints'}) cannot see the file rank 0 ({host}) wrote in {node0 / 'checkpoints'}: the run "
                "directory must be on storage shared by every node (NFS, Lustre, a cluster file system), the same "
                "path on each")
    assert lines == {"rank0": f"LaunchError: training rank 0 of 2, stage ret: {expected}",
                     "rank1": f"LaunchError: training rank 1 of 2, stage ret: {expected}"}


def test_ranks_sharing_the_run_directory_pass_the_check_and_leave_no_file_behind(tmp_path):
    run = tmp_path / "run"
    assert _run(tmp_path, [run, run]) == {"rank0": "ok", "rank1": "ok"}
    assert list((run / "checkpoints").iterdir()) == []

"""The launcher's contract, checked once (``embed_core.dist.world.launch_contract``): a launched
rank's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are parsed and
checked before it touches the run directory, one line each; ranks that cannot meet at the
rendezvous address end with the named error after ``train.dist_timeout_s``, not torch's traceback."""

import subprocess
import sys
import time

import pytest

from embed_core.dist.world import Launch, launch_contract
from embed_core.errors import LaunchError, user_error
from tests.helpers.repo import REPO

LAUNCH = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
          "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
GOOD = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node-0",
        "MASTER_PORT": "29500"}


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)
    for name, value in GOOD.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_a_torchrun_environment_is_read_as_the_ranks_place_and_its_rendezvous_address(env):
    assert launch_contract() == Launch(rank=3, world=4, local_rank=1, local_world=2, master_addr="node-0",
                                       master_port=29500)
    assert launch_contract().address == "node-0:29500"


@pytest.mark.parametrize(("changes", "expected"), [
    ({"MASTER_ADDR": None}, "MASTER_ADDR is unset in a job of WORLD_SIZE=4: its ranks have no address to meet at"),
    ({"MASTER_ADDR": "  "}, "MASTER_ADDR is unset in a job of WORLD_SIZE=4"),
    ({"MASTER_PORT": None}, "MASTER_PORT=unset in a job of WORLD_SIZE=4 is not a port number (1..65535)"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 in a job of WORLD_SIZE=4 is not a port number (1..65535)"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' in this process's environment is not a number"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 is outside this node's 2 processes (LOCAL_WORLD_SIZE=2, ranks 0..1)"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 is outside this node's 2 processes"),
    ({"LOCAL_RANK": "one"}, "LOCAL_RANK='one' in this process's environment is not a number"),
    ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 is outside 1..WORLD_SIZE=4"),
    ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0 is outside 1..WORLD_SIZE=4"),
    ({"RANK": "4"}, "RANK=4 is outside WORLD_SIZE=4 (ranks 0..3)"),
])
def test_each_broken_launcher_variable_is_one_line_naming_it(env, changes, expected):
    for name, value in changes.items():
        if value is None:
            env.delenv(name)
        else:
            env.setenv(name, value)
    with pytest.raises(LaunchError) as caught:
        launch_contract()
    line = user_error(caught.value)
    assert line.startswith(expected), line
    assert "\n" not in line


def test_a_launched_train_rank_without_master_addr_exits_2_with_one_line_before_the_run_directory_exists(tmp_path):
    run_dir = tmp_path / "run"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path), "WORLD_SIZE": "2", "RANK": "1",
           "LOCAL_RANK": "1"}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config",
                           str(REPO / "deployments/configs/demo.yaml"), "--run-dir", str(run_dir)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "embedpipe: error: MASTER_ADDR is unset in a job of WORLD_SIZE=2: its ranks have no address to meet at; "
        "torchrun sets it, else set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port")
    assert not run_dir.exists()


RENDEZVOUS = """
import sys
from embed_core.dist.distributed import init_process_group
from embed_core.errors import user_error
try:
    init_process_group(timeout_s=2)
except Exception as exc:
    print(type(exc).__name__, user_error(exc))
    sys.exit(2)
"""


@pytest.mark.slow
def test_a_rank_left_alone_at_the_rendezvous_ends_with_the_named_error_after_the_timeout(tmp_path):
    """Rank 0 with no other rank coming, and rank 1 of another job with no rank 0 listening."""
    from embed_core.procs import free_port

    results = {}
    for rank in (0, 1):
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "OMP_NUM_THREADS": "1"}
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", RENDEZVOUS], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        results[rank] = (proc, time.monotonic() - t0, env["MASTER_PORT"])
    for rank, waited in ((0, "the other ranks did not all join"), (1, "rank 0 was not reachable at 127.0.0.1:")):
        proc, seconds, port = results[rank]
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = proc.stdout.strip().splitlines()[-1]
        assert line.startswith(f"LaunchError training rank {rank} of 2: the job's ranks did not meet at "
                               f"MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port} within train.dist_timeout_s = 2 s: "
                               f"{waited}"), line
        assert seconds < 60

"""Ranks started by a launcher (torchrun, deepspeed): every rank dies with its launcher."""

import pytest

from tests.helpers.procs import kill_parent_and_check_children


@pytest.mark.parametrize(("rank", "other"), [("0", "False"), ("1", "True")])
def test_a_launched_rank_dies_with_its_sigkilled_launcher(rank, other):
    """The launcher here is a Python process that starts one rank as torchrun does (its own
    session, the launcher's environment: WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""
    kill_parent_and_check_children("""
        import subprocess, sys, time
        rank = subprocess.Popen([sys.executable, "-c", "from flows import launch; import time; "
                                 "print(launch.is_other_rank('train'), flush=True); time.sleep(600)"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        print(rank.pid, flush=True)
        assert rank.stdout.readline().strip() == OTHER
        print("ready", flush=True)
        time.sleep(600)
    """.replace("OTHER", repr(other)), env={"WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": rank,
                                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})


def test_a_command_outside_a_launcher_decides_so_without_importing_torch():
    """``embedpipe prepare`` (and every command) asks whether it was launched before it runs: the
    answer is read from the environment, so a command that never trains never loads torch (2-3
    CPU-seconds of its start)."""
    import os
    import subprocess
    import sys

    from tests.helpers.repo import REPO

    code = ("import sys; from flows import launch; launch.is_other_rank('prepare'); launch.as_launched_rank(); "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

"""Ranks started by a launcher (torchrun, deepspeed): every rank dies with its launcher."""

import pytest

from tests.helpers.procs import kill_parent_and_check_children


@pytest.mark.parametrize(("rank", "other"), [("0", "False"), ("1", "True")])
def test_a_launched_rank_dies_with_its_sigkilled_launcher(rank, other):
    """The launcher here is a Python process that starts one rank as torchrun does (its own
    session, the launcher's environment: WORLD_SIZE, RANK)."""
    kill_parent_and_check_children("""
        import subprocess, sys, time
        rank = subprocess.Popen([sys.executable, "-c", "from flows import launch; import time; "
                                 "print(launch.is_other_rank('train'), flush=True); time.sleep(600)"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        print(rank.pid, flush=True)
        assert rank.stdout.readline().strip() == OTHER
        print("ready", flush=True)
        time.sleep(600)
    """.replace("OTHER", repr(other)), env={"WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": rank})

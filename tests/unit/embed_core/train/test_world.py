"""A process's place in a job, from its launcher's environment (``embed_core.dist.world``): an
environment that cannot be one job is refused with one line, not read as a plain process. Above
all ``srun -n 8 python -m flows.cli train`` (SLURM tasks without torchrun, no ``WORLD_SIZE``): each
task would otherwise train on its own, all of them writing one run directory."""

import subprocess
import sys

import pytest

from embed_core.errors import LaunchError, user_error
from embed_core.dist.world import env_rank, launched
from tests.helpers.repo import REPO

JOB = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID",
       "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


@pytest.fixture
def env(monkeypatch):
    for name in JOB:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _refusal() -> str:
    with pytest.raises(LaunchError) as caught:
        launched()
    line = user_error(caught.value)
    assert line == str(caught.value) and "\n" not in line
    return line


def test_srun_tasks_without_world_size_are_refused_with_one_line_saying_to_launch_with_torchrun(env):
    env.setenv("SLURM_NTASKS", "8")
    env.setenv("SLURM_STEP_NUM_TASKS", "8")
    env.setenv("SLURM_PROCID", "3")
    line = _refusal()
    assert line.startswith("this process is one of 8 tasks that SLURM (srun) started (SLURM_STEP_NUM_TASKS=8), but "
                           "WORLD_SIZE is unset: each task would run the whole command on its own")
    assert "torchrun" in line


@pytest.mark.parametrize("name", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_mpi_ranks_without_world_size_are_refused_too(env, name):
    env.setenv(name, "4")
    assert f"({name}=4)" in _refusal()


def test_a_batch_script_that_runs_the_command_once_in_an_8_task_allocation_is_a_plain_process(env):
    """sbatch sets SLURM_NTASKS (and SLURM_PROCID 0) for the script, which runs once: not refused
    (it may start its own local ranks, or torchrun)."""
    env.setenv("SLURM_NTASKS", "8")
    env.setenv("SLURM_PROCID", "0")
    assert launched() is False and env_rank() == 0


def test_one_srun_task_or_a_torchrun_rank_under_srun_is_not_refused(env):
    env.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert launched() is False
    env.setenv("SLURM_STEP_NUM_TASKS", "2")  # srun --ntasks-per-node=1 torchrun ...: torchrun set the world
    env.setenv("WORLD_SIZE", "16")
    env.setenv("RANK", "9")
    assert launched() is True and env_rank() == 9


@pytest.mark.parametrize(("world", "rank", "expected"), [
    ("abc", None, "WORLD_SIZE='abc' in this process's environment is not a number"),
    ("4", "x", "RANK='x' in this process's environment is not a number"),
    ("4", "4", "RANK=4 is outside WORLD_SIZE=4 (ranks 0..3)"),
    ("4", "-1", "RANK=-1 is outside WORLD_SIZE=4 (ranks 0..3)"),
    ("-2", None, "WORLD_SIZE=-2 in this process's environment: a job has at least one process"),
])
def test_a_world_size_or_rank_that_cannot_be_a_job_is_one_line(env, world, rank, expected):
    env.setenv("WORLD_SIZE", world)
    if rank is not None:
        env.setenv("RANK", rank)
    assert _refusal().startswith(expected)


def test_a_rank_variable_left_in_a_plain_shell_does_not_make_a_plain_process_a_rank(env):
    env.setenv("RANK", "3")
    assert launched() is False and env_rank() == 0


def test_the_cli_under_srun_tasks_prints_the_one_line_and_exits_2_without_importing_torch(tmp_path):
    code = ("import sys; from flows.cli import main; rc = main(['prepare', '--config', 'nope.yaml']); "
            "print('torch' in sys.modules); sys.exit(rc)")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "SLURM_STEP_NUM_TASKS": "4", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "embedpipe: error: this process is one of 4 tasks that SLURM (srun) started")
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("env, local, spans", [
    ({}, 1, False),
    ({"WORLD_SIZE": "8", "RANK": "3"}, 8, False),
    ({"WORLD_SIZE": "16", "RANK": "3", "LOCAL_WORLD_SIZE": "8"}, 8, True),
    ({"WORLD_SIZE": "8", "RANK": "3", "LOCAL_WORLD_SIZE": "8"}, 8, False),
])
def test_a_jobs_ranks_per_node_come_from_local_world_size_else_one_node_holds_them_all(monkeypatch, env, local, spans):
    from embed_core.dist.world import local_world_size, spans_nodes

    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (local_world_size(), spans_nodes()) == (local, spans)


def test_more_local_processes_than_the_machine_has_are_one_line_before_any_starts(monkeypatch):
    import os

    from embed_core.config import parse_config
    from embed_core.errors import ConfigError
    from embed_core.dist.spawn import training_processes

    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    raw = {"prepare": {"sources": [{"name": "x", "kind": "sts", "path": "x"}]},
           "train": {"processes": "2", "stages": [{"name": "s"}]}}
    assert training_processes(parse_config(raw).train) == 2  # a number a form sends as text
    cores = os.cpu_count()
    raw["train"]["processes"] = cores + 1
    with pytest.raises(ConfigError, match=rf"train.processes: {cores + 1} processes, but this machine has {cores} CPU "
                                          r"core") as info:
        training_processes(parse_config(raw).train)
    assert "\n" not in str(info.value)

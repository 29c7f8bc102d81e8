"""The Prefect server a command needs, when it cannot work: a Prefect home (the temporary server's
database) on a full or read-only disk or with a file in the way, and a server that answers an error
while a flow registers. Through the real CLI: one line naming the directory or the server, exit 2,
within seconds (the start-up timeout cannot help and is not waited for). And a server whose answer
to a failed run's last state is lost on the way: the user's error is still the command's one line."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers.cli_run import STS_SOURCE, CliResult, in_process, session_server, write_config, write_sts_data
from tests.helpers.faulty_prefect import faulty_prefect_server
from tests.helpers.lossy_proxy import lossy_proxy
from tests.helpers.repo import REPO


def _cli(tmp_path, config=None, **env) -> tuple[CliResult, float]:
    """``embedpipe prepare`` on ``config`` (a one-pair source by default), as a shell runs it, with
    ``env``; and its seconds."""
    config = config or write_config(write_sts_data(tmp_path), [STS_SOURCE])
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", **env}
    if "PREFECT_API_URL" not in env:
        full_env.pop("PREFECT_API_URL", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "prepare", "--config", str(config)], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=300)
    return CliResult(proc.returncode, proc.stdout, proc.stderr), time.monotonic() - start


def _in_process_with_home(capfd, tmp_path, home) -> tuple[CliResult, float]:
    """``embedpipe prepare`` in this process, with ``home`` as PREFECT_HOME and no PREFECT_API_URL
    (the command starts a temporary server); and its seconds."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    config = write_config(write_sts_data(tmp_path), [STS_SOURCE])
    start = time.monotonic()
    with temporary_settings(updates={PREFECT_HOME: str(home)}, restore_defaults={PREFECT_API_URL}):
        result = in_process(capfd, "prepare", "--config", config)
    return result, time.monotonic() - start


def test_a_prefect_home_under_a_file_is_one_line_naming_it_within_seconds(tmp_path, capfd):
    (tmp_path / "a-file").write_text("not a directory\n")
    for home, said in ((tmp_path / "a-file", "is not a directory"), (tmp_path / "a-file/home", "cannot write there")):
        result, took = _in_process_with_home(capfd, tmp_path, home)
        result.assert_one_line_error(f"{home}: {said}", "PREFECT_HOME")
        assert took < 10, took


@pytest.fixture
def small_disk(tmp_path):
    """Mounts a tmpfs with the given options (root with CAP_SYS_ADMIN; skipped elsewhere)."""
    mounts = []

    def mount(options: str):
        path = tmp_path / f"disk-{len(mounts)}"
        path.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                               capture_output=True).returncode != 0:
            pytest.skip("cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN)")
        mounts.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounts:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_prefect_home_on_a_full_or_read_only_disk_is_one_line_naming_it_within_seconds(tmp_path, capfd, small_disk):
    full = small_disk("size=256k")
    subprocess.run(["dd", "if=/dev/zero", f"of={full / 'fill'}", "bs=4k"], capture_output=True)  # until it is full
    result, took = _in_process_with_home(capfd, tmp_path, full / "prefect")
    result.assert_one_line_error(f"{full / 'prefect'}: no space left (ENOSPC", "PREFECT_HOME")
    assert took < 10, took

    read_only = small_disk("ro,size=1m")
    result, took = _in_process_with_home(capfd, tmp_path, read_only)
    result.assert_one_line_error(f"{read_only}: cannot write there (EROFS", "PREFECT_HOME")
    assert took < 10, took


@pytest.mark.prefect
def test_a_prefect_home_that_fills_up_as_the_server_creates_its_database_is_its_error_at_once(tmp_path, small_disk):
    """The 1 MiB the home is checked for fits; the database's migrations do not: the server exits
    (uvicorn's code 3, which is also its code for a port taken first) and its logged error is the line."""
    disk = small_disk("size=1100k")
    result, took = _cli(tmp_path, PREFECT_HOME=str(disk / "prefect"))
    result.assert_one_line_error("the temporary Prefect server exited with code 3 as it started: ",
                                 "database or disk is full", f"{disk / 'prefect' / 'prefect.db'}")
    assert took < 60, took


def test_a_prefect_server_that_answers_500_while_the_flow_registers_is_one_line_naming_it(tmp_path):
    with faulty_prefect_server() as (api_url, requests):
        result, took = _cli(tmp_path, PREFECT_API_URL=api_url)
    result.assert_one_line_error(f"the Prefect server at {api_url} answered 500 Internal Server Error to POST /flows/")
    assert "Traceback" not in result.out, result.out[-3000:]
    assert "POST /api/flows/" in requests, requests
    assert not (tmp_path / "runs/r/prepare").exists()


def _a_flow_run_failing(request_line: str, body: bytes) -> bool:
    return (request_line.startswith("POST ") and "/flow_runs/" in request_line and "/set_state" in request_line
            and json.loads(body)["state"]["type"] == "FAILED")


@pytest.mark.prefect
def test_a_lost_answer_to_a_failed_runs_last_state_still_ends_the_command_with_the_users_one_line(tmp_path,
                                                                                                 prefect_harness):
    """The server records the Failed state, its answer is lost, Prefect's client sends the state
    again and the server refuses the repeat (its answer: the run's state, without the error in it);
    Prefect then raises its own FailedRun carrying the line as the run's message. Seen in CI, where
    a loaded server answered after the client's 60 s timeout."""
    (tmp_path / "s.parquet").write_bytes(os.urandom(3000))
    config = write_config(tmp_path, [{"name": "sts", "kind": "sts", "path": "s.parquet"}])
    with lossy_proxy(session_server()["PREFECT_API_URL"], _a_flow_run_failing) as (api_url, lost):
        result, _ = _cli(tmp_path, config, PREFECT_API_URL=api_url)
    assert len(lost) == 1, lost  # the fault happened
    result.assert_one_line_error("s.parquet: not a readable Parquet file")

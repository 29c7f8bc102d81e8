"""What the ``embedpipe`` command sets up around a run: environment defaults applied by an
explicit call (never on import, never over the user's values), a busy run directory refused
before anything starts without taking its lock, and a temporary Prefect server that dies with
the command even when the command is SIGKILLed."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.procs import gone
from tests.helpers.repo import REPO


def _python(code: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, **kwargs)


def test_environment_defaults_fill_what_is_missing_and_never_override_the_user():
    from flows.env import DEFAULTS, apply_defaults

    env = {"DO_NOT_TRACK": "0", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "30"}
    assert apply_defaults(env) is env
    assert env["DO_NOT_TRACK"] == "0" and env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == "30"
    assert env["PREFECT_LOGGING_EXTRA_LOGGERS"] == DEFAULTS["PREFECT_LOGGING_EXTRA_LOGGERS"]
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"


def test_importing_the_flows_package_and_the_command_line_changes_no_environment_variable():
    proc = _python("""
        import os
        before = dict(os.environ)
        import flows, flows.cli, flows.console, flows.env, flows.launch, flows.local_server, flows.params
        print([k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)])
    """)
    out, _ = proc.communicate(timeout=120)
    assert out.strip() == "[]", out


def test_a_busy_run_dir_is_refused_by_a_check_that_holds_nothing(tmp_path):
    from embed_core.rundir import RunDirBusy, lock_holder, raise_if_busy, run_dir_lock

    run_dir = tmp_path / "run"
    raise_if_busy(run_dir)  # free: nothing raised, nothing held afterwards
    assert lock_holder(run_dir) is None
    with run_dir_lock(run_dir, "this process"):
        raise_if_busy(run_dir)  # held by this process: a flow here re-enters the lock
    holder = _python(f"""
        import time
        from embed_core.rundir import run_dir_lock
        with run_dir_lock({str(run_dir)!r}, "elsewhere"):
            print("IN", flush=True)
            time.sleep(600)
    """)
    try:
        assert holder.stdout.readline().strip() == "IN"
        with pytest.raises(RunDirBusy, match='another embedpipe run is using this run directory.*"purpose": "elsewhere"'):
            raise_if_busy(run_dir)
    finally:
        holder.kill()
        holder.wait()
    raise_if_busy(run_dir)


@pytest.mark.prefect
def test_the_temporary_prefect_server_answers_for_the_block_and_dies_with_a_sigkilled_command():
    import httpx

    parent = _python("""
        import os, time
        from flows.env import apply_defaults
        apply_defaults()
        from flows.local_server import prefect_api
        from prefect.settings import PREFECT_API_URL
        with prefect_api():
            children = open(f"/proc/self/task/{os.getpid()}/children").read().split()
            print(PREFECT_API_URL.value(), *children, flush=True)
            time.sleep(600)
    """)
    said = parent.stdout.readline()  # first the command's line about its server: kept in no UI
    assert said.startswith("Prefect server: a temporary one, which stops with the command"), said
    api_url, *children = parent.stdout.readline().split()
    assert children, "no server process was started"
    assert httpx.get(f"{api_url}/health", timeout=30).status_code == 200
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert all(gone(int(pid)) for pid in children), f"the server outlived the killed command: {children}"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{api_url}/health", timeout=5)


def test_production_code_never_imports_a_mocking_library():
    import ast

    bad = []
    for root in ("embed_core", "tasks", "flows", "embedpipe_tools", "deployments"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                bad += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                        if n.split(".")[0] == "mock" or n.startswith("unittest")]
    assert not bad, "\n".join(bad)


def test_prefects_console_handler_writes_to_stdout_during_a_command_whatever_stderr_it_was_set_up_with(capsys):
    """Prefect's handler keeps the ``sys.stderr`` of the moment logging was set up (in a test
    session, a capture that was replaced since); the command's run logs still reach its stdout."""
    import io
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    from flows.console import run_logs_on_stdout

    stale = io.StringIO()
    handler = PrefectConsoleHandler(stream=stale)
    logger = logging.getLogger("prefect.embedpipe-test")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    # a library may attach logging's last-resort handler, whose stream cannot be set (it follows sys.stderr)
    other = logging.getLogger("embedpipe-test-last-resort")
    other.addHandler(logging.lastResort)
    try:
        with run_logs_on_stdout(sys.stderr):
            logger.info("Retry 1/1 will start immediately")
        logger.info("after the command")
    finally:
        logger.removeHandler(handler)
        other.removeHandler(logging.lastResort)
    out, err = capsys.readouterr()
    assert "Retry 1/1 will start immediately" in out and err == ""
    assert "after the command" in stale.getvalue() and "Retry" not in stale.getvalue()

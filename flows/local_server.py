"""The Prefect API for one ``embedpipe`` command: the configured server (``PREFECT_API_URL``),
else a temporary local one that dies with the command, even when the command is SIGKILLed.

Prefect's own temporary server (``SubprocessASGIServer``) is stopped by an ``atexit`` hook, which
a SIGKILL skips, so it would outlive a killed command. This is the same server started the same
way — uvicorn serving ``prefect.server.api.server:create_app`` on loopback, UI off, Prefect's
ephemeral-mode flags and the current Prefect settings in its environment (so the same database),
the wait for ``/health`` bounded by ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` — with
one difference: its process asks the kernel for SIGTERM when the command's process dies (Linux
``PR_SET_PDEATHSIG``, kept across ``exec``; :func:`embed_core.procs.dying_with_parent`).
Elsewhere than Linux, Prefect starts its own temporary server.

The death signal follows the thread that started the process: :func:`prefect_api` starts it from
the calling thread, which must live as long as the command (the CLI's main thread).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

from embed_core.errors import EmbedpipeError
from embed_core.procs import free_port

_HOST = "127.0.0.1"
_PORT_TAKEN = 3  # uvicorn's exit code when it cannot bind (another process took the port first)


class TemporaryServerError(EmbedpipeError):
    """The temporary Prefect server did not start."""


@contextmanager
def prefect_api() -> Iterator[None]:
    """The configured Prefect API for the block, else a temporary server that dies with this
    process. Prefect's log and event workers are drained before the temporary server stops.

    The server's URL is this process's setting for the block, in every thread: also in the threads
    Prefect starts without the caller's context (a process pool's log and event forwarder), which
    would otherwise start a temporary server of Prefect's own, one that outlives a SIGKILL. It is
    what Prefect's own test harness does (``_temporary_global_settings_context``)."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value() or not sys.platform.startswith("linux"):
        yield
        return
    server, api_url = _start()
    try:
        with temporary_settings({PREFECT_API_URL: api_url}), \
                _temporary_global_settings_context(get_settings_context()):
            try:
                yield
            finally:
                _drain_prefect_workers()  # the run's last logs and events reach the server before it stops
    finally:
        _stop(server)


def _start() -> tuple[subprocess.Popen, str]:
    """The server process and its API URL, once ``/health`` answers."""
    import httpx
    from prefect.logging import get_logger
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    timeout = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while True:
            port = free_port(_HOST)
            get_logger().info("Starting temporary server on http://%s:%d", _HOST, port)
            server = _spawn(port)
            api_url = f"http://{_HOST}:{port}/api"
            while server.poll() is None and time.monotonic() < deadline:
                try:
                    if client.get(f"{api_url}/health").status_code == 200:
                        return server, api_url
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            if server.poll() != _PORT_TAKEN or time.monotonic() >= deadline:
                break
    code = server.poll()
    _stop(server)
    state = f"it exited with code {code}" if code is not None else f"it did not answer within {timeout:.0f} s"
    raise TemporaryServerError(f"the temporary Prefect server did not start: {state} (raise "
                               "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or set PREFECT_API_URL to a "
                               "running server)")


def _spawn(port: int) -> subprocess.Popen:
    """The server process: uvicorn as Prefect runs it, with the death signal armed
    (``embed_core.procs``). Its output goes to the command's stdout: stderr carries only the
    command's error line."""
    import signal

    import prefect
    from prefect.settings import get_current_settings

    from embed_core.procs import dying_with_parent

    uvicorn = ["-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
               "prefect.server.api.server:create_app", "--host", _HOST, "--port", str(port), "--log-level", "error",
               "--lifespan", "on"]
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           **get_current_settings().to_environment_variables(exclude_unset=True)}
    return subprocess.Popen(dying_with_parent([sys.executable, *uvicorn], signal.SIGTERM), env=env,
                            stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _stop(server: subprocess.Popen) -> None:
    from prefect.logging import get_logger

    get_logger().info("Stopping temporary server")
    server.terminate()
    try:
        server.wait(timeout=5)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _drain_prefect_workers() -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=10)

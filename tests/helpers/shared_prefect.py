"""One Prefect test server for every pytest-xdist worker of a run, instead of one per worker.

The controlling process starts it as the run begins (:func:`start`, from ``pytest_configure``),
without waiting: it starts while the workers start and collect. Its API URL reaches the workers
in ``EMBEDPIPE_TEST_PREFECT_API_URL``; the ``prefect_harness`` fixture of a worker waits for it
(:func:`wait_until_healthy`) and points Prefect at it. A run without workers (``-n 0``) keeps
Prefect's own ``prefect_test_harness``.

What it saves, measured on 2 cores (docs/testing.md): each server costs about 11 CPU-seconds to
start (imports and database migrations) and about 1 CPU-second a minute idle; three workers used
to start three at once, as their first tests waited. The server is what ``prefect_test_harness``
runs (uvicorn with Prefect's app factory, a fresh SQLite database, the UI off); it dies with the
controlling process and is stopped by :func:`stop` (the command line is the CLI's temporary server's,
``flows.local_server.server_process``, on its own Prefect home and database).
Tests that read the server back filter by their own flow run or run directory, so sharing it
changes no assertion."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ENV = "EMBEDPIPE_TEST_PREFECT_API_URL"
LOG_ENV = "EMBEDPIPE_TEST_PREFECT_LOG"
_HOST = "127.0.0.1"


class Shared:
    """The server process and its Prefect home (database and log)."""

    def __init__(self, process: subprocess.Popen, home: Path):
        self.process, self.home = process, home


def selected(markexpr: str, markers: set[str]) -> bool:
    """Whether ``-m markexpr`` can select a test that needs the server, one carrying ``markers``
    (``prefect`` and what ``tests/conftest.py`` adds to it). A worker without the server's URL falls
    back to ``prefect_test_harness``, so a wrong answer costs time, never a test."""
    if not markexpr:
        return True
    from _pytest.mark.expression import Expression

    return Expression.compile(markexpr).evaluate(lambda name, **_: name in markers)


def start() -> Shared:
    """Start the server (not waiting for it) and export its API URL to the workers to come."""
    from embed_core.procs import free_port
    from flows.local_server import server_process

    home = Path(tempfile.mkdtemp(prefix="embedpipe-prefect-shared-"))
    port = free_port(_HOST)
    command, env = server_process(port)
    env.update(PREFECT_HOME=str(home),
               PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect-test.db'}")
    with open(home / "server.log", "wb") as log:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    os.environ[ENV], os.environ[LOG_ENV] = f"http://{_HOST}:{port}/api", str(home / "server.log")
    return Shared(process, home)


def stop(shared: Shared) -> None:
    shared.process.terminate()
    try:
        shared.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        shared.process.kill()
        shared.process.wait()
    shutil.rmtree(shared.home, ignore_errors=True)
    os.environ.pop(ENV, None)
    os.environ.pop(LOG_ENV, None)


def wait_until_healthy(api_url: str, timeout_s: float = 180.0) -> None:
    """Return once ``/health`` answers; fail with the reason and the server's last log lines after
    ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last: object = "no answer"
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(f"{api_url}/health", timeout=5)
            if answer.status_code == 200:
                return
            last = f"HTTP {answer.status_code}"
        except httpx.TransportError as exc:
            last = exc
        time.sleep(0.2)
    log = Path(os.environ.get(LOG_ENV, "/nonexistent"))
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.is_file() else ["(no log)"]
    raise RuntimeError(f"the shared Prefect test server at {api_url} did not answer /health within {timeout_s:.0f} s "
                       f"(last: {last}); the end of its log {log}:\n" + "\n".join(tail))

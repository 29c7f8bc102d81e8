"""The Prefect API for one ``embedpipe`` command: the configured server (``PREFECT_API_URL``),
else the server of ``make serve``'s stack when its state file names one that answers (the run
shows in that UI), else a temporary local one that dies with the command, even when the command
is SIGKILLed. Each of the last two is one line in the command's output: the stack's UI, or that
the run is kept in no UI and how to have one (``make serve``); a state file whose server does not
answer is said too. Prefect's ``View at <url>`` line is never printed for the temporary server
(it has no UI and is gone when the command ends): its UI URL is unset for the command.

The stack's state file is ``stack.json`` in its home (``deployments/local.py serve --home``,
default ``.prefect-local/`` of this checkout; ``EMBEDPIPE_STACK_HOME`` names another).

Prefect's own temporary server (``SubprocessASGIServer``) is stopped by an ``atexit`` hook, which
a SIGKILL skips, so it would outlive a killed command. This is the same server started the same
way — uvicorn serving ``prefect.server.api.server:create_app`` on loopback, UI off, Prefect's
ephemeral-mode flags and the current Prefect settings in its environment (so the same database),
the wait for ``/health`` bounded by ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` — with
one difference: its process asks the kernel for SIGTERM when the command's process dies (Linux
``PR_SET_PDEATHSIG``, kept across ``exec``; :func:`embed_core.procs.dying_with_parent`).
Elsewhere than Linux, Prefect starts its own temporary server. It also runs in a session of its
own: a Ctrl-C to the terminal's process group reaches the command alone, which reports its run to
the server and then stops it (``flows.interrupts``).

What cannot work is one line, at once: a Prefect home (the database's directory) that is full,
read-only or not a directory, before the server starts; a server that exits while it starts, with
the error it logged (not a wait for the start-up timeout, which cannot help); and an error of the
Prefect API, from this server or the configured one (:func:`prefect_api_error`, exit 2).

The death signal follows the thread that started the process: :func:`prefect_api` starts it from
the calling thread, which must live as long as the command (the CLI's main thread).
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from embed_core.errors import DISK_FULL_ERRNOS, EmbedpipeError, printable, exception_chain, register_user_error
from embed_core.procs import free_port

_HOST = "127.0.0.1"
_STARTUP_FAILED = 3  # uvicorn's exit code for a failed start-up: its port taken by another process first, or the app's
_PROBE_BYTES = 1 << 20  # what the database's directory must take before the server starts (a fresh database: ~1 MB)
STACK_HOME_ENV = "EMBEDPIPE_STACK_HOME"  # the home of `make serve`'s stack, when not .prefect-local/ of this checkout
STACK_STATE = "stack.json"  # in the stack's home: its UI and API URLs, while it runs
_STACK_HEALTH_TIMEOUT_S = 3.0
NO_UI_LINE = ("a temporary one, which stops with the command: this run is kept in no UI (`make serve` starts the "
              "stack whose UI at http://127.0.0.1:4200 shows the command's runs)")


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
    from prefect.settings import PREFECT_API_URL

    register_user_error(prefect_api_error)
    if PREFECT_API_URL.value():
        yield
        return
    stack = running_stack()
    if stack is not None:
        _say(f"Prefect server: the one of `make serve` ({stack['state']}); this run shows in its UI at {stack['ui']}")
        with _api_for_every_thread(stack["api"]), _files_links(stack):
            yield
        return
    _say(f"Prefect server: {NO_UI_LINE}")
    if not sys.platform.startswith("linux"):  # Prefect's own temporary server, which has no UI URL either
        yield
        return
    server, api_url = _start()
    try:
        with _api_for_every_thread(api_url, ui_url=""):
            yield
    finally:
        _stop(server)


@contextmanager
def _api_for_every_thread(api_url: str, ui_url: str | None = None) -> Iterator[None]:
    """``api_url`` (and ``ui_url``, when given: "" for none) as the Prefect settings of every thread
    for the block; Prefect's log and event workers are drained at its end, so the run's last logs and
    events reach the server."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    updates = {PREFECT_API_URL: api_url} if ui_url is None else {PREFECT_API_URL: api_url, PREFECT_UI_URL: ui_url}
    with temporary_settings(updates), _temporary_global_settings_context(get_settings_context()):
        try:
            yield
        finally:
            _drain_prefect_workers()


@contextmanager
def _files_links(stack: dict[str, str]) -> Iterator[None]:
    """The stack's file server for the block's artifact links (``tasks.common``), as its workers
    have it, unless this process names one itself."""
    names = {"EMBEDPIPE_FILES_URL": stack.get("files"), "EMBEDPIPE_FILES_ROOT": stack.get("files_root")}
    added = [name for name, value in names.items() if value and name not in os.environ]
    if len(added) < 2:  # a URL without its root (or the reverse) makes no link
        added = []
    for name in added:
        os.environ[name] = str(names[name])
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def stack_state_file() -> Path:
    """The state file of ``make serve``'s stack (which need not exist)."""
    home = os.environ.get(STACK_HOME_ENV)
    return (Path(home) if home else Path(__file__).resolve().parents[1] / ".prefect-local") / STACK_STATE


def running_stack() -> dict[str, str] | None:
    """``{"api", "ui", "state", "files", "files_root"}`` of ``make serve``'s stack when its state file names a server
    whose ``/health`` answers; None without a state file. A state file that cannot be read, or
    whose server does not answer, is one line in the log (and None): the command goes on with a
    temporary server."""
    import httpx

    path = stack_state_file()
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        api, ui = str(state["api"]), str(state["ui"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _say(f"{path}: not a state file of `make serve` ({printable(str(exc) or type(exc).__name__, 200)}); "
             "it is not used")
        return None
    try:
        healthy = httpx.get(f"{api}/health", timeout=_STACK_HEALTH_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        healthy = False
    if not healthy:
        _say(f"{path} names a Prefect server at {api} that does not answer (a stack that ended without `make stop`); "
             "it is not used")
        return None
    return {"api": api, "ui": ui, "state": str(path), "files": state.get("files"), "files_root": state.get("files_root")}


def prefect_api_error(exc: BaseException) -> str | None:
    """One line for a request of Prefect's client (its User-Agent) that failed, ``exc`` or an error
    it arose from (Prefect wraps some): an error status, or no answer. It names the server's API
    URL, the request and the status; a bug of ours, or another server's error, is not one of these."""
    import httpx

    for item in exception_chain(exc):
        if not isinstance(item, (httpx.HTTPStatusError, httpx.TransportError)):
            continue
        try:
            request = item.request
        except RuntimeError:  # an httpx error raised without its request
            continue
        if not request.headers.get("user-agent", "").startswith("prefect/"):
            continue
        url = str(request.url)
        api = url[:url.index("/api/") + 4] if "/api/" in url else f"{request.url.scheme}://{request.url.netloc}"
        path = request.url.path.removeprefix(httpx.URL(api).path)
        if isinstance(item, httpx.HTTPStatusError):
            what = f"answered {item.response.status_code} {item.response.reason_phrase} to {request.method} {path}"
        else:
            what = f"did not answer {request.method} {path} ({type(item).__name__}: {item or 'no reason given'})"
        return (f"the Prefect server at {api} {what}; its own log says why (PREFECT_API_URL names "
                "the server; without it the command starts a temporary one)")
    return None


def _start() -> tuple[subprocess.Popen, str]:
    """The server process and its API URL, once ``/health`` answers. A Prefect home that cannot
    hold the database is one line before anything starts; a server that exits is one line with the
    error it logged, at once (a port another process took first is tried again with another)."""
    import httpx
    from prefect.logging import get_logger
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    database = _check_database_dirs()
    timeout = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while True:
            port = free_port(_HOST)
            get_logger().info("Starting temporary server on http://%s:%d", _HOST, port)
            server, log = _spawn(port)
            api_url = f"http://{_HOST}:{port}/api"
            try:
                while server.poll() is None and time.monotonic() < deadline:
                    try:
                        if client.get(f"{api_url}/health").status_code == 200:
                            log.echo()
                            return server, api_url
                    except httpx.TransportError:
                        pass
                    time.sleep(0.1)
            except BaseException:  # an interrupt while it starts: it is stopped before the command goes on
                _stop(server)
                raise
            if server.poll() is not None:
                log.join(timeout=5)  # its last lines
            if not (server.poll() == _STARTUP_FAILED and log.says("address already in use")) \
                    or time.monotonic() >= deadline:
                break
    code = server.poll()
    _stop(server)
    if code is None:
        raise TemporaryServerError(f"the temporary Prefect server did not answer within {timeout:.0f} s (raise "
                                   "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or set PREFECT_API_URL to a "
                                   "running server)")
    raise TemporaryServerError(f"the temporary Prefect server exited with code {code} as it started: "
                               f"{log.error_line() or 'it logged no error'} (its database: {database}; set PREFECT_HOME "
                               "to a writable directory with space, or PREFECT_API_URL to a running server)")


def _check_database_dirs() -> str:
    """The server's database (its URL's path for SQLite). Its directory and the Prefect home must
    be directories (or be creatable) that take a write of :data:`_PROBE_BYTES`, else one line naming
    the directory (a full disk, a read-only one, a file in the way)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.server.database.connection_url
    url = url.get_secret_value() if url is not None else ""
    dirs = [Path(settings.home).expanduser()]
    database = "the configured database"
    if url.startswith("sqlite") and ":///" in url:
        database = url.split(":///", 1)[1].split("?", 1)[0]
        if database and database != ":memory:":
            dirs.append(Path(database).expanduser().parent)
    for directory in dict.fromkeys(dirs):
        _probe(directory)
    return database


def _probe(directory: Path) -> None:
    advice = ("the temporary Prefect server keeps its database there (PREFECT_HOME): set PREFECT_HOME to a writable "
              "directory with space, or PREFECT_API_URL to a running server")
    if directory.exists() and not directory.is_dir():
        raise TemporaryServerError(f"{directory}: is not a directory; {advice}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=directory, prefix=".embedpipe-space-probe-")
        try:
            with os.fdopen(fd, "wb") as probe:
                probe.write(bytes(_PROBE_BYTES))
                probe.flush()
                os.fsync(probe.fileno())
        finally:
            os.unlink(name)
    except OSError as exc:
        what = "no space left" if exc.errno in DISK_FULL_ERRNOS else "cannot write there"
        code = errno.errorcode.get(exc.errno or 0, exc.errno)
        raise TemporaryServerError(f"{directory}: {what} ({code}: {exc.strerror or exc}); {advice}") from None


class _Log(threading.Thread):
    """The server's output, its last lines kept. Once it has started (:meth:`echo`) its output goes
    to the command's stdout as it comes; a server that fails to start is the command's one error
    line, its traceback is not printed."""

    def __init__(self, stream):
        super().__init__(daemon=True, name="temporary-server-log")
        self.stream = stream
        self.tail: deque[str] = deque(maxlen=200)
        self._lock = threading.Lock()
        self._echo = False

    def run(self) -> None:
        for line in self.stream:
            with self._lock:
                self.tail.append(line.decode(errors="replace").rstrip())
                if self._echo:
                    _write_stdout(line)

    def echo(self) -> None:
        """From now on (and what it said while starting), its output goes to the command's stdout."""
        with self._lock:
            self._echo = True
            _write_stdout("".join(f"{line}\n" for line in self.tail).encode())

    def says(self, text: str) -> bool:
        return any(text in line.lower() for line in self.tail)

    def error_line(self) -> str | None:
        """The last exception it logged (``module.Error: message``), else its last line."""
        lines = [line.strip() for line in self.tail if line.strip()]
        errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
        return printable((errors or lines or [None])[-1], 300) if lines else None


def _say(line: str) -> None:
    """One line of the command's output (stdout), before Prefect's logging is set up."""
    print(line, flush=True)


def _write_stdout(data: bytes) -> None:
    try:
        os.write(1, data)
    except OSError:
        pass


def server_process(port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a temporary server on ``port``: uvicorn with Prefect's
    app factory as Prefect's own ``SubprocessASGIServer`` runs it (UI off, this process's settings),
    with the death signal armed (``embed_core.procs``): it gets SIGTERM when the calling thread ends."""
    import signal

    import prefect
    from prefect.settings import get_current_settings

    from embed_core.procs import dying_with_parent

    uvicorn = ["-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
               "prefect.server.api.server:create_app", "--host", _HOST, "--port", str(port), "--log-level", "error",
               "--lifespan", "on"]
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           **get_current_settings().to_environment_variables(exclude_unset=True)}
    return dying_with_parent([sys.executable, *uvicorn], signal.SIGTERM), env


def _spawn(port: int) -> tuple[subprocess.Popen, _Log]:
    """The server process (:func:`server_process`) in a session of its own: a signal to the
    terminal's process group (Ctrl-C) reaches the command, which stops the server after its last
    report; the server never dies under it. Once it has started, its output goes to the command's
    stdout (stderr carries only the command's error line), through :class:`_Log`."""
    command, env = server_process(port)
    server = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)
    log = _Log(server.stdout)
    log.start()
    return server, log


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

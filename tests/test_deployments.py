"""The deployments as users run them: a real Prefect server on loopback, a process worker per
pool, `prefect deploy` from deployments/prefect.yaml (through deployments/local.py, what
`make serve` runs), and the pipeline deployment triggered through the API with parameters."""

import asyncio
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, add_tiny_stages

pytestmark = pytest.mark.prefect


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_pipeline_deployment_triggered_through_the_api(tmp_path, demo_copy):
    import json

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    add_tiny_stages(demo_copy, tmp_path, evaluate=False)
    home, port = tmp_path / "prefect-home", _free_port()
    serve = subprocess.run([sys.executable, "deployments/local.py", "serve", "--home", str(home), "--port", str(port),
                            "--poll-seconds", "1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    pids = json.loads((home / "pids.json").read_text()) if (home / "pids.json").exists() else {}
    try:
        assert serve.returncode == 0, serve.stdout[-3000:] + serve.stderr[-3000:]
        assert f"Prefect UI: http://127.0.0.1:{port}" in serve.stdout
        assert set(pids) == {"server", "worker-cpu", "worker-gpu"}
        with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
            async def inspect_deployments():
                async with get_client() as client:
                    deps = {f"{(await client.read_flow(d.flow_id)).name}/{d.name}": d
                            for d in await client.read_deployments()}
                    watch = deps["data-watch/embedpipe-data-watch"]
                    await client.pause_deployment(watch.id)  # its nightly cron must not fire mid-test
                    automations = await client.read_automations_by_name("embedpipe-pipeline-on-change__automation_1")
                    return deps, watch, automations

            deps, watch, automations = asyncio.run(inspect_deployments())
            assert set(deps) == {"pipeline/embedpipe-pipeline", "prepare/embedpipe-prepare", "mine/embedpipe-mine",
                                 "synthesize/embedpipe-synthesize",
                                 "train/embedpipe-train", "evaluate/embedpipe-evaluate",
                                 "data-watch/embedpipe-data-watch", "pipeline/embedpipe-pipeline-on-change"}
            assert deps["train/embedpipe-train"].work_pool_name == "gpu"
            assert deps["pipeline/embedpipe-pipeline"].work_pool_name == "cpu"
            assert [s.schedule.cron for s in watch.schedules] == ["0 3 * * *"]
            assert len(automations) == 1 and not automations[0].enabled
            # typed parameters: the UI renders a form from this schema (inline config included)
            schema = deps["pipeline/embedpipe-pipeline"].parameter_openapi_schema
            assert {"config_path", "run_dir", "config", "run_name", "stages"} <= set(schema["properties"])
            assert "RunConfig" in schema["definitions"]

            flow_run = run_deployment("pipeline/embedpipe-pipeline", timeout=600,
                                      parameters={"config_path": str(demo_copy), "run_name": "from-api"})
            assert flow_run.state.is_completed(), flow_run.state

            async def artifacts():
                async with get_client() as client:
                    return await client.read_artifacts(
                        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))

            arts = asyncio.run(artifacts())
    finally:
        stopped = subprocess.run([sys.executable, "deployments/local.py", "stop", "--home", str(home)],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not any(_alive(pid) for pid in pids.values())

    run_dir = tmp_path / "runs" / "from-api"  # run_name parameter reached the flow
    assert (run_dir / "train-stage2" / "model" / "embedpipe.json").exists()
    by_key = {a.key: a for a in arts if a.key}
    table = by_key["pipeline-stages-from-api"]
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [(r["stage"], r["result"]) for r in rows] == [
        ("prepare", "computed"), ("mine", "computed"), ("train-stage1", "computed"), ("train-stage2", "computed")]
    stage_pages = [a for a in arts if a.type == "markdown" and a.description and a.description.endswith("(computed)")]
    assert len(stage_pages) == 4  # one outputs page per stage, with file links
    assert any(f"{(run_dir / 'mine').resolve().as_uri()}/scifact.parquet" in a.data for a in stage_pages)
    assert "prepare-counts-from-api" in by_key and "mine-stats-from-api" in by_key
    # plots are inlined, so they show on the artifact page (train loss curves, mine histogram)
    assert sum("data:image/png;base64," in (a.data or "") for a in arts if a.type == "markdown") >= 3

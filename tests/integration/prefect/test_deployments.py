"""The deployments as users run them: a real Prefect server on loopback, a process worker per
pool, `prefect deploy` from deployments/prefect.yaml (through deployments/local.py, what
`make serve` runs), and the pipeline deployment triggered through the API with parameters."""

import asyncio
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import yaml

from tests.helpers.repo import REPO, add_tiny_stages

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
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment

    from embed_core.config import load_config
    from embed_core.errors import ConfigError
    from prefect.settings import PREFECT_API_URL, temporary_settings

    add_tiny_stages(demo_copy, tmp_path, evaluate=True)
    cfg = yaml.safe_load(demo_copy.read_text())
    cfg["train"]["work_pool"] = "gpu"  # training goes to the gpu pool's worker; the rest stays on cpu
    cfg["train"]["processes"] = 2  # two devices' worth of ranks (auto on a worker with two GPUs; gloo here)
    demo_copy.write_text(yaml.safe_dump(cfg))
    home, port = tmp_path / "prefect-home", _free_port()
    files_port = _free_port()
    serve = subprocess.run([sys.executable, "deployments/local.py", "serve", "--home", str(home), "--port", str(port),
                            "--poll-seconds", "1", "--files-root", str(tmp_path / "runs"), "--files-port", str(files_port)],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
    pids = json.loads((home / "pids.json").read_text()) if (home / "pids.json").exists() else {}
    try:
        assert serve.returncode == 0, serve.stdout[-3000:] + serve.stderr[-3000:]
        assert f"Prefect UI: http://127.0.0.1:{port}" in serve.stdout
        assert set(pids) == {"server", "worker-cpu", "worker-gpu", "files"}
        assert "schedule of data-watch/embedpipe-data-watch: cron 0 3 * * * (UTC) ACTIVE; pause it" in serve.stdout
        # a command run from a shell while the stack is up (no PREFECT_API_URL) runs on its server
        cli_env = {**os.environ, "PYTHONPATH": str(REPO), "EMBEDPIPE_STACK_HOME": str(home)}
        cli_env.pop("PREFECT_API_URL", None)
        cli = subprocess.run([sys.executable, "-m", "flows.cli", "prepare", "--config", str(demo_copy),
                              "--run-name", "from-cli"], cwd=REPO, env=cli_env, capture_output=True, text=True,
                             timeout=300)
        assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
        assert f"this run shows in its UI at http://127.0.0.1:{port}" in cli.stdout, cli.stdout[-3000:]
        assert set(re.findall(r"View at (http://[\d.:]+)/", cli.stdout)) == {f"http://127.0.0.1:{port}"}, cli.stdout
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
            # typed parameters: the UI renders a form from this schema (the inline config is a partial one)
            schema = deps["pipeline/embedpipe-pipeline"].parameter_openapi_schema
            assert {"config_path", "run_dir", "config", "run_name", "stages", "force", "corpus_path"} <= set(schema["properties"])
            assert "merged over config_path" in schema["properties"]["config"]["description"]
            # an internal parameter (a pipeline's lock, handed to its child run on another pool) is not in the forms
            assert not [name for name, d in deps.items() if "parent_lock" in d.parameter_openapi_schema["properties"]]
            assert "options" in deps["train/embedpipe-train"].parameter_openapi_schema["properties"]

            flow_run = run_deployment("pipeline/embedpipe-pipeline", timeout=600,
                                      parameters={"config_path": str(demo_copy), "run_name": "from-api"})
            assert flow_run.state.is_completed(), _why(flow_run)
            # rerun under a name typed for it: the name stays, and no stage is stale, so nothing goes to the gpu pool
            rerun = run_deployment("pipeline/embedpipe-pipeline", timeout=600, flow_run_name="rerun typed by hand",
                                   parameters={"config_path": str(demo_copy), "run_name": "from-api"})
            assert rerun.state.is_completed() and rerun.name == "rerun typed by hand", _why(rerun)
            # a misspelt key, run by a worker: one ERROR line (the CLI's), no traceback, the run named after the run
            broken = tmp_path / "broken.yaml"
            typo = yaml.safe_load(demo_copy.read_text())
            typo["run_name"], stage2 = "typo-run", typo["train"]["stages"][1]
            stage2["setps"] = stage2.pop("steps")
            broken.write_text(yaml.safe_dump(typo))
            with pytest.raises(ConfigError) as cli_error:
                load_config(broken)
            failed = run_deployment("pipeline/embedpipe-pipeline", timeout=600, parameters={"config_path": str(broken)})

            async def artifacts_and_runs():
                async with get_client() as client:
                    arts = await client.read_artifacts(
                        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
                    runs = await client.read_flow_runs()
                    flows = {r.flow_id: (await client.read_flow(r.flow_id)).name for r in runs}
                    logs = {}
                    for run in (flow_run, rerun, failed):
                        logs[run.id] = await _run_logs(client, run.id)
                    # a run's state is set before its process has shipped its last log lines (batched every
                    # few seconds): on a loaded machine the failed run's ERROR line can arrive after it
                    deadline = time.monotonic() + 60
                    while not any(log.level >= 40 for log in logs[failed.id]) and time.monotonic() < deadline:
                        await asyncio.sleep(2)
                        logs[failed.id] = await _run_logs(client, failed.id)
                    return arts, [(flows[r.flow_id], r) for r in runs], logs

            arts, runs, logs = asyncio.run(artifacts_and_runs())
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{files_port}/from-api/mine/scifact.parquet", timeout=30) as r:
                scifact_bytes = r.read()  # fetched while the stack runs

            # three change events for one run directory within a minute start one pipeline run
            from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

            on_change = deps["pipeline/embedpipe-pipeline-on-change"]

            async def enable_trigger():
                async with get_client() as client:
                    await client.resume_automation(automations[0].id)

            asyncio.run(enable_trigger())
            time.sleep(3)  # the trigger service picks up the enabled automation
            watched = str((tmp_path / "runs" / "watched").resolve())
            # sent from another process: an events worker of this test process would stay bound to
            # this stack's server after it stops, and later tests' events would go nowhere
            sender = (
                "import asyncio, sys\n"
                "from prefect.events import Event\n"
                "from prefect.events.clients import get_events_client\n"
                "async def main():\n"
                "    async with get_events_client() as client:\n"
                "        for source in ('stsb', 'scifact', 'banking77'):\n"
                "            await client.emit(Event(event='embedpipe.source.changed', resource={\n"
                "                'prefect.resource.id': f'embedpipe.source.watched.{source}',\n"
                "                'embedpipe.run-dir': sys.argv[1]},\n"
                "                payload={'source': source, 'config_path': sys.argv[2], 'run_dir': sys.argv[1]}))\n"
                "asyncio.run(main())\n")

            sent = subprocess.run([sys.executable, "-c", sender, watched, str(demo_copy)], capture_output=True, text=True,
                                  env={**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}, timeout=120)
            assert sent.returncode == 0, sent.stderr[-2000:]

            async def triggered_runs():
                async with get_client() as client:
                    return await client.read_flow_runs(
                        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[on_change.id])))

            started, deadline = [], time.monotonic() + 90
            while time.monotonic() < deadline and not started:
                time.sleep(2)
                started = asyncio.run(triggered_runs())
            time.sleep(20)  # long enough for any duplicate to have appeared
            started = asyncio.run(triggered_runs())
            assert len(started) == 1, [r.name for r in started]
            assert started[0].parameters["run_dir"] == watched
    finally:
        stopped = subprocess.run([sys.executable, "deployments/local.py", "stop", "--home", str(home)],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not any(_alive(pid) for pid in pids.values())
    assert sorted(p.name for p in home.glob("*.json")) == []  # no state names the stack that is gone
    from_cli = [r for name, r in runs if name == "prepare" and r.name == "from-cli"]
    assert len(from_cli) == 1 and from_cli[0].state.is_completed() and from_cli[0].deployment_id is None

    run_dir = tmp_path / "runs" / "from-api"  # run_name parameter reached the flow
    assert (run_dir / "train-stage2" / "model" / "embedpipe.json").exists()
    assert flow_run.name == "from-api"  # the flow-run name is the run name
    # training ran as a child flow run of the train deployment on the gpu pool; the rest on cpu
    train_runs = [r for name, r in runs if name == "train"]  # one: the fresh rerun sent nothing to the gpu pool
    assert len(train_runs) == 1 and train_runs[0].work_pool_name == "gpu" and train_runs[0].state.is_completed()
    assert train_runs[0].parent_task_run_id is not None and train_runs[0].name == "from-api"
    assert flow_run.work_pool_name == "cpu"
    # the pipeline's page follows the hand-off: the child run's name and link, its progress, its end
    said = [log.message for log in logs[flow_run.id]]
    assert any(m.startswith("train: sent to work pool gpu as flow run from-api (http://127.0.0.1:") for m in said), \
        [m for m in said if "train" in m]
    assert any(m.startswith("[from-api] ") for m in said) and any(m.endswith("on work pool gpu completed") for m in said)
    assert any("every training stage is fresh: nothing to send to work pool gpu" in log.message
               for log in logs[rerun.id])
    failed_logs = logs[failed.id]
    assert failed.state.is_failed() and failed.state.message == str(cli_error.value)
    assert [log.message for log in failed_logs if log.level >= 40] == [str(cli_error.value)]
    assert not any("Traceback" in log.message for log in failed_logs)
    assert [r.name for _, r in runs if r.id == failed.id] == ["typo-run"]
    # that one flow run trained with two ranks: it started rank 1 itself and committed as rank 0
    assert [json.loads((run_dir / f"train-{s}" / "manifest.json").read_text())["processes"]
            for s in ("stage1", "stage2")] == [2, 2]
    # evaluate read the models the gpu pool wrote into the shared run directory
    evaluated = {m["label"]: m["path"] for m in json.loads((run_dir / "evaluate" / "manifest.json").read_text())["models"]}
    assert evaluated["stage2"] == str(run_dir / "train-stage2" / "model")
    by_key = {a.key: a for a in arts if a.key}
    table = by_key["pipeline-stages-from-api"]
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [(r["stage"], r["result"], r["work_pool"]) for r in rows] == [
        ("prepare", "computed", "this run's"), ("mine", "computed", "this run's"), ("train-stage1", "computed", "gpu"),
        ("train-stage2", "computed", "gpu"), ("evaluate", "computed", "this run's"), ("gate", "computed", "this run's")]
    stage_pages = [a for a in arts if a.type == "markdown" and a.description and a.description.endswith("(computed)")]
    assert len(stage_pages) == 4  # one outputs page per stage run here, with file links (training's: its own run)
    # every artifact is keyed by stage and run (the Artifacts page lists it; the run page titles it)
    assert {a.key for a in arts} == {"prepare-outputs-from-api", "prepare-counts-from-api", "mine-outputs-from-api",
                                     "mine-stats-from-api", "evaluate-report-from-api", "evaluate-scores-from-api",
                                     "release-gate-from-api", "pipeline-stages-from-api"}  # a first release: no table
    scores = by_key["evaluate-scores-from-api"]
    scores = json.loads(scores.data) if isinstance(scores.data, str) else scores.data
    main = json.loads((run_dir / "evaluate" / "manifest.json").read_text())["counts"]["main_scores"]
    assert {(r["task"], r["model"], r["metric"]): r["score ×100"] for r in scores} == {
        (r["task"], r["model"], r["metric"]): round(100 * r["value"], 2) for r in main}
    # the file links open in a browser: http on loopback (make serve serves the run directories)
    link = f"http://127.0.0.1:{files_port}/from-api/mine/scifact.parquet"
    assert any(f"]({link})" in a.data for a in stage_pages)
    assert scifact_bytes == (run_dir / "mine" / "scifact.parquet").read_bytes()
    assert "prepare-counts-from-api" in by_key and "mine-stats-from-api" in by_key
    # plots are inlined, so they show on the artifact page (mine histogram, evaluation report)
    assert sum("data:image/png;base64," in (a.data or "") for a in arts if a.type == "markdown") >= 2


async def _run_logs(client, run_id) -> list:
    """Every log line of a flow run, in pages (the server returns 200 at most)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    logs: list = []
    while page := await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), offset=len(logs)):
        logs += page
    return logs


def _why(run) -> str:
    """A run's state and its error log lines with their tracebacks (a failed assertion's message:
    the state alone cuts the exception to one line and drops where it was raised)."""
    from prefect import get_client

    async def read():
        async with get_client() as client:
            await asyncio.sleep(5)  # the run's process ships its last log lines in batches
            return await _run_logs(client, run.id)

    return "\n".join([str(run.state), *(log.message for log in asyncio.run(read()) if log.level >= 40)])

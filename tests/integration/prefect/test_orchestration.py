"""Orchestration as users run it: the run-dir lock, status, single-stage reruns that leave
downstream stages out of date, and the scheduled data-change watch (real Prefect test server)."""

import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from tests.helpers.repo import REPO, add_tiny_stages

pytestmark = pytest.mark.prefect


def _cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """The command line as its own process, on the session's Prefect server (a temporary server of
    its own is tested in tests/unit/flows/test_cli_plumbing.py)."""
    import os

    from tests.helpers.cli_run import session_server

    env = dict(os.environ, **session_server(), **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=600)


def test_lock_is_reentrant_in_process_and_refuses_another_process(tmp_path):
    from embed_core.rundir import RunDirBusy, run_dir_lock

    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir, "outer"):
        with run_dir_lock(run_dir, "inner"):  # a flow calling another flow on the same run dir
            pass
        holder = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from embed_core.rundir import run_dir_lock, RunDirBusy
            try:
                with run_dir_lock({str(run_dir)!r}, "second"):
                    print("ACQUIRED")
            except RunDirBusy as exc:
                print("BUSY", exc)
        """)], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert holder.stdout.startswith("BUSY"), holder.stdout + holder.stderr
        assert '"purpose": "outer"' in holder.stdout  # the message names the holder
    # released: the next run gets it
    with run_dir_lock(run_dir, "after"):
        pass
    # a holder killed with SIGKILL leaves no stale lock (flock dies with its process)
    proc = subprocess.Popen([sys.executable, "-c", f"from embed_core.rundir import run_dir_lock\nimport time\n"
                             f"with run_dir_lock({str(run_dir)!r}, 'doomed'):\n    print('IN', flush=True)\n    time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "IN"
    from embed_core.rundir import lock_holder

    assert '"purpose": "doomed"' in lock_holder(run_dir)  # what `embedpipe status` shows
    with pytest.raises(RunDirBusy):
        with run_dir_lock(run_dir, "while-held"):
            pass
    proc.kill()
    proc.wait()
    assert lock_holder(run_dir) is None
    with run_dir_lock(run_dir, "after-kill"):
        pass


def test_cli_refuses_a_second_run_on_a_busy_run_dir(prefect_harness, tmp_path, demo_copy):
    """Two runs on one run dir: the second exits 2 with a clear message, the first's files untouched."""
    run_dir = tmp_path / "busy-run"
    first = _cli("prepare", "--config", str(demo_copy), "--run-dir", str(run_dir))
    assert first.returncode == 0, first.stderr[-2000:]
    manifest_before = (run_dir / "prepare/manifest.json").read_bytes()
    holder = subprocess.Popen([sys.executable, "-c", f"from embed_core.rundir import run_dir_lock\nimport time\n"
                               f"with run_dir_lock({str(run_dir)!r}, 'pipeline'):\n    print('IN', flush=True)\n"
                               f"    time.sleep(600)"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "IN"
        second = _cli("prepare", "--run-dir", str(run_dir), "--force")
        assert second.returncode == 2
        assert "another embedpipe run is using this run directory" in second.stderr and str(run_dir) in second.stderr
        assert second.stderr.strip().count("\n") == 0
    finally:
        holder.kill()
        holder.wait()
    assert (run_dir / "prepare/manifest.json").read_bytes() == manifest_before


def test_stage_rerun_from_run_dir_marks_only_downstream_out_of_date(prefect_harness, demo_copy, tmp_path):
    from embed_core.runs.status import run_status
    from flows.pipeline import pipeline_flow

    add_tiny_stages(demo_copy, tmp_path, evaluate=False)
    run_dir = tmp_path / "runs" / "demo"
    first = pipeline_flow(config_path=str(demo_copy))
    assert not any(r["cached"] for r in first.values())
    cfg_snapshot = run_dir / "config.yaml"
    assert cfg_snapshot.exists()
    states = {r.stage: r.state for r in run_status(yaml_config(cfg_snapshot), run_dir)}
    assert states == {"prepare": "fresh", "mine": "fresh", "train-stage1": "fresh", "train-stage2": "fresh"}

    # The user changes the mine settings and reruns that one stage from the run dir.
    raw = yaml.safe_load(cfg_snapshot.read_text())
    raw["mine"]["num_negatives"] = 2
    raw["mine"]["range_min"] = 3
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(raw))
    # the real command line (a subprocess: Prefect's console logging must not bind pytest's capture)
    proc = _cli("mine", "--config", str(changed), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mine (computed)" in proc.stdout
    assert "downstream now out of date: train-stage1, train-stage2" in proc.stdout

    # Another Prefect home (as between `make serve` and a shell) has no cache records: the intact
    # artifacts of the same inputs in the run dir are reused, not recomputed.
    other_home = _cli("prepare", "--run-dir", str(run_dir), env_extra={"PREFECT_HOME": str(tmp_path / "other-home")})
    assert other_home.returncode == 0, other_home.stderr[-3000:]
    assert "prepare (cache hit)" in other_home.stdout

    status = _cli("status", "--run-dir", str(run_dir))  # no flow runs: fast without a server
    assert status.returncode == 0, status.stderr
    status_out = status.stdout
    rows = {line.split()[0]: line.split()[1] for line in status_out.splitlines()[3:-1]}
    assert rows == {"prepare": "fresh", "mine": "fresh", "train-stage1": "stale", "train-stage2": "stale"}, status_out
    assert "next run: recomputes train-stage1, train-stage2" in status_out

    # `embedpipe run --run-dir D` runs the run dir's config.yaml: it recomputes exactly the out-of-date stages.
    again = pipeline_flow(config_path=str(cfg_snapshot), run_dir=str(run_dir))
    assert {k: r["cached"] for k, r in again.items()} == {"prepare": True, "mine": True, "train-stage1": False,
                                                          "train-stage2": False}
    status = _cli("status", "--run-dir", str(run_dir), "--json")
    import json

    assert {r["state"] for r in json.loads(status.stdout)} == {"fresh"}


def yaml_config(path):
    from embed_core.config import load_config

    return load_config(path)


def test_data_watch_unchanged_run_is_all_cache_hits_and_a_source_edit_reruns_downstream(prefect_harness, demo_copy,
                                                                                       tmp_path):
    from flows.watch import data_watch_flow

    add_tiny_stages(demo_copy, tmp_path, evaluate=False)
    first = data_watch_flow(config_path=str(demo_copy))
    assert {c["change"] for c in first["changes"]} == {"new"}
    assert set(first["stages"].values()) == {"computed"}

    t0 = time.perf_counter()
    second = data_watch_flow(config_path=str(demo_copy))
    assert second["changes"] == []
    assert second["all_cached"] and set(second["stages"]) == {"prepare", "mine", "train-stage1", "train-stage2"}
    assert second["verdict"] == "no stage recomputed: all 4 stages were cache hits"
    unchanged_seconds = time.perf_counter() - t0

    sts = demo_copy.parent / "data/stsb/train.csv"
    lines = sts.read_text().splitlines(keepends=True)
    lines[3] = "A kitten naps in the sun.,A small cat sleeps in sunlight.,4.4\n"  # edit one row
    sts.write_text("".join(lines))
    third = data_watch_flow(config_path=str(demo_copy))
    assert [(c["source"], c["change"]) for c in third["changes"]] == [("stsb", "changed")]
    # prepare and mine read every source; the retrieval-only stage 1 does not read STS records
    assert third["stages"] == {"prepare": "computed", "mine": "computed", "train-stage1": "cache hit",
                               "train-stage2": "computed"}
    print(f"unchanged watch run: {unchanged_seconds:.1f} s")

    # the change reached the Prefect server as an event a deployment trigger can match
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    wanted = EventFilter(event=EventNameFilter(name=["embedpipe.source.changed"]),
                         resource=EventResourceFilter(id=["embedpipe.source.demo.stsb"]))
    events = []
    for _ in range(60):  # events are delivered asynchronously
        with get_client(sync_client=True) as client:
            events = [e for e in client.read_events(filter=wanted, limit=50).events if e.payload.get("change") == "changed"]
        if events:
            break
        time.sleep(1)
    assert events, "no embedpipe.source.changed event for stsb reached the server"
    payload = events[0].payload
    assert payload["old"] == first["changes"][[c["source"] for c in first["changes"]].index("stsb")]["new"]
    assert payload["run_dir"] == str((demo_copy.parent / "runs" / "demo").resolve())
    assert payload["config_path"] == str(demo_copy.resolve())


def test_gpu_kubernetes_template_adds_gpu_job_variables():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_kubernetes", REPO / "deployments/work-pools/gpu_kubernetes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # the shape of Prefect's default Kubernetes base job template (the parts the script edits)
    template = {"variables": {"properties": {"image": {"type": "string"}}},
                "job_configuration": {"job_manifest": {"spec": {"template": {"spec": {
                    "containers": [{"name": "prefect-job", "image": "{{ image }}"}]}}}}}}
    out = mod.add_gpu(template)
    pod = out["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert {"gpu_count", "gpu_node_selector", "shm_size_gi", "image"} <= set(out["variables"]["properties"])
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
    # every placeholder the template uses is a declared variable
    import re

    used = set(re.findall(r"{{ (\w+) }}", yaml.safe_dump(out["job_configuration"])))
    assert used <= set(out["variables"]["properties"])


def test_config_snapshot_keys_every_stage_like_the_original_config(tmp_path):
    """The run dir's config.yaml (absolute data_root) must not change any stage's cache key."""
    from embed_core.config import load_config
    from embed_core.evaluate import run as evaluate
    from embed_core.prepare import run as prepare
    from embed_core.rundir import load_config_snapshot, save_config_snapshot

    original = load_config(REPO / "deployments/configs/demo.yaml")  # data_root: data (relative)
    save_config_snapshot(tmp_path, original)
    snapshot = load_config_snapshot(tmp_path)
    assert snapshot.data_root != original.data_root
    assert prepare.input_fingerprint(snapshot).key == prepare.input_fingerprint(original).key
    assert (evaluate.input_fingerprint(snapshot, tmp_path, ["base"]).key
            == evaluate.input_fingerprint(original, tmp_path, ["base"]).key)


def test_embedpipe_run_ends_with_the_wall_time_of_every_stage(prefect_harness, tmp_path, capfd):
    from tests.helpers.cli_run import in_process, write_config

    (tmp_path / "s.csv").write_text("sentence1,sentence2,score\nA man plays.,A man is playing.,4.5\n")
    config = write_config(tmp_path, [{"name": "sts", "kind": "sts", "path": "s.csv"}])
    first = in_process(capfd, "run", "--config", config)
    assert first.rc == 0, first.err
    times = first.out[first.out.index("wall time per stage:"):].splitlines()
    assert times[1].split()[0] == "prepare" and times[1].split()[2] == "s" and "cache hit" not in times[1]
    assert times[-1].split()[:3] == ["total", "(whole", "command)"]
    again = in_process(capfd, "run", "--config", config)
    assert "(cache hit)" in again.out[again.out.index("wall time per stage:"):]


def test_evaluate_rerun_alone_scores_what_the_pipeline_does_and_status_stays_fresh(prefect_harness, demo_copy,
                                                                                   tmp_path):
    """The three entrances agree about one run directory: after the pipeline, `embedpipe evaluate`
    (what the embedpipe-evaluate deployment runs) scores the base and every trained stage, as the
    pipeline did, not evaluate.models alone; `status` then says every stage is fresh."""
    import json

    import pyarrow.parquet as pq

    from flows.pipeline import pipeline_flow

    add_tiny_stages(demo_copy, tmp_path, evaluate=True)
    run_dir = tmp_path / "runs" / "demo"
    pipeline_flow(config_path=str(demo_copy))
    scored = {r["model"] for r in pq.read_table(run_dir / "evaluate/results.parquet").to_pylist()}
    assert scored == {"base", "stage1", "stage2"}
    again = _cli("evaluate", "--run-dir", str(run_dir), "--force")
    assert again.returncode == 0, again.stderr[-3000:]
    assert {r["model"] for r in pq.read_table(run_dir / "evaluate/results.parquet").to_pylist()} == scored
    status = _cli("status", "--run-dir", str(run_dir), "--json")
    assert {r["stage"]: r["state"] for r in json.loads(status.stdout)} == {
        "prepare": "fresh", "mine": "fresh", "train-stage1": "fresh", "train-stage2": "fresh", "evaluate": "fresh",
        "gate": "fresh"}

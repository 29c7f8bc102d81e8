"""The first-run script (``python -m embedpipe_tools.gpurun.first``, embedpipe_tools/gpurun/first.py): its
CPU sequence passes every step and writes report.json with every probe and the GPU check; a probe
that ends its process is recorded and the probes after it still run; an older transformers stops
the run with one line; what the install step takes from the kit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from embedpipe_tools.gpurun import first
from embedpipe_tools.gpurun.probes import PROBES
from tests.helpers.repo import REPO


@pytest.fixture(scope="module")
def cpu_first_run(tmp_path_factory):
    """One run of the CPU sequence (about 70 s on 2 free cores)."""
    out = tmp_path_factory.mktemp("first") / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "embedpipe_tools.gpurun.first", "--out", str(out), "--cpu"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    return proc, out


@pytest.mark.slow
def test_the_cpu_first_run_passes_every_step_and_reports_each(cpu_first_run):
    proc, out = cpu_first_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in report["steps"]] == list(first.STEPS)
    assert all(s["status"] == "ok" for s in report["steps"]), report["steps"]
    assert report["status"] == "done" and report["mode"] == "cpu"
    assert all(s["seconds"] <= s["limit_s"] for s in report["steps"])
    env = report["environment"]
    assert env["device"] == "cpu" and env["transformers_too_old"] is None and env["torch"]
    assert env["importable"]["pydantic"] is True and env["memory_kib"]["MemTotal"] > 0


@pytest.mark.slow
def test_every_probe_ran_ok_and_measured_what_it_names(cpu_first_run):
    _, out = cpu_first_run
    report = json.loads((out / "report.json").read_text())
    probes = report["probes"]
    assert list(probes) == list(PROBES) and all(p["status"] == "ok" for p in probes.values()), probes
    assert json.loads((out / "probes.json").read_text())["current"] is None
    cases = probes["bidirectional"]["cases"]
    assert set(cases) == {"qwen2/sdpa", "qwen3/sdpa"}
    assert all(c["first_token_change"] > 0 and c["causal_control_change"] == 0.0 for c in cases.values())
    assert set(probes["pool_packed_bf16"]["by_tokens"]) == {"64", "256", "512"}
    replay = probes["grad_cache_replay"]
    assert replay["max_abs_diff"] == 0.0 and replay["control_max_abs_diff"] > replay["tolerance"]
    assert probes["collectives"]["backend"] == "gloo" and probes["collectives"]["all_gather_backward_equal"] is True
    fsdp = probes["fsdp2_adamw_dcp"]
    assert fsdp["dtensor_parameters"] and fsdp["dcp_round_trip_bit_equal"] and fsdp["step_after_load_bit_equal"]


@pytest.mark.slow
def test_the_gpu_check_ran_on_the_random_minilm_and_collect_sums_up(cpu_first_run):
    _, out = cpu_first_run
    report = json.loads((out / "report.json").read_text())
    check = json.loads((out / "gpucheck.json").read_text())
    assert check["finished"] is True and check["ok"] is True
    assert "all-MiniLM-L6-v2's shape" in check["encoder_model"]
    assert check["parts"]["encoder"]["steps"] == 1
    assert report["headline"]["gpucheck"]["ok"] is True and report["headline"]["bidirectional"]
    models = report["collect"]["memory"]["gpucheck_models"]
    assert models["encoder"]["allocated_bytes"] > 0 and models["decoder"]["planned_bytes"] > 0
    assert set(report["collect"]["step_seconds"]) == set(first.STEPS[:-1])
    # what comes back from a device call: at most 8 files, at most 2 folders down
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files), files


class StandIn(first.FirstRun):
    """The probes' processes replaced by a stand-in: the first ends (SIGABRT, as NCCL's watchdog
    does) during ``collectives`` after three probes; the second runs the rest."""

    def __init__(self, args):
        super().__init__(args)
        self.calls: list[list[str]] = []

    def command(self, args, step, limit, append=False):
        self.calls.append(args)
        path = Path(args[args.index("--out") + 1])
        only = args[args.index("--only") + 1].split(",")
        done = {"status": "ok", "errors": []}
        if len(self.calls) == 1:
            first.write_json(path, {"current": "collectives", "results": {p: done for p in only[:3]}})
            return {"rc": -6, "seconds": 1.0, "error": "Fatal Python error: Aborted"}
        state = json.loads(path.read_text())
        first.write_json(path, {"current": None, "results": {**state["results"], **{p: done for p in only}}})
        return {"rc": 0, "seconds": 1.0}


def test_a_probe_that_ends_its_process_is_recorded_and_the_probes_after_it_still_run(tmp_path):
    run = StandIn(first.parse_args(["--out", str(tmp_path), "--cpu"]))
    first.probes_step(run)
    assert [c[c.index("--only") + 1] for c in run.calls] == [",".join(PROBES), "fsdp2_adamw_dcp"]
    assert "--cpu" in run.calls[0]
    report = json.loads((tmp_path / "report.json").read_text())
    probes = report["probes"]
    assert probes["collectives"]["status"] == "failed"
    assert "ended" in probes["collectives"]["errors"][0] and "exit -6" in probes["collectives"]["errors"][0]
    assert [p for p in PROBES if probes[p]["status"] == "ok"] == [p for p in PROBES if p != "collectives"]
    assert report["steps"] == [{"name": "probes", "status": "failed", "seconds": report["steps"][0]["seconds"],
                                "limit_s": 300, "error": f"collectives: {probes['collectives']['errors'][0]}"}]


def _fake_transformers(root: Path, version: str) -> Path:
    """A folder whose transformers metadata says ``version`` (first on PYTHONPATH: what the
    project reads without importing transformers)."""
    info = root / f"transformers-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n")
    return root


@pytest.mark.slow
def test_a_transformers_older_than_5_2_stops_the_run_with_one_line_and_exit_2(tmp_path):
    fake = _fake_transformers(tmp_path / "old", "4.44.2")
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "embedpipe_tools.gpurun.first", "--out", str(out), "--cpu"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "transformers 4.44.2 is installed; embedpipe needs transformers>=5.2,<6" in proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("environment", "failed"), *[(name, "skipped") for name in first.STEPS[1:]]]
    assert report["status"].startswith("stopped: transformers 4.44.2")


def test_the_install_step_takes_a_missing_group_whole_and_reports_one_it_does_not_carry():
    import importlib.metadata as md

    kit = {"groups": [
        {"root": "no-such-dist-xyz", "floor": "1.0", "pins": {"no-such-dist-xyz": "1.2", "pytest": "999.0",
                                                              "packaging": md.version("packaging")}},
        {"root": "pytest", "floor": "1.0", "pins": {"pytest": "999.0"}},  # here and new enough: left alone
        {"root": "pluggy", "floor": "999.0", "pins": {"pluggy": "999.1"}},  # here but older than the floor
        {"root": "no-such-arrow", "floor": "15", "pins": {}, "why_not": "make gpu-first WITH_PYARROW=1"}]}
    install, lacking = first.wanted(kit)
    # a missing group: its missing members and those older than the pin, not the ones already as new
    assert install == {"no-such-dist-xyz": "1.2", "pytest": "999.0", "pluggy": "999.1"}
    assert list(lacking) == ["no-such-arrow"]
    assert lacking["no-such-arrow"] == ("no-such-arrow is missing and the kit does not carry it "
                                        "(make gpu-first WITH_PYARROW=1)")

"""The first run on a GPU (``python -m embedpipe_tools.gpurun.first --out DIR``, or ``bash
dist/gpu-first/first_run.sh`` from the kit ``make gpu-first`` writes): in at most 7.5 minutes
(``--budget-s``) on one H100, within a 15-minute reservation, what only a GPU can show, in five
steps, each a subprocess under its own time limit, ``DIR/report.json`` rewritten whole after each:

1. ``environment``: GPU, driver, Python, torch, CUDA, NCCL, transformers (older than 5.2: the run
   stops here, one line, exit 2), sentence-transformers, pyarrow, pydantic, flash_attn, bf16, free
   disk and memory (``probes environment``; needs torch only);
2. ``install``: what the machine lacks of the kit's wheels (``--kit``: pydantic and what it needs,
   pyarrow when the kit has it) into ``--site`` with ``pip install --no-index --no-deps``, which then
   goes first on the later steps' ``PYTHONPATH`` (the machine's own packages are left as they are);
   then the trainer and the GPU check must import;
3. ``probes``: the CUDA probes (``embedpipe_tools.gpurun.probes``); a probe that kills its process (an
   NCCL abort) is recorded and the probes after it run in a new process;
4. ``gpucheck``: ``python -m embedpipe_tools.gpucheck --encoder random-minilm`` with few steps and a time
   budget (its JSON is rewritten after each part, so a time limit keeps what finished);
5. ``collect``: peak allocated against reserved memory of every probe and GPU-check model, the
   planner's figure beside them, each step's time, and the headline figures in reading order.

A step that fails is recorded and the next one runs. ``--cpu`` runs the same sequence on the CPU
with the tiniest settings (what ``make test`` runs). Exit status: 0 when every step is ok, 1 when
one failed, 2 when the run stopped (transformers too old). This module imports the standard
library only, so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from embedpipe_tools.gpurun.report import write_json
from embedpipe_tools.gpurun.steps import run_command

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder embed_core and embedpipe_tools are imported from
STEPS = ("environment", "install", "probes", "gpucheck", "collect")
# 7.5 minutes: what one H100 run may take (a 15-minute reservation holds the machine's start, the
# transfer, this run under a call limit of 480 s, and a short rerun); the CPU sequence takes about
# 70 s on 2 free cores, more on a shared one
BUDGET_S = {"cuda": 450, "cpu": 900}
# each step's time limit (s): on one H100 / on a CPU (the tiny settings; a shared 2-core CPU is slow)
LIMITS = {"cuda": {"environment": 45, "install": 45, "probes": 120, "gpucheck": 255, "collect": 10},
          "cpu": {"environment": 120, "install": 120, "probes": 300, "gpucheck": 480, "collect": 30}}
GPUCHECK_STEPS = {"cuda": 5, "cpu": 1}
GPUCHECK_TAIL_S = 75  # gpucheck starts no part later than this before its limit (its longest part)
READ_IN_ORDER = (
    "status and steps: which steps ran, each one's status, seconds and limit",
    "environment.transformers_too_old, headline.bidirectional: whether a bidirectional decoder is correct at all",
    "headline.pool_packed_one_minus_cos: whether bf16 packed pooling must be fixed before a packed FSDP run",
    "headline.grad_cache_replay_max_abs_diff, headline.collectives, headline.fsdp2: GradCache, NCCL, FSDP2 + DCP",
    "headline.gpucheck: tokens/s against sentence-transformers, decoder MFU, packed over padded, FSDP equality",
    "collect.memory: planned against allocated and reserved peak memory",
)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m embedpipe_tools.gpurun.first", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the report folder (report.json, the steps' JSON and logs)")
    p.add_argument("--cpu", action="store_true", help="the same sequence on the CPU with the tiniest settings")
    p.add_argument("--kit", type=Path, help="the kit folder make gpu-first wrote (kit.json, wheels/): what to install "
                                           "when the machine lacks it")
    p.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "embedpipe-first-site",
                   help="where the kit's wheels are installed (--target; default: %(default)s)")
    p.add_argument("--budget-s", type=float, help=f"seconds for the whole run: no step runs past them (default: "
                                                  f"{BUDGET_S['cuda']}, with --cpu {BUDGET_S['cpu']})")
    p.add_argument("--only", help=f"comma-separated steps to run, the others recorded as skipped (default: all: "
                                  f"{','.join(STEPS)})")
    args = p.parse_args(argv)
    args.steps = args.only.split(",") if args.only else list(STEPS)
    if set(args.steps) - set(STEPS):
        p.error(f"--only: unknown steps {sorted(set(args.steps) - set(STEPS))} (known: {', '.join(STEPS)})")
    args.budget_s = args.budget_s or BUDGET_S["cpu" if args.cpu else "cuda"]
    return args


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class FirstRun:
    """The run's state: the report (rewritten after every step), the time left, the children's
    environment."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.out = args, args.out.resolve()
        self.mode = "cpu" if args.cpu else "cuda"
        self.t0 = time.monotonic()
        # what an earlier run installed stays on the path of a rerun (--only probes,...)
        self.site: Path | None = args.site.resolve() if args.site.is_dir() else None
        self.report: dict[str, Any] = {
            "kit": "embedpipe_tools.gpurun.first", "mode": self.mode, "status": "running", "started": now(),
            "updated": now(), "elapsed_s": 0.0, "budget_s": args.budget_s, "out": str(self.out),
            "read_in_order": list(READ_IN_ORDER), "steps": [], "headline": {}}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def limit(self, step: str) -> float:
        """The step's time limit, cut to what is left of the budget."""
        return max(1.0, min(LIMITS[self.mode][step], self.args.budget_s - self.elapsed()))

    def save(self) -> None:
        self.report.update(updated=now(), elapsed_s=round(self.elapsed(), 1))
        write_json(self.out / "report.json", self.report)

    def record(self, name: str, status: str, seconds: float, limit: float, error: str | None = None) -> None:
        self.report["steps"].append({"name": name, "status": status, "seconds": round(seconds, 1),
                                     "limit_s": round(limit), **({"error": error} if error else {})})
        self.save()
        print(f"first-run: {name}: {status} in {seconds:.1f} s" + (f": {error}" if error else ""), flush=True)

    def env(self) -> dict[str, str]:
        """The children's environment: the installed kit and this checkout first on the path."""
        paths = [str(p) for p in (self.site, PACKAGE_ROOT) if p is not None]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        env = {"PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        if self.mode == "cpu":
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        return env

    def command(self, args: list[str], step: str, limit: float, append: bool = False) -> dict[str, Any]:
        return run_command([sys.executable, *args], self.out / "logs" / f"{step}.log", env=self.env(), timeout=limit,
                           append=append)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = FirstRun(args)
    print(f"first-run: {run.mode}; report in {run.out}/report.json (rewritten after every step)", flush=True)
    return sequence(run)


def sequence(run: FirstRun) -> int:
    """The steps in order (those not in ``--only`` recorded as skipped); the exit status."""
    args = run.args
    run.save()
    for name, step in (("environment", environment_step), ("install", install_step), ("probes", probes_step),
                       ("gpucheck", gpucheck_step), ("collect", collect_step)):
        if name not in args.steps:
            run.report["steps"].append({"name": name, "status": "skipped", "seconds": 0.0, "error": "not in --only"})
        elif step(run) is False:  # the environment stops the run: nothing after it would be right
            stop = run.report["steps"][-1]["error"]
            for later in STEPS[STEPS.index(name) + 1:]:
                run.report["steps"].append({"name": later, "status": "skipped", "seconds": 0.0,
                                            "error": f"not run: the {name} step stopped the run"})
            run.report["status"] = f"stopped: {stop}"
            run.save()
            print(f"first-run: stopped: {stop}", file=sys.stderr, flush=True)
            return 2
    failed = [s["name"] for s in run.report["steps"] if s["status"] not in ("ok", "skipped")]
    run.report["status"] = "failed: " + ", ".join(failed) if failed else "done"
    run.save()
    print(f"first-run: {run.report['status']} in {run.elapsed():.0f} s: {run.out}/report.json", flush=True)
    return 1 if failed else 0


def environment_step(run: FirstRun) -> bool:
    """The machine; False (stop) when its transformers is older than the project needs."""
    limit = run.limit("environment")
    with tempfile.TemporaryDirectory(prefix="embedpipe-first-") as tmp:  # into report.json: $OUT keeps few files
        path = Path(tmp) / "environment.json"
        args = ["-m", "embedpipe_tools.gpurun.probes", "environment", "--out", str(path),
                *(["--cpu"] if run.args.cpu else [])]
        result = run.command(args, "environment", limit)
        env = read_json(path) or {}
    run.report["environment"] = env
    too_old = env.get("transformers_too_old")
    if result["rc"] != 0:
        run.record("environment", "failed", result["seconds"], limit, result.get("error"))
    elif too_old:
        run.record("environment", "failed", result["seconds"], limit, too_old)
        return False
    else:
        run.record("environment", "ok", result["seconds"], limit)
    return True


def _version_tuple(version: str | None) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", (version or "").split("+")[0])[:3])


def _installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def wanted(kit: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(to install: distribution -> pinned version, lacking: distribution -> why it cannot be): a
    group of the kit (pydantic and what it needs; pyarrow) is installed when its first distribution
    is missing here or older than the project's floor, and then every member that is missing or
    older than the pin; a group the kit does not carry is reported."""
    install, lacking = {}, {}
    for group in kit.get("groups", []):
        root, floor, pins = group["root"], group.get("floor"), group["pins"]
        have = _installed(root)
        if have is not None and _version_tuple(have) >= _version_tuple(floor):
            continue
        if not pins:
            lacking[root] = f"{root} {'is missing' if have is None else f'{have} is older than {floor}'} and the kit " \
                            f"does not carry it ({group.get('why_not', 'make gpu-first WITH_PYARROW=1')})"
            continue
        install.update({d: v for d, v in pins.items()
                        if _installed(d) is None or _version_tuple(_installed(d)) < _version_tuple(v)})
    return install, lacking


def install_step(run: FirstRun) -> None:
    """The kit's wheels the machine lacks, into ``--site``; then the project's GPU modules must import."""
    limit, t0 = run.limit("install"), time.monotonic()
    kit = read_json(run.args.kit / "kit.json") if run.args.kit else None
    install, lacking = wanted(kit) if kit else ({}, {})
    if run.args.kit and kit is None:
        lacking["kit"] = f"no kit.json in {run.args.kit} (make gpu-first writes the kit)"
    section: dict[str, Any] = {"kit": str(run.args.kit) if run.args.kit else None, "installed": install,
                               "lacking": lacking, "site": None}
    run.report["install"] = section
    error = None
    if install:
        run.site = run.args.site.resolve()
        section["site"] = str(run.site)
        pip = ["-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target",
               str(run.site), "--find-links", str(run.args.kit / "wheels"), *[f"{d}=={v}" for d, v in install.items()]]
        result = run.command(pip, "install", limit)
        error = result.get("error") and f"pip install: {result['error']}"
    check = ("import importlib; [importlib.import_module(m) for m in ('pydantic', 'pyarrow', 'embed_core.train.engine.trainer', "
             "'embedpipe_tools.gpucheck.parts', 'embedpipe_tools.gpurun.probes')]")
    if error is None:
        result = run.command(["-c", check], "install-check", max(1.0, limit - (time.monotonic() - t0)))
        section["imports"] = "ok" if result["rc"] == 0 else result.get("error")
        if result["rc"] != 0:
            error = "; ".join([*lacking.values(), f"the trainer does not import: {result.get('error')}"])
    run.record("install", "failed" if error else "ok", time.monotonic() - t0, limit, error)


def probes_step(run: FirstRun) -> None:
    """Every probe; after a probe that ends its process, the rest in a new one while time is left."""
    from embedpipe_tools.gpurun.probes import PROBES

    limit, t0 = run.limit("probes"), time.monotonic()
    path = run.out / "probes.json"
    path.unlink(missing_ok=True)
    results: dict[str, Any] = {}
    why = "not run: the step's time limit"
    while (left := [p for p in PROBES if p not in results]) and (remaining := limit - (time.monotonic() - t0)) > 1:
        args = ["-m", "embedpipe_tools.gpurun.probes", "probes", "--out", str(path), "--only", ",".join(left),
                *(["--cpu"] if run.args.cpu else [])]
        result = run.command(args, "probes", remaining, append=bool(results))  # keep a crashed process's log
        state = read_json(path) or {}
        results = state.get("results", {})
        current = state.get("current")
        why = f"not run: the probe process ended ({result.get('error')}, exit {result['rc']})"
        if current and current not in results:  # it ended the process: recorded, the rest go on
            results[current] = {"status": "failed", "errors": [f"the probe process ended ({result.get('error')}, "
                                                               f"exit {result['rc']}) during this probe"]}
            write_json(path, {**state, "current": None, "results": results})
        elif result["rc"] != 0 or not current:  # all ran (1: one failed), or it ended before any probe
            break
        if result["rc"] == 124:
            why = "not run: the step's time limit"
            break
    for name in PROBES:
        results.setdefault(name, {"status": "failed", "errors": [why]})
    run.report["probes"] = {p: results[p] for p in PROBES}
    failed = [p for p in PROBES if results[p]["status"] != "ok"]
    error = "; ".join(f"{p}: {'; '.join(results[p].get('errors', []))[:300]}" for p in failed) or None
    run.record("probes", "failed" if failed else "ok", time.monotonic() - t0, limit, error)


def gpucheck_step(run: FirstRun) -> None:
    """``python -m embedpipe_tools.gpucheck --encoder random-minilm`` with few steps and a budget."""
    limit = run.limit("gpucheck")
    path = run.out / "gpucheck.json"
    path.unlink(missing_ok=True)
    args = ["-m", "embedpipe_tools.gpucheck", "--encoder", "random-minilm", "--out", str(path),
            "--steps", str(GPUCHECK_STEPS[run.mode]), *(["--cpu"] if run.args.cpu else [])]
    if not run.args.cpu:
        args += ["--budget-s", str(max(1, round(limit - GPUCHECK_TAIL_S)))]
    result = run.command(args, "gpucheck", limit)
    check = read_json(path) or {}
    run.report["gpucheck"] = gpucheck_brief(check)
    status = "ok" if result["rc"] == 0 and check.get("finished") else "failed"
    error = None
    if status == "failed":
        error = result.get("error") or "; ".join(check.get("errors", [])) or "no report"
        if result["rc"] == 124:
            error = f"timed out after {limit:.0f} s (the parts that finished are in gpucheck.json)"
    run.record("gpucheck", status, result["seconds"], limit, error)


def gpucheck_brief(check: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of gpucheck.json (the whole is beside it)."""
    parts = check.get("parts", {})
    brief: dict[str, Any] = {k: check.get(k) for k in ("ok", "finished", "errors", "skipped", "goals", "seconds",
                                                       "encoder_model")}
    for name in ("encoder", "sentence_transformers", "decoder"):
        p = parts.get(name, {})
        brief[name] = {k: p.get(k) for k in ("tokens_per_s", "mfu", "measured_peak_bytes", "measured_reserved_bytes",
                                             "attention", "packed", "error", "skipped") if p.get(k) is not None}
    brief["st_ratio"] = parts.get("sentence_transformers", {}).get("ratio")
    brief["packed_over_padded"] = parts.get("packed_vs_padded", {}).get("packed_over_padded")
    brief["packed_losses_agree"] = parts.get("packed_vs_padded", {}).get("losses_agree")
    brief["fsdp_equal_to_unsharded"] = parts.get("fsdp", {}).get("equal_to_unsharded")
    brief["memory"] = parts.get("memory")
    return brief


def collect_step(run: FirstRun) -> None:
    """Peak memory (allocated, reserved, planned) of every probe and model, each step's time, and
    the headline figures."""
    from embedpipe_tools.gpurun.first_summary import headline, memory

    limit, t0 = run.limit("collect"), time.monotonic()
    try:
        run.report["collect"] = {"memory": memory(run.report),
                                 "step_seconds": {s["name"]: s["seconds"] for s in run.report["steps"]},
                                 "total_s": round(run.elapsed(), 1), "budget_s": run.args.budget_s}
        run.report["headline"] = headline(run.report)
        run.record("collect", "ok", time.monotonic() - t0, limit)
    except Exception as exc:  # noqa: BLE001 - the report keeps what the steps found
        run.record("collect", "failed", time.monotonic() - t0, limit, " ".join(f"{type(exc).__name__}: {exc}".split()))


if __name__ == "__main__":
    raise SystemExit(main())

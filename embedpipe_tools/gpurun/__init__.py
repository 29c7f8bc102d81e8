"""``make gpu-run`` (``python -m embedpipe_tools.gpurun``): one command that proves training and the
quality recipe on a short GPU reservation (sized for one H100 in under 25 minutes).

The sequence, each step through the project's own commands in a subprocess:

1. the machine: the CUDA device, or the CPU and whether it trains in bf16 (``machine``);
2. the GPU check, ``python -m embedpipe_tools.gpucheck`` (``--cpu --steps 1`` in the tiny run);
3. ``quality.yaml`` end to end through the CLI (``embedpipe run``) with ``train.precision: auto``
   and its evaluation, on the ephemeral Prefect backend (PREFECT_API_URL unset) or the server
   PREFECT_API_URL names, in the run directory of the ablation's base row at its seed (the same
   settings: that run then only evaluates again);
4. the quality-scale ablation's rows (``deployments/configs/ablation-quality-gpu.yaml``: 6 rows,
   3 seeds) seed by seed, each run through the CLI as it is started, while the time budget
   (``--budget-s``, GPU_RUN_BUDGET_S; 25 min) still holds a row's measured time (the slowest row so
   far; before the first, the quality run's); the ablation's mean ± spread table is rewritten after
   each.

After every step ``gpu-run.json`` and ``gpu-run.md`` are rewritten in the report folder
(``--out``, GPU_RUN_OUT; default runs/gpu-run): machine, versions, the GPU check's tokens/s, MFU and
peak memory, each train stage's tokens/s, MFU and peak memory, and every run's test scores, so a
reservation cut off mid-run keeps what finished. The runs and the commands' logs are in the same
folder (``runs/``, ``logs/``). ``--cpu`` (``make gpu-run CPU=1``) runs the identical sequence on the
CPU with tiny models built in code and tiny budgets (``embedpipe_tools.gpurun.configs.TINY``); it is
what the test suite runs. Exit status: 0 when every step that ran succeeded, 1 when one failed, 2
(one line) when a config does not load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from embedpipe_tools.gpurun import report as reporting
from embedpipe_tools.gpurun.steps import run_command, scores, train_summary

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 25 * 60
CPU_BUDGET_S = 15 * 60


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from embedpipe_tools.gpurun.configs import ABLATION, QUALITY

    p = argparse.ArgumentParser(prog="python -m embedpipe_tools.gpurun", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the tiny sequence on the CPU (tiny models, small budgets)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("GPU_RUN_OUT") or REPO / "runs" / "gpu-run"),
                   help="the report folder (default: $GPU_RUN_OUT, else runs/gpu-run)")
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_RUN_BUDGET_S") or 0) or None,
                   help=f"seconds for the whole sequence; no ablation row starts that would not fit (default: "
                        f"$GPU_RUN_BUDGET_S, else {BUDGET_S} on a GPU, {CPU_BUDGET_S} with --cpu)")
    p.add_argument("--max-rows", type=int, default=int(os.environ.get("GPU_RUN_MAX_ROWS") or 0) or None,
                   help="start at most this many ablation runs (default: $GPU_RUN_MAX_ROWS, else as the budget allows)")
    p.add_argument("--quality", type=Path, default=QUALITY, help="the quality recipe (default: quality.yaml)")
    p.add_argument("--ablation", type=Path, default=ABLATION, help="the ablation config (default: "
                                                                     "ablation-quality-gpu.yaml)")
    return p.parse_args(argv)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Runner:
    """The sequence's state: the report, rewritten after every step, and the time budget."""

    def __init__(self, args: argparse.Namespace, cuda: bool):
        from embedpipe_tools.gpurun.machine import describe

        self.args, self.cuda, self.out = args, cuda, args.out.resolve()
        self.budget = args.budget_s or (CPU_BUDGET_S if args.cpu else BUDGET_S)
        self.t0 = time.monotonic()
        self.env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **({"CUDA_VISIBLE_DEVICES": ""} if args.cpu else {})}
        self.report: dict[str, Any] = {
            "runner": "embedpipe_tools.gpurun", "mode": "cpu-tiny" if args.cpu else "full", "status": "running",
            "started": now(), "updated": now(), "elapsed_s": 0.0, "budget_s": self.budget, "out": str(self.out),
            "machine": describe(cuda), "versions": versions(), "steps": [], "gpucheck": {}, "quality": {},
            "ablation": {"rows": []}, "cuda_only": list(reporting.CUDA_ONLY),
            "never_filled": list(reporting.NEVER)}
        self.tiny_model: Path | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def save(self) -> None:
        self.report.update(updated=now(), elapsed_s=round(self.elapsed(), 1))
        reporting.write(self.report, self.out)

    def step(self, name: str, status: str, seconds: float | None = None, error: str | None = None) -> None:
        self.report["steps"].append({"name": name, "status": status, "seconds": seconds,
                                     **({"error": error} if error else {})})
        self.save()

    def cli(self, config, name: str) -> dict[str, Any]:
        """``embedpipe run`` on ``config`` (written to configs/<name>.yaml); the command's result."""
        import yaml

        path = self.out / "configs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
        result = run_command([sys.executable, "-m", "flows.cli", "run", "--config", str(path)],
                             self.out / "logs" / f"{name}.log", env=self.env)
        return {"config": str(path), "run_dir": str(config.default_run_dir()), **result}

    def run_summary(self, config, result: dict[str, Any]) -> dict[str, Any]:
        run_dir = Path(result["run_dir"])
        names = [s.name for s in config.train.stages]
        return {**result, "status": "ok" if result["rc"] == 0 else "failed",
                "train": train_summary(run_dir, names), "scores": scores(run_dir)}


def versions() -> dict[str, Any]:
    import importlib.metadata as md
    import platform
    import subprocess

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    import torch

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            **{d: version(d) for d in ("transformers", "sentence-transformers", "flash-attn", "prefect", "mteb",
                                       "faiss-cpu", "pydantic", "embedpipe")}, "commit": commit}


def main(argv: list[str] | None = None) -> int:
    from embed_core.errors import EmbedpipeError

    args = parse_args(argv)
    if args.cpu:  # before torch first asks for CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        return run(args)
    except EmbedpipeError as exc:  # a config that does not load: one line, as the CLI says it
        print(f"embedpipe: error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    import torch

    runner = Runner(args, cuda=not args.cpu and torch.cuda.is_available())
    print(f"gpu-run: {runner.report['machine']['device']}: {runner.report['machine']['verdict']}", flush=True)
    print(f"gpu-run: report in {runner.out}/gpu-run.md (rewritten after every step)", flush=True)
    from embedpipe_tools.gpurun.configs import ablation_rows, quality_config, shared_run_name

    # both configs load before any step runs: a broken one costs no reservation time
    quality = quality_config(runner.out, tiny_model=tiny_model(runner), path=args.quality)
    rows = ablation_rows(runner.out, tiny_model=tiny_model(runner), path=args.ablation)
    shared = shared_run_name(quality, rows[1])
    if shared:  # the ablation's first run is this one: it reuses the quality run's stages
        quality = quality_config(runner.out, tiny_model=tiny_model(runner), path=args.quality, run_name=shared)
    runner.report["quality"]["shared_with_ablation_run"] = shared
    runner.save()
    gpucheck_step(runner)
    quality_step(runner, quality)
    ablation_step(runner, *rows)
    failed = [s["name"] for s in runner.report["steps"] if s["status"] == "failed"]
    runner.report["status"] = "failed: " + ", ".join(failed) if failed else "done"
    runner.save()
    print(f"gpu-run: {runner.report['status']} in {runner.elapsed():.0f} s: {runner.out}/gpu-run.md", flush=True)
    return 1 if failed else 0


def gpucheck_step(runner: Runner) -> None:
    """The GPU check (its tiny version with --cpu); on a machine without CUDA and without --cpu: skipped."""
    if not runner.cuda and not runner.args.cpu:
        runner.report["gpucheck"] = {"status": "skipped", "error": "no CUDA GPU (torch.cuda.is_available() is False)"}
        runner.step("gpucheck", "skipped", error="no CUDA GPU")
        return
    out = runner.out / "gpucheck.json"
    cmd = [sys.executable, "-m", "embedpipe_tools.gpucheck", "--out", str(out), *(["--cpu", "--steps", "1"]
                                                                              if runner.args.cpu else [])]
    print("gpu-run: GPU check ...", flush=True)
    result = run_command(cmd, runner.out / "logs" / "gpucheck.log", env=runner.env)
    check: dict[str, Any] = {**result, "status": "ok" if result["rc"] == 0 else "failed"}
    if out.exists():
        check["summary"] = gpucheck_summary(json.loads(out.read_text(encoding="utf-8")))
    runner.report["gpucheck"] = check
    runner.step("gpucheck", check["status"], result["seconds"], result.get("error"))


def gpucheck_summary(full: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of gpucheck.json: ok, errors, goals, and per throughput part its
    tokens/s, MFU and peak memory."""
    parts = {}
    for name in ("encoder", "sentence_transformers", "decoder"):
        p = full["parts"].get(name, {})
        peak = p.get("measured_peak_bytes")
        parts[name] = {"tokens_per_s": p.get("tokens_per_s"), "mfu": p.get("mfu") if name != "sentence_transformers"
                       else None, "peak_memory_mb": peak / 2 ** 20 if peak else None, "error": p.get("error")}
    return {"ok": full["ok"], "errors": full["errors"], "goals": full.get("goals"), "seconds": full.get("seconds"),
            "environment": full["environment"], "parts": parts,
            "st_ratio": full["parts"].get("sentence_transformers", {}).get("ratio"),
            "packed_over_padded": full["parts"].get("packed_vs_padded", {}).get("packed_over_padded"),
            "fsdp_equal_to_unsharded": full["parts"].get("fsdp", {}).get("equal_to_unsharded")}


def quality_step(runner: Runner, config) -> None:
    print(f"gpu-run: quality recipe ({runner.args.quality.name}, precision auto) ...", flush=True)
    result = runner.run_summary(config, runner.cli(config, "quality"))
    final = config.train.stages[-1].name
    runner.report["quality"] = {**runner.report["quality"], **result,
                                "targets": reporting.targets(result["scores"], final)}
    runner.step("quality", result["status"], result["seconds"], result.get("error"))


def ablation_step(runner: Runner, cfg, runs: list) -> None:
    """The ablation's runs in order while the budget holds one more (the slowest run so far, or
    before the first, the quality run's time); the mean ± spread table after each."""
    from embed_core.evaluate.run import main_scores
    from embed_core.runs import ablation

    section = runner.report["ablation"]
    section.update(config=str(runner.args.ablation), seeds=cfg.ablation.seeds,
                   order=[f"{row}-s{seed}" for row, seed, _ in runs], not_started=[])
    estimate = runner.report["quality"].get("seconds") or 0.0
    table: list[dict[str, Any]] = []
    for i, (row, seed, run_cfg) in enumerate(runs):
        remaining = runner.budget - runner.elapsed()
        if not fits(remaining, estimate) or (runner.args.max_rows is not None and i >= runner.args.max_rows):
            section["not_started"] = [f"{r}-s{s}" for r, s, _ in runs[i:]]
            break
        print(f"gpu-run: ablation run {i + 1} of {len(runs)}: {row}, seed {seed} ({remaining:.0f} s left) ...", flush=True)
        result = runner.run_summary(run_cfg, runner.cli(run_cfg, f"ablation-{row}-s{seed}"))
        last = run_cfg.train.stages[-1].name
        section["rows"].append({"row": row, "seed": seed, **result, "scores": result["scores"].get(last, {})})
        estimate = max(estimate, result["seconds"])
        table += ablation.run_scores(row, seed, result["run_dir"], run_cfg, main_scores(result["run_dir"]))
        if table:
            section["report"] = str(ablation.write_report(cfg, table) / "report.md")
        runner.save()
    statuses = {r["status"] for r in section["rows"]}
    runner.step("ablation", "failed" if "failed" in statuses else "ok" if section["rows"] else "skipped",
                round(sum(r["seconds"] for r in section["rows"]), 1))


def fits(remaining: float, estimate: float) -> bool:
    """Whether a run measured at ``estimate`` seconds still fits in ``remaining`` seconds."""
    return remaining >= estimate


def tiny_model(runner: Runner) -> Path | None:
    """With --cpu: the tiny random-init BERT every tiny config trains and evaluates (built once)."""
    if not runner.args.cpu:
        return None
    if runner.tiny_model is None:
        from embedpipe_tools.gpucheck.setup import build_tiny_bert

        runner.tiny_model = build_tiny_bert(runner.out / "tiny-bert")
    return runner.tiny_model

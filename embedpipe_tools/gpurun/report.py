"""``make gpu-run``'s report: one JSON object (``gpu-run.json``) and its markdown (``gpu-run.md``),
both rewritten whole (write, then rename) after every step, so a reservation cut off mid-run
leaves the steps that finished readable."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

# issue 48's acceptance for the quality recipe's final model: task -> least score (x100)
QUALITY_TARGETS = {"STSBenchmark": 85.5, "SciFact": 70.0, "Banking77Classification": 85.0}
# the fields only a CUDA run fills (empty in the tiny CPU run): the GPU check's goals and MFU (a CPU
# has no peak FLOP/s entry), the CUDA and FlashAttention versions; the peer's peak memory is never measured
CUDA_ONLY = ("gpucheck.summary.goals", "gpucheck.summary.parts.*.mfu", "gpucheck.summary.environment.flash_attn",
             "versions.cuda", "versions.flash-attn")
NEVER = ("gpucheck.summary.parts.sentence_transformers.peak_memory_mb", "gpucheck.summary.parts.*.error")


def targets(scores: dict[str, dict[str, float]], final: str) -> dict[str, Any]:
    """The final model's scores against QUALITY_TARGETS (a task not evaluated: ``met`` None) and
    against the base model on every task ("none below base")."""
    mine, base = scores.get(final, {}), scores.get("base", {})
    out: dict[str, Any] = {}
    for task, least in QUALITY_TARGETS.items():
        value = 100 * mine[task] if task in mine else None
        out[task] = {"target": least, "value": value, "met": None if value is None else value >= least}
    below = sorted(t for t in mine if t in base and mine[t] < base[t])
    out["none_below_base"] = {"below": below, "met": not below if mine and base else None}
    out["all_met"] = all(v["met"] for v in out.values())
    return out


def finite(value: Any) -> Any:
    """A report with NaN / inf as null (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``path`` replaced whole by ``data`` as JSON (``replace_file``)."""
    replace_file(path, json.dumps(data, indent=2, default=str) + "\n")


def replace_file(path: Path, text: str) -> None:
    """``path`` replaced whole by ``text`` (written beside it, then renamed): a reader, or a call cut
    short, never sees half a report. Standard library only (the first run uses it before installing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write(report: dict[str, Any], out: Path) -> None:
    """``out/gpu-run.json`` and ``out/gpu-run.md``, each replaced whole."""
    out.mkdir(parents=True, exist_ok=True)
    replace_file(out / "gpu-run.json", json.dumps(finite(report), indent=2) + "\n")
    replace_file(out / "gpu-run.md", markdown(report))


def _num(value: Any, digits: int = 1, scale: float = 1.0) -> str:
    return "" if value is None else f"{scale * value:,.{digits}f}"


def _train_table(train: dict[str, Any]) -> list[str]:
    lines = ["| stage | device | precision | steps | tokens/s | MFU % | peak memory (MB) | train s |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for name, s in train.items():
        lines.append(f"| {name} | {s['device']} | {s['precision']} | {s['steps']} | {_num(s['tokens_per_s'], 0)} | "
                     f"{_num(s['mfu'], 3, 100)} | {_num(s['peak_memory_mb'], 0)} | {_num(s['train_seconds'])} |")
    return lines


def _scores_table(scores: dict[str, dict[str, float]]) -> list[str]:
    tasks = list(dict.fromkeys(t for per in scores.values() for t in per))
    lines = ["| model | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
    for model, per in scores.items():
        lines.append(f"| {model} | " + " | ".join(_num(per.get(t), 2, 100) for t in tasks) + " |")
    return lines


def _gpucheck_lines(check: dict[str, Any]) -> list[str]:
    if check.get("status") != "ok" and not check.get("summary"):
        return [f"Not run or failed: {check.get('error') or check.get('status')}"]
    s = check["summary"]
    lines = [f"ok: {s['ok']}; {check['seconds']} s; errors: {'; '.join(s['errors']) or 'none'}", "",
             "| part | tokens/s | MFU % | peak memory (MB) |", "|---|---:|---:|---:|"]
    for part in ("encoder", "sentence_transformers", "decoder"):
        p = s["parts"].get(part, {})
        lines.append(f"| {part} | {_num(p.get('tokens_per_s'), 0)} | {_num(p.get('mfu'), 2, 100)} | "
                     f"{_num(p.get('peak_memory_mb'), 0)} |")
    lines += ["", f"MiniLM over sentence-transformers' CachedMNRL: {_num(s['st_ratio'], 2)}x; "
                  f"packed over padded: {_num(s['packed_over_padded'], 2)}x; goals: {json.dumps(s['goals'])}"]
    return lines


def markdown(report: dict[str, Any]) -> str:
    m, v = report["machine"], report["versions"]
    lines = [f"# gpu-run ({report['mode']}): {report['status']}", "",
             f"Machine: **{m['device']}** — {m['verdict']}. CPU: {m['cpu']} ({m['cores']} cores; bf16 flags: "
             f"{', '.join(m['cpu_bf16_flags']) or 'none'}).", "",
             "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".", "",
             f"Started {report['started']}, updated {report['updated']}, {report['elapsed_s']} s of a "
             f"{report['budget_s']} s budget. Steps: " + ", ".join(f"{s['name']} {s['status']}" for s in report["steps"]),
             "", "## GPU check", "", *_gpucheck_lines(report["gpucheck"]), "", "## quality.yaml (precision: auto)", ""]
    q = report["quality"]
    if q.get("train"):
        shared = f" (the ablation's {q['shared_with_ablation_run']} reuses it)" if q.get("shared_with_ablation_run") else ""
        lines += [f"`{q['config']}` -> {q['run_dir']}{shared}: {q['status']} in {q['seconds']} s", "",
                  *_train_table(q["train"]),
                  "", *_scores_table(q["scores"]), "", "Targets (final model): " + ", ".join(
                      f"{k} {'met' if t['met'] else 'not met' if t['met'] is False else 'not measured'}"
                      for k, t in q["targets"].items() if k != "all_met")]
    else:
        lines.append(f"{q.get('status', 'not run')}: {q.get('error', '')}")
    a = report["ablation"]
    lines += ["", f"## Ablation ({a.get('config', '')}, seeds {a.get('seeds')})", ""]
    tasks = list(dict.fromkeys(t for r in a["rows"] for t in r.get("scores", {})))
    lines += ["| row | seed | status | s | tokens/s (last stage) | " + " | ".join(tasks) + " |",
              "|---|---:|---|---:|---:|" + "---:|" * len(tasks)]
    for r in a["rows"]:
        last = list(r.get("train", {}).values())[-1:] or [{}]
        lines.append(f"| {r['row']} | {r['seed']} | {r['status']} | {_num(r.get('seconds'))} | "
                     f"{_num(last[0].get('tokens_per_s'), 0)} | " +
                     " | ".join(_num(r.get("scores", {}).get(t), 2, 100) for t in tasks) + " |")
    if a.get("not_started"):
        lines += ["", f"Not started (the time budget or --max-rows): {', '.join(a['not_started'])}"]
    if a.get("report"):
        lines += ["", f"Mean ± spread over the seeds: {a['report']}"]
    return "\n".join(lines) + "\n"

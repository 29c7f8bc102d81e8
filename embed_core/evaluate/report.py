"""Evaluation report: a markdown summary and PNG plots from the results table.

* ``scores.png`` — main score per task, one bar per model (base first, then trained stages);
* ``deltas.png`` — per-task change of each other model against the first (the base);
* ``sizes.png`` — main score against bytes per vector, per task, when the run scored sizes and
  precisions (``embed_core.evaluate.sizes``; the tables are in the report too);
* ``loss_curves.png`` — training loss per step when the run has train-stage metrics
  (``<run_dir>/train-<stage>/metrics.parquet`` with ``step`` and ``loss`` columns).

``compare_runs`` puts several runs' (or result files') main scores side by side, and their sizes
tables (``sizes.parquet`` beside the results) with the same columns.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from embed_core import numbers
from embed_core.artifacts import atomic_write_bytes
from embed_core.plots import pyplot as _plt
from embed_core.plots import to_png as _png
from embed_core.stage_dirs import EVALUATE, stage_name_of, trained_model_dirs


def main_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[str], dict[tuple[str, str], float]]:
    """(models in first-seen order, tasks in first-seen order, (model, task) -> main score)."""
    main = [r for r in rows if r["main"]]
    models = list(dict.fromkeys(r["model"] for r in main))
    tasks = list(dict.fromkeys(r["task"] for r in main))
    values = {(r["model"], r["task"]): r["value"] for r in main}
    return models, tasks, values


def _bars(models: list[str], tasks: list[str], values: dict[tuple[str, str], float], title: str) -> bytes:
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks)), 3.8))
    width = 0.8 / max(1, len(models))
    x = np.arange(len(tasks))
    for i, m in enumerate(models):
        ys = [100 * values.get((m, t), float("nan")) for t in tasks]
        bars = ax.bar(x + i * width - 0.4 + width / 2, ys, width, label=m)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(x, tasks, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("main score × 100")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _png(fig)


def _deltas(models: list[str], tasks: list[str], values: dict[tuple[str, str], float]) -> bytes:
    import numpy as np

    plt = _plt()
    base, others = models[0], models[1:]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks)), 3.5))
    width = 0.8 / max(1, len(others))
    x = np.arange(len(tasks))
    for i, m in enumerate(others):
        ys = [100 * (values.get((m, t), float("nan")) - values.get((base, t), float("nan"))) for t in tasks]
        bars = ax.bar(x + i * width - 0.4 + width / 2, ys, width, label=f"{m} − {base}")
        ax.bar_label(bars, fmt="%+.2f", fontsize=7)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(x, tasks, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("Δ main score × 100")
    ax.set_title(f"change against {base}", fontsize=10)
    ax.legend(fontsize=8)
    return _png(fig)


def training_metrics(run_dir: Path) -> dict[str, pa.Table]:
    out = {}
    paths = sorted((d.parent / "metrics.parquet" for d in trained_model_dirs(run_dir)
                    if (d.parent / "metrics.parquet").exists()), key=lambda p: p.stat().st_mtime)
    for path in paths:
        table = pq.read_table(path)
        if {"step", "loss"} <= set(table.column_names):
            out[stage_name_of(path.parent.name)] = table
    return out


def _loss_curves(curves: dict[str, pa.Table]) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    offset = 0
    for stage, table in curves.items():
        steps = [offset + s for s in table.column("step").to_pylist()]
        ax.plot(steps, table.column("loss").to_pylist(), label=stage, linewidth=1)
        offset = max(steps, default=offset)
    ax.set_xlabel("step (stages concatenated)")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    return _png(fig)


MODELS_PER_TABLE = 3  # score columns of one table: with task and metric, it fits the Prefect UI's artifact panel


def markdown_table(models: list[str], tasks: list[str], values: dict[tuple[str, str], float],
                   metric_of: dict[str, str] | None = None) -> str:
    """The main scores, a row per task; every model after the first shows its change against the
    first in brackets. More than :data:`MODELS_PER_TABLE` models are split into tables of that
    many, each beginning with the first model again (the reference), so no table is too wide to read."""
    reference, others = models[:1], models[1:]
    step = MODELS_PER_TABLE - 1
    groups = [reference + others[i:i + step] for i in range(0, len(others), step)] or [reference]
    return "\n\n".join(_score_table(group, tasks, values, metric_of or {}) for group in groups)


def _score_table(models: list[str], tasks: list[str], values: dict[tuple[str, str], float],
                 metric_of: dict[str, str]) -> str:
    lines = ["| task | metric | " + " | ".join(models) + " |", "|---|---|" + "---:|" * len(models)]
    for t in tasks:
        first = values.get((models[0], t))
        cells = []
        for i, m in enumerate(models):
            value = values.get((m, t))
            change = f" ({numbers.score_change(value - first)})" if i and value is not None and first is not None else ""
            cells.append(numbers.score(value) + change)
        lines.append(f"| {t} | {metric_of.get(t, '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def model_link(path: str, report_dir: Path) -> str:
    """A model's path in the report: a link relative to the report when the model is in the run
    directory (it opens from the report's folder, and the Prefect UI's artifact makes it a link to
    the served file: ``tasks.common``), else the path (or hub id) as text."""
    import os

    run_dir = Path(report_dir).resolve().parent
    target = Path(path)
    if not target.is_absolute() or not target.resolve().is_relative_to(run_dir):
        return f"`{path}`"
    from urllib.parse import quote

    relative = Path(os.path.relpath(target.resolve(), Path(report_dir).resolve())).as_posix()
    return f"[{target.resolve().relative_to(run_dir).as_posix()}]({quote(relative)})"


def geometry_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"## Token geometry ({rows[0]['task']}, {rows[0]['texts']} sentences; CoDiEmb §4)", "",
             "Token similarity ×100 and condition number: lower is better; rank and SVD entropy: higher is better.", "",
             "| model | token similarity | rank | condition number | SVD entropy |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['token_similarity']:.2f} | {r['rank']:.2f} | {r['condition_number']:.1f} | "
              f"{r['svd_entropy']:.3f} |" for r in rows]
    return "\n".join(lines)


def _variant(r: dict[str, Any]) -> str:
    if not r.get("rescore"):
        return r["precision"]
    source = r.get("rescore_with") or "quantized"
    return f"{r['precision']} rescored ×{r['rescore']}" + ("" if source == "quantized" else f" with {source}")


def sizes_tables(rows: list[dict[str, Any]]) -> str:
    """One table per task: the main score by embedding size (rows, per model) × precision (columns),
    each cell with the bytes one vector takes."""
    lines = ["## Scores by embedding size and precision", "",
             "Main score × 100 with the embeddings cut to d dimensions (normalised again) and stored as float32, "
             "int8 or binary (ubinary), and in brackets the bytes one vector takes; how each is computed: "
             "docs/stages.md, 'Sizes and precisions'."]
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        columns = list(dict.fromkeys(_variant(r) for r in mine))
        cell = {(r["model"], r["dim"], _variant(r)): r for r in mine}
        lines += ["", f"### {task} ({mine[0]['metric']})", "", "| model | dims | " + " | ".join(columns) + " |",
                  "|---|---:|" + "---:|" * len(columns)]
        for model, dim in dict.fromkeys((r["model"], r["dim"]) for r in mine):
            lines.append(f"| {model} | {dim} | " + " | ".join(
                f"{numbers.score(c['value'])} ({c['bytes_per_vector']} B)" if (c := cell.get((model, dim, v))) else "–"
                for v in columns) + " |")
    return "\n".join(lines)


def sizes_plot(rows: list[dict[str, Any]]) -> bytes:
    """Main score against bytes per vector (log scale), a panel per task, a line per model and precision."""
    plt = _plt()
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        mine = [r for r in rows if r["task"] == task]
        for model, variant in dict.fromkeys((r["model"], _variant(r)) for r in mine):
            line = sorted((r["bytes_per_vector"], 100 * r["value"], r["dim"]) for r in mine
                          if r["model"] == model and _variant(r) == variant)
            ax.plot([b for b, _, _ in line], [v for _, v, _ in line], marker="o", linewidth=1, label=f"{model} {variant}")
            for b, v, d in line:
                ax.annotate(str(d), (b, v), fontsize=6, textcoords="offset points", xytext=(2, 2))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per vector")
        ax.set_ylabel(f"{mine[0]['metric']} × 100")
        ax.set_title(task, fontsize=10)
        ax.legend(fontsize=6)
    return _png(fig)


def build_report(table: pa.Table, *, run_dir: Path, title: str, geometry: list[dict[str, Any]] | None = None,
                 sizes: list[dict[str, Any]] | None = None) -> tuple[str, dict[str, bytes]]:
    rows = table.to_pylist()
    models, tasks, values = main_table(rows)
    metric_of = {r["task"]: r["metric"] for r in rows if r["main"]}
    plots: dict[str, bytes] = {}
    if tasks:
        plots["scores.png"] = _bars(models, tasks, values, "main score per task")
    if len(models) > 1:
        plots["deltas.png"] = _deltas(models, tasks, values)
    curves = training_metrics(run_dir)
    if curves:
        plots["loss_curves.png"] = _loss_curves(curves)
    paths = {r["model"]: r["model_path"] for r in rows}
    fps = {r["model"]: r["fingerprint"] for r in rows}
    md = [f"# {title}", "", "Scores are mteb's main score per task × 100 (metrics computed by mteb); in brackets, "
          f"the change against {models[0] if models else 'the first model'}.", "",
          markdown_table(models, tasks, values, metric_of), "", "## Models", ""]
    md += [f"- **{m}**: {model_link(paths[m], run_dir / EVALUATE)} (fingerprint `{fps[m]}`)" for m in models]
    if geometry:
        md += ["", geometry_table(geometry)]
    if sizes:
        plots["sizes.png"] = sizes_plot(sizes)
        md += ["", sizes_tables(sizes)]
    md += ["", "## Plots", ""]
    md += [f"![{name}](plots/{name})" for name in plots]
    return "\n".join(md) + "\n", plots


def compare_runs(sources: list[str | Path], out_dir: str | Path) -> Path:
    """Side-by-side main scores of several runs (run dirs or results.parquet files), labelled
    ``<run>/<model>``; writes ``compare.md`` and ``compare.png`` into ``out_dir``."""
    rows: list[dict[str, Any]] = []
    sizes: list[dict[str, Any]] = []
    for src in sources:
        path = Path(src)
        results = path if path.suffix == ".parquet" else path / EVALUATE / "results.parquet"
        if not results.exists():
            raise FileNotFoundError(f"{results}: no evaluation results (run the evaluate stage first)")
        run = results.parent.parent.name if results.parent.name == EVALUATE else results.stem
        for r in _read_results(results):
            rows.append({**r, "model": f"{run}/{r['model']}"})
        sized = results.parent / SIZES_FILE  # the evaluate stage's sizes table beside its results, if any
        sizes += [{**r, "model": f"{run}/{r['model']}"} for r in (pq.read_table(sized).to_pylist() if sized.is_file() else [])]
    models, tasks, values = main_table(rows)
    metric_of = {r["task"]: r["metric"] for r in rows if r["main"]}
    out = _compare_dir(Path(out_dir))
    atomic_write_bytes(out / "compare.png", _bars(models, tasks, values, "main score per task"))
    md = COMPARE_TITLE + "\n\n" + markdown_table(models, tasks, values, metric_of) + "\n\n![compare](compare.png)\n"
    if sizes:
        md += "\n" + sizes_tables(sizes) + "\n"
    atomic_write_bytes(out / "compare.md", md.encode("utf-8"))
    return out / "compare.md"


COMPARE_TITLE = "# embedpipe comparison"
SIZES_FILE = "sizes.parquet"  # embed_core.evaluate.run.SIZES
RESULT_COLUMNS = ("model", "task", "metric", "value", "main")


def _read_results(path: Path) -> list[dict[str, Any]]:
    """The rows of an evaluate stage's results.parquet, or one line saying the file is not one."""
    from embed_core.errors import EmbedpipeError, printable

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise EmbedpipeError(f"{path}: not a readable results file ({printable(exc, 160)}); give a run directory "
                             "or the results.parquet its evaluate stage wrote") from None
    missing = [c for c in RESULT_COLUMNS if c not in table.column_names]
    if missing:
        raise EmbedpipeError(f"{path}: not an evaluate results file (no column {missing[0]!r}); give a run directory "
                             "or the results.parquet its evaluate stage wrote")
    rows = table.to_pylist()
    for row in (r for r in rows if r["main"]):  # a NaN main score (what the table shows) is an error naming its task
        value = row["value"]
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise EmbedpipeError(f"{path}: model {printable(row['model'], 80)}, task {printable(row['task'], 80)}: "
                                 f"{printable(row['metric'], 40)} is {value!r}, not a finite score; run that run's "
                                 "evaluate stage again (--force)")
    return rows


def _compare_dir(out: Path) -> Path:
    """``out``, made if missing; refused when it is a file, or when it holds a compare.md or
    compare.png that ``compare`` did not write (a user's file is never overwritten)."""
    from embed_core.errors import EmbedpipeError

    if out.exists() and not out.is_dir():
        raise EmbedpipeError(f"{out}: --out is a file; give a directory for compare.md and compare.png "
                             "(the file is left as it is)")
    md = out / "compare.md"
    ours = md.is_file() and not md.is_symlink() and md.read_bytes().startswith(COMPARE_TITLE.encode())
    theirs = [out / n for n in ("compare.md", "compare.png") if not ours and ((out / n).exists() or (out / n).is_symlink())]
    if theirs:
        raise EmbedpipeError(f"{theirs[0]}: exists and was not written by embedpipe compare; refusing to overwrite it: "
                             "give another --out directory")
    out.mkdir(parents=True, exist_ok=True)
    return out

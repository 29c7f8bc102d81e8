"""The train stage's plot ``loss.png``: the loss per task, the gradient norm and peak memory per step
(MFU where the device's peak is known) and, with dev evaluation, the dev scores and the kept step."""

from __future__ import annotations

from typing import Any

from embed_core.plots import pyplot, to_png


def loss_plot(rows: list[dict[str, Any]], dev_rows: list[dict[str, Any]] | None = None,
          best: dict[str, Any] | None = None) -> bytes:
    """Training loss per task; gradient norm and peak memory (with MFU where the device's peak is
    known); with dev evaluation, a third panel with the dev scores per task, the selection score
    and the step whose weights were kept."""
    plt = pyplot()
    panels = 3 if dev_rows else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.5), squeeze=False)
    ax = axes[0][0]
    for task in sorted({r["task"] for r in rows}):
        pts = [(r["step"], r["loss"]) for r in rows if r["task"] == task]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", markersize=2, linewidth=0.8, label=task)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    plot_telemetry(axes[0][1], rows)
    if dev_rows:
        ax = axes[0][2]
        for task in dict.fromkeys(r["task"] for r in dev_rows):
            pts = [(r["step"], r["score"]) for r in dev_rows if r["task"] == task]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", markersize=3, linewidth=0.8, label=task)
        steps = sorted({r["step"]: r["selection"] for r in dev_rows}.items())
        ax.plot([s for s, _ in steps], [v for _, v in steps], "k--", linewidth=1, label="selection")
        if best:
            ax.axvline(best["step"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("step")
        ax.set_ylabel("dev main score")
        ax.legend(fontsize=8)
    return to_png(fig)


def plot_telemetry(ax, rows: list[dict[str, Any]]) -> None:
    """Gradient norm (left axis) and peak memory in MB (right axis) per step, MFU in the title."""
    steps = {r["step"]: r for r in rows}  # one point per optimizer step
    xs = sorted(steps)
    norms = [(x, steps[x].get("grad_norm")) for x in xs if steps[x].get("grad_norm") is not None]
    ax.plot([x for x, _ in norms], [v for _, v in norms], ".-", markersize=2, linewidth=0.8, color="C0")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm", color="C0")
    right = ax.twinx()
    mem = [(x, steps[x].get("peak_memory_mb")) for x in xs if steps[x].get("peak_memory_mb") is not None]
    right.plot([x for x, _ in mem], [v for _, v in mem], "-", linewidth=0.8, color="C3")
    right.set_ylabel("peak memory (MB)", color="C3")
    mfu = [steps[x]["mfu"] for x in xs if steps[x].get("mfu") is not None]
    if mfu:
        ax.set_title(f"MFU {100 * sum(mfu) / len(mfu):.1f} % (mean over steps)", fontsize=9)

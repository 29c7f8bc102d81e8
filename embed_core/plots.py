"""Headless matplotlib for the stages' PNG artifacts (mine score histograms, loss curves, reports)."""

from __future__ import annotations

import io


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (workers have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def to_png(fig) -> bytes:
    """Lay out, render and close ``fig``; the PNG bytes (written atomically by the caller)."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    pyplot().close(fig)
    return buf.getvalue()

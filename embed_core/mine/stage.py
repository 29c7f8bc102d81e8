"""The mine stage, as the pipeline sees it: FAISS hard-negative mining (the body is ``run.py``,
the miner ``miner.py``)."""

from __future__ import annotations

from typing import Any

from embed_core.stage_dirs import MINE
from embed_core.manifests import MineManifest
from embed_core.stage_api import Report, Stage, StageContext, body

NAME = MINE
BODY = "embed_core.mine.run"


def format_counts(manifest: MineManifest | dict[str, Any]) -> str:
    """The mine stage's summary (a re-mining step's too: ``RemineManifest`` is a ``MineManifest``)."""
    c = MineManifest.of(manifest).counts
    lines = [f"{'dataset':<22}{'records':>8}{'mined':>7}{'added':>8}{'too_few':>8}{'filtered':>9}  index"]
    for d in c.datasets:
        lines.append(f"{d.dataset:<22}{d.records:>8}{'yes' if d.mined else 'no':>7}"
                     f"{d.negatives_added or 0:>8}{d.too_few or 0:>8}{d.filtered_by_margin or 0:>9}"
                     f"  {(d.index or {}).get('type', '')}")
    sources = [f"{d.dataset} " + ", ".join(f"{k} {v}" for k, v in d.negatives_by_source.items())
               for d in c.datasets if d.negatives_by_source and any(d.negatives_by_source.values())]
    if sources:
        lines.append("negatives by source: " + "; ".join(sources))
    lines.append(f"texts encoded: {c.texts_encoded} (cache holds {c.cache_size})")
    return "\n".join(lines)


def report(ctx: StageContext, manifest: MineManifest | dict[str, Any]) -> Report:
    m = MineManifest.of(manifest)
    rows = [{"dataset": d.dataset, "records": d.records, "mined": d.mined, "negatives_added": d.negatives_added,
             "too_few": d.too_few, "filtered_by_margin": d.filtered_by_margin, "dropped_by_teacher": d.dropped_by_teacher}
            | {"index": (d.index or {}).get("type"), "positive_p50": (d.positive_score or {}).get("p50"),
               "kept_p50": (d.kept_score or {}).get("p50")}
            | {f"negatives_{k}": v for k, v in (d.negatives_by_source or {}).items()} for d in m.counts.datasets]
    plot = "![score histogram](score_hist.png)" if "score_hist.png" in m.outputs else ""
    return Report(markdown=plot, table=rows, table_key=f"{ctx.instance}-stats-",
                  table_description=f"{ctx.instance}: negatives per dataset and score medians")


STAGE = Stage(name=NAME, help="FAISS hard-negative mining (needs prepare's or synthesize's output)",
              enabled=lambda c: c.mine is not None, fingerprint=body(BODY, "input_fingerprint", upstream=True),
              run=body(BODY, "run_mine", upstream=True), summarize=format_counts,
              report=report, produces_records=True, inputs=body(BODY, "input_dirs", upstream=True))

"""The mine stage, as the pipeline sees it: FAISS hard-negative mining (the body is ``run.py``,
the miner ``miner.py``)."""

from __future__ import annotations

from typing import Any

from embed_core.stage_dirs import MINE
from embed_core.stage_api import Report, Stage, StageContext, body

NAME = MINE
BODY = "embed_core.mine.run"


def format_counts(manifest: dict[str, Any]) -> str:
    lines = [f"{'dataset':<22}{'records':>8}{'mined':>7}{'added':>8}{'too_few':>8}{'filtered':>9}  index"]
    for d in manifest["counts"]["datasets"]:
        lines.append(f"{d['dataset']:<22}{d['records']:>8}{'yes' if d['mined'] else 'no':>7}"
                     f"{d.get('negatives_added', 0):>8}{d.get('too_few', 0):>8}{d.get('filtered_by_margin', 0):>9}"
                     f"  {d.get('index', {}).get('type', '')}")
    lines.append(f"texts encoded: {manifest['counts']['texts_encoded']} (cache holds {manifest['counts']['cache_size']})")
    return "\n".join(lines)


def report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    rows = [{k: d.get(k) for k in ("dataset", "records", "mined", "negatives_added", "too_few", "filtered_by_margin",
                                   "dropped_by_teacher")}
            | {"index": (d.get("index") or {}).get("type"), "positive_p50": (d.get("positive_score") or {}).get("p50"),
               "kept_p50": (d.get("kept_score") or {}).get("p50")} for d in manifest["counts"]["datasets"]]
    plot = "![score histogram](score_hist.png)" if "score_hist.png" in manifest.get("outputs", {}) else ""
    return Report(markdown=plot, table=rows, table_key=f"{ctx.instance}-stats-",
                  table_description=f"{ctx.instance}: negatives per dataset and score medians")


STAGE = Stage(name=NAME, help="FAISS hard-negative mining (needs prepare's or synthesize's output)",
              enabled=lambda c: c.mine is not None, fingerprint=body(BODY, "input_fingerprint", upstream=True),
              run=body(BODY, "run_mine", upstream=True), summarize=format_counts,
              report=report, produces_records=True, inputs=body(BODY, "input_dirs", upstream=True))

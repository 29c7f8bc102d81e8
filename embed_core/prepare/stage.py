"""The prepare stage, as the pipeline sees it: raw sources → unified records (the body is
``run.py``; converters, readers and cleaning beside it)."""

from __future__ import annotations

from typing import Any

from embed_core.stage_api import Report, Stage, StageContext, body

NAME = "prepare"
BODY = "embed_core.prepare.run"


def counts_table(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per dataset, for logs and Prefect table artifacts."""
    rows = []
    sources = {s["source"]: s for s in manifest["counts"]["sources"]}
    for d in manifest["counts"]["datasets"]:
        s = sources.get(d["dataset"], {})
        rows.append({"dataset": d["dataset"], "converted": d["records_in"],
                     "quarantined": s.get("quarantined", 0), "skipped": s.get("rows_skipped", 0),
                     "deduped": d["deduped_exact"] + d["deduped_normalized"],
                     "excluded": d["excluded_contamination"], "written": d["written"],
                     "tasks": ", ".join(f"{k}={v}" for k, v in sorted(d["tasks"].items()))})
    for name, s in sources.items():  # sources that produced nothing still show up
        if name not in {r["dataset"] for r in rows}:
            rows.append({"dataset": name, "converted": 0, "quarantined": s["quarantined"],
                         "skipped": s["rows_skipped"], "deduped": 0, "excluded": 0, "written": 0, "tasks": ""})
    return rows


def format_counts(manifest: dict[str, Any]) -> str:
    rows = counts_table(manifest)
    cols = ["dataset", "converted", "quarantined", "skipped", "deduped", "excluded", "written", "tasks"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    t = manifest["counts"]["totals"]
    lines.append(f"total: read {t['rows_read']}, written {t['records_written']}, quarantined {t['quarantined']} "
                 f"{t['quarantined_by_reason'] or ''}, deduped {t['deduped']}, excluded {t['excluded_contamination']}")
    return "\n".join(lines)


def _report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    return Report(table=counts_table(manifest), table_key="prepare-counts-",
                  table_description=f"prepare stage counts for run '{manifest.get('run_name')}'")


STAGE = Stage(name=NAME, help="raw sources → unified records", fingerprint=body(BODY, "input_fingerprint"),
              run=body(BODY, "run_prepare"),
              summarize=format_counts, report=_report, produces_records=True)

"""The prepare stage, as the pipeline sees it: raw sources → unified records (the body is
``run.py``; converters, readers and cleaning beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embed_core.stage_dirs import PREPARE
from embed_core.stage_api import Report, Stage, StageContext, body

NAME = PREPARE
BODY = "embed_core.prepare.run"
NEAR_DUPLICATES_FILE = "_near_duplicates.parquet"  # written by run.py with near_duplicates on
REPORT_ROWS = 5  # near duplicates shown in the stage's markdown report


def _near_on(manifest: dict[str, Any]) -> bool:
    return "excluded_near_duplicate" in manifest["counts"]["totals"]


def counts_table(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per dataset, for logs and Prefect table artifacts."""
    rows = []
    sources = {s["source"]: s for s in manifest["counts"]["sources"]}
    for d in manifest["counts"]["datasets"]:
        s = sources.get(d["dataset"], {})
        rows.append({"dataset": d["dataset"], "converted": d["records_in"],
                     "quarantined": s.get("quarantined", 0), "skipped": s.get("rows_skipped", 0),
                     "deduped": d["deduped_exact"] + d["deduped_normalized"],
                     "excluded": d["excluded_contamination"],
                     **({"near-dup": d["excluded_near_duplicate"]} if "excluded_near_duplicate" in d else {}),
                     "written": d["written"],
                     "tasks": ", ".join(f"{k}={v}" for k, v in sorted(d["tasks"].items()))})
    for name, s in sources.items():  # sources that produced nothing still show up
        if name not in {r["dataset"] for r in rows}:
            rows.append({"dataset": name, "converted": 0, "quarantined": s["quarantined"],
                         "skipped": s["rows_skipped"], "deduped": 0, "excluded": 0,
                         **({"near-dup": 0} if _near_on(manifest) else {}), "written": 0, "tasks": ""})
    return rows


def format_counts(manifest: dict[str, Any]) -> str:
    rows = counts_table(manifest)
    cols = ["dataset", "converted", "quarantined", "skipped", "deduped", "excluded",
            *(["near-dup"] if _near_on(manifest) else []), "written", "tasks"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    t = manifest["counts"]["totals"]
    lines.append(f"total: read {t['rows_read']}, written {t['records_written']}, quarantined {t['quarantined']} "
                 f"{t['quarantined_by_reason'] or ''}, deduped {t['deduped']}, excluded {t['excluded_contamination']}"
                 + (f", near duplicates {t['excluded_near_duplicate']}" if _near_on(manifest) else ""))
    return "\n".join(lines)


def _cell(text: Any, width: int = 80) -> str:
    """A value as one markdown table cell: one line, pipes and HTML escaped, at most ``width`` characters."""
    text = " ".join(str(text).split())
    text = text if len(text) <= width else text[:width - 1] + "…"
    return text.replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|")


def near_duplicates_markdown(stage_dir: Path, manifest: dict[str, Any]) -> str:
    """The first near duplicates prepare dropped, as a markdown table ("" with the option off)."""
    if not _near_on(manifest):
        return ""
    import pyarrow.parquet as pq  # only the report reads the file

    total = manifest["counts"]["totals"]["excluded_near_duplicate"]
    lines = [f"Near duplicates dropped: {total} (all in `{stage_dir / NEAR_DUPLICATES_FILE}`)."]
    if total:
        rows = pq.ParquetFile(stage_dir / NEAR_DUPLICATES_FILE).read_row_group(0).slice(0, REPORT_ROWS).to_pylist()
        lines += ["", "| dataset | source | field | training text | nearest evaluation text | set | Jaccard |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {_cell(r['dataset'])} | {_cell(r['source_ref'])} | {r['field']} | {_cell(r['text'])} | "
                  f"{_cell(r['nearest_text'])} | {_cell(r['contamination_set'])} | {r['jaccard']:.3f} |" for r in rows]
    return "\n".join(lines)


def _report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    return Report(markdown=near_duplicates_markdown(ctx.stage_dir, manifest),
                  table=counts_table(manifest), table_key="prepare-counts-",
                  table_description=f"prepare stage counts for run '{manifest.get('run_name')}'")


STAGE = Stage(name=NAME, help="raw sources → unified records", fingerprint=body(BODY, "input_fingerprint"),
              run=body(BODY, "run_prepare"),
              summarize=format_counts, report=_report, produces_records=True)

"""The prepare stage, as the pipeline sees it: raw sources → unified records (the body is
``run.py``; converters, readers and cleaning beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embed_core.stage_dirs import PREPARE
from embed_core.manifests import PrepareManifest
from embed_core.stage_api import Report, Stage, StageContext, body

NAME = PREPARE
BODY = "embed_core.prepare.run"
NEAR_DUPLICATES_FILE = "_near_duplicates.parquet"  # written by run.py with near_duplicates on
REPORT_ROWS = 5  # near duplicates shown in the stage's markdown report


def counts_table(manifest: PrepareManifest | dict[str, Any]) -> list[dict[str, Any]]:
    """One row per dataset, for logs and Prefect table artifacts."""
    m = PrepareManifest.of(manifest)
    rows = []
    sources = {s.source: s for s in m.counts.sources}
    for d in m.counts.datasets:
        s = sources.get(d.dataset)
        rows.append({"dataset": d.dataset, "converted": d.records_in,
                     "quarantined": s.quarantined if s else 0, "skipped": s.rows_skipped if s else 0,
                     "deduped": d.deduped_exact + d.deduped_normalized,
                     "excluded": d.excluded_contamination,
                     **({"near-dup": d.excluded_near_duplicate} if d.excluded_near_duplicate is not None else {}),
                     "written": d.written,
                     "tasks": ", ".join(f"{k}={v}" for k, v in sorted(d.tasks.items()))})
    for name, s in sources.items():  # a corpus (passages), and sources that produced nothing, show up too
        if name not in {r["dataset"] for r in rows}:
            c = s.corpus
            rows.append({"dataset": name, "converted": s.records_converted if c else 0, "quarantined": s.quarantined,
                         "skipped": s.rows_skipped, "deduped": c.deduped if c else 0,
                         "excluded": c.excluded_contamination if c else 0,
                         **({"near-dup": c.excluded_near_duplicate if c else 0} if m.near_duplicates_on else {}),
                         "written": c.passages if c else 0, "tasks": "corpus passages" if c else ""})
    return rows


def format_counts(manifest: PrepareManifest | dict[str, Any]) -> str:
    m = PrepareManifest.of(manifest)
    rows = counts_table(m)
    cols = ["dataset", "converted", "quarantined", "skipped", "deduped", "excluded",
            *(["near-dup"] if m.near_duplicates_on else []), "written", "tasks"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    t = m.counts.totals
    passages = sum(s.corpus.passages for s in m.counts.sources if s.corpus)
    lines.append(f"total: read {t.rows_read}, written {t.records_written}"
                 + (f" records and {passages} corpus passages" if passages else "") + f", quarantined {t.quarantined} "
                 f"{t.quarantined_by_reason or ''}, deduped {t.deduped}, excluded {t.excluded_contamination}"
                 + (f", near duplicates {t.excluded_near_duplicate}" if m.near_duplicates_on else ""))
    return "\n".join(lines)


def _cell(text: Any, width: int = 80) -> str:
    """A value as one markdown table cell: one line, pipes and HTML escaped, at most ``width`` characters."""
    text = " ".join(str(text).split())
    text = text if len(text) <= width else text[:width - 1] + "…"
    return text.replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|")


def near_duplicates_markdown(stage_dir: Path, manifest: PrepareManifest | dict[str, Any]) -> str:
    """The first near duplicates prepare dropped, as a markdown table ("" with the option off)."""
    m = PrepareManifest.of(manifest)
    if not m.near_duplicates_on:
        return ""
    import pyarrow.parquet as pq  # only the report reads the file

    total = m.counts.totals.excluded_near_duplicate
    lines = [f"Near duplicates dropped: {total} (all in `{stage_dir / NEAR_DUPLICATES_FILE}`)."]
    if total:
        rows = pq.ParquetFile(stage_dir / NEAR_DUPLICATES_FILE).read_row_group(0).slice(0, REPORT_ROWS).to_pylist()
        lines += ["", "| dataset | source | field | training text | nearest evaluation text | set | Jaccard |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {_cell(r['dataset'])} | {_cell(r['source_ref'])} | {r['field']} | {_cell(r['text'])} | "
                  f"{_cell(r['nearest_text'])} | {_cell(r['contamination_set'])} | {r['jaccard']:.3f} |" for r in rows]
    return "\n".join(lines)


def _report(ctx: StageContext, manifest: dict[str, Any]) -> Report:
    m = PrepareManifest.of(manifest)
    return Report(markdown=near_duplicates_markdown(ctx.stage_dir, m),
                  table=counts_table(m), table_key="prepare-counts-",
                  table_description=f"prepare stage counts for run '{m.run_name}'")


STAGE = Stage(name=NAME, help="raw sources → unified records", fingerprint=body(BODY, "input_fingerprint"),
              run=body(BODY, "run_prepare"),
              summarize=format_counts, report=_report, produces_records=True)

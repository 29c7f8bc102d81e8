"""Helpers shared by the stage tasks: the per-stage and per-run artifacts on the Prefect UI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

from embed_core.errors import ConfigError, RowError
from embed_core.manifests import MANIFEST, Manifest
from embed_core.stage_api import Report


def artifact_key(prefix: str, run_name: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return (prefix + "".join(c if c.isalnum() else "-" for c in run_name.lower()))[:100]


def served_url(path: Path) -> str | None:
    """The http URL of ``path`` when the run directories are served (``EMBEDPIPE_FILES_URL`` for
    the directory ``EMBEDPIPE_FILES_ROOT``; `make serve` starts such a server on loopback) and
    ``path`` is under that directory, else None."""
    base, root = os.environ.get("EMBEDPIPE_FILES_URL"), os.environ.get("EMBEDPIPE_FILES_ROOT")
    path = Path(path).resolve()
    if base and root and path.is_relative_to(Path(root).resolve()):
        return f"{base.rstrip('/')}/{quote(path.relative_to(Path(root).resolve()).as_posix())}"
    return None


def file_link(path: Path, label: str) -> str:
    """A link a browser follows from the Prefect UI (``served_url``), else the path as text (a
    ``file://`` link from a web page opens nothing)."""
    url = served_url(path)
    return f"[{label}]({url})" if url else f"{label} `{Path(path).resolve()}`"


def files_note(run_dir: Path) -> str:
    """Why the files on an outputs page are not links, and how to make them links; "" when they are."""
    if served_url(run_dir) is not None:
        return ""
    root = os.environ.get("EMBEDPIPE_FILES_ROOT")
    if os.environ.get("EMBEDPIPE_FILES_URL") and root:
        return (f"> Files are not linked: this run directory is outside the folder the file server serves "
                f"(`{Path(root).resolve()}`). Start it on a folder that holds the run: "
                f"`make serve FILES_ROOT={Path(run_dir).resolve().parent}`.\n\n")
    return ("> Files are not linked: no file server serves the run directories to the browser "
            "(`make serve` starts one; `make serve FILES_ROOT=DIR` serves DIR).\n\n")


def fit_lines(text: str, width: int = 100) -> str:
    """``text`` with every line longer than ``width`` wrapped (continuations indented): a code block
    on the UI's artifact page does not wrap, and a long path would push it past the panel."""
    import textwrap

    out = []
    for line in text.splitlines():
        out += textwrap.wrap(line, width, subsequent_indent="    ", break_on_hyphens=False) or [""]
    return "\n".join(out)


def publish_stage_outputs(stage: str, manifest: dict[str, Any], run_dir: str, cached: bool, summary: str,
                          seconds: float, report: Report, run_name: str) -> None:
    """One markdown artifact per stage run, cache hit or not, so the UI's run page lists what every
    stage produced (file links, rows, hashes), whether it was recomputed, its summary and plots;
    plus the stage's table, when it has one."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    root = Path(run_dir).resolve() / stage
    committed = Manifest.of(manifest, root / MANIFEST)
    rows = []
    for name, info in sorted(committed.outputs.items()):
        if "/" in name and not name.startswith("model/config"):
            continue  # model shards etc.: the model directory is linked once below
        rows.append(f"| {file_link(root / name, name)} | {info.kind} | {'' if info.rows is None else info.rows} "
                    f"| `{info.sha256[:12]}` |")
    if (root / "model").is_dir():
        rows.append(f"| {file_link(root / 'model', 'model/')} | model | | |")
    state = "cache hit — nothing recomputed" if cached else f"computed in {seconds:.1f} s"
    md = (f"# {stage}: {state}\n\nRun `{run_name}` in {file_link(Path(run_dir), Path(run_dir).name)} · input "
          f"fingerprint `{committed.input_fingerprint[:12]}` · produced {committed.created_at}\n\n"
          + files_note(Path(run_dir)) +
          f"| file | kind | rows | sha256 |\n|---|---|---|---|\n" + "\n".join(rows) +
          f"\n\n```\n{fit_lines(summary)}\n```\n\n" + inline_images(linked_files(report.markdown, root), root) + "\n")
    key = artifact_key(report.markdown_key or f"{stage}-outputs-", run_name)
    create_markdown_artifact(key=key, markdown=md, description=f"{stage} of run {run_name}: files, summary"
                             f"{' and report' if report.markdown else ''} ({'cache hit' if cached else 'computed'})")
    if report.table_key and report.table:
        create_table_artifact(key=artifact_key(report.table_key, run_name), table=report.table,
                              description=report.table_description)


def publish_run_summary(run_name: str, run_dir: str, results: dict[str, dict[str, Any]]) -> None:
    """One table per pipeline run: every stage, computed or cache hit, and how long it took."""
    from prefect.artifacts import create_table_artifact

    rows = [{"stage": name, "result": "cache hit" if r["cached"] else "computed", "seconds": r.get("seconds"),
             "work_pool": r.get("work_pool", "this run's"),
             "input_fingerprint": Manifest.of(r["manifest"]).input_fingerprint[:12],
             "path": str(Path(run_dir).resolve() / name)} for name, r in results.items()]
    create_table_artifact(key=artifact_key("pipeline-stages-", run_name), table=rows,
                          description=f"pipeline '{run_name}': what each stage did in this run")


def linked_files(markdown: str, base_dir: Path) -> str:
    """Replace a link to a file or folder relative to ``base_dir`` (``[label](../train-stage2/model)``,
    as a report links its models) by :func:`file_link`'s: the served URL, which opens from the UI,
    else the label and the absolute path as text."""
    import re
    from urllib.parse import unquote

    def link(match: re.Match) -> str:
        label, ref = match.group(1), match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:|^[#/]", ref) or not (Path(base_dir) / unquote(ref)).exists():
            return match.group(0)
        return file_link(Path(base_dir) / unquote(ref), label)

    return re.sub(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)", link, markdown)


def inline_images(markdown: str, base_dir: Path, max_bytes: int = 400_000) -> str:
    """Replace ``![alt](relative.png)`` by a data URI of the file under ``base_dir``, so the plots
    show on the Prefect UI's artifact page (a browser cannot load the run directory's files)."""
    import base64
    import re

    def embed(match: re.Match) -> str:
        alt, ref = match.group(1), match.group(2)
        path = Path(base_dir) / ref
        if ref.startswith(("data:", "http:", "https:")) or not path.is_file() or path.stat().st_size > max_bytes:
            return match.group(0)
        return f"![{alt}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"

    return re.sub(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)", embed, markdown)


def no_retry_on_input_errors(task: Any, task_run: Any, state: Any) -> bool:
    """A task's ``retry_condition_fn``: a bad config or a bad input row fails the same way on every
    try, so it is not retried; anything else may pass on a retry (an LLM server that was down)."""
    exc = state.result(raise_on_failure=False)
    return not isinstance(exc, (ConfigError, RowError))

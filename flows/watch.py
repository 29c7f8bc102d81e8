"""The data-watch flow: a scheduled deployment runs it (cron in ``deployments/prefect.yaml``).

It fingerprints every configured source by content, emits ``embedpipe.source.changed`` for each
source that changed since the last watch of this run directory, and runs the pipeline. Stages
whose inputs did not change are cache hits, so an unchanged run finishes quickly and a changed
source recomputes only the stages that read it (directly or through an upstream output).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from embed_core.runs.watch import record_sources, watch_report
from flows.failures import reports_user_errors
from flows.params import DEFAULT_CONFIG, flow_run_name, resolve_run, run_context, with_run_args_doc
from flows.pipeline import pipeline_flow
from tasks.common import artifact_key
from tasks.watch import emit_source_events, fingerprint_sources_task


@flow(name="data-watch", log_prints=True, flow_run_name=flow_run_name)
@reports_user_errors
@with_run_args_doc
def data_watch_flow(config_path: str | None = DEFAULT_CONFIG, config: dict[str, Any] | None = None,
                    run_name: str | None = None, run_dir: str | None = None,
                    run_pipeline: bool = True) -> dict[str, Any]:
    """Re-run the pipeline when the data changed (and only the stages the change reaches).

    Args:
        {run_args}
        run_pipeline: run the pipeline here (default); off = only detect and emit events, for a
            pipeline deployment with a trigger on ``embedpipe.source.changed``.
    """
    t0 = time.perf_counter()
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    cached: dict[str, bool] | None = None
    with run_context(cfg, rdir, "data-watch"):
        found = fingerprint_sources_task(cfg, rdir)
        emit_source_events(found["changes"], cfg, config_path if not config else None, rdir)
        if run_pipeline:
            results = pipeline_flow(config_path=None, config=cfg.model_dump(mode="json"), run_dir=rdir)
            cached = {name: r["cached"] for name, r in results.items()}
        # Recorded after the pipeline succeeded: a failed run reports the same change next time.
        record_sources(rdir, found["current"])
    seconds = round(time.perf_counter() - t0, 1)
    report = watch_report(cfg.run_name, found["changes"], cached, seconds)
    print(report.verdict)
    create_markdown_artifact(key=artifact_key("data-watch-", cfg.run_name), markdown=report.markdown,
                             description="data-watch: which sources changed and what the pipeline recomputed")
    return {"run_dir": rdir, "changes": found["changes"], "stages": report.stages, "all_cached": report.all_cached,
            "verdict": report.verdict, "seconds": seconds}

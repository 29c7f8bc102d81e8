"""The end-to-end pipeline flow: every stage the registry lists and the config enables, in order
(``embed_core.stages``); stages whose inputs did not change are cache hits."""

from __future__ import annotations

from typing import Any

from prefect import flow

from embed_core import stages as registry
from embed_core.config import RunConfig
from embed_core.errors import ConfigError
from flows.params import DEFAULT_CONFIG, resolve_run, run_context
from tasks.common import publish_run_summary
from tasks.stage import run_stage_instance


@flow(name="pipeline", log_prints=True)
def pipeline_flow(config_path: str = DEFAULT_CONFIG, run_dir: str | None = None,
                  config: RunConfig | None = None, run_name: str | None = None,
                  stages: list[str] | None = None) -> dict[str, Any]:
    """Run the pipeline end to end; stages whose inputs did not change are cache hits.

    Args:
        config_path: YAML run config (ignored when ``config`` is given).
        run_dir: output run directory; defaults to ``<run_root>/<run_name>``.
        config: inline run config.
        run_name: overrides the config's ``run_name`` (and so the default run directory).
        stages: subset of stages to run, by name (default: all that the config enables).
    """
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    known = [s.name for s in registry.STAGES]
    unknown = sorted(set(stages or ()) - set(known))
    if unknown:
        raise ConfigError(f"pipeline: unknown stage {unknown[0]!r} (stages: {', '.join(known)})")
    results: dict[str, Any] = {}
    with run_context(cfg, rdir, "pipeline"):
        for stage, instance in registry.pipeline_instances(cfg):
            if stages is None or stage.name in stages:
                results[instance] = run_stage_instance(stage, cfg, rdir, instance, stage.options_for_pipeline(cfg))
        publish_run_summary(cfg.run_name, rdir, results)
    return results

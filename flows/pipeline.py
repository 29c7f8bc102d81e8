"""The end-to-end pipeline flow: every stage the registry lists and the config enables, in order
(``embed_core.stages``); stages whose inputs did not change are cache hits."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.logging import get_run_logger

from embed_core import stages as registry
from embed_core.config import RunConfig
from embed_core.errors import ConfigError
from flows.params import DEFAULT_CONFIG, flow_run_name, resolve_run, run_context
from flows.stage import run_stage_on_pool
from tasks.common import publish_run_summary
from tasks.stage import run_stage_instance


@flow(name="pipeline", log_prints=True, flow_run_name=flow_run_name)
def pipeline_flow(config_path: str = DEFAULT_CONFIG, run_dir: str | None = None,
                  config: RunConfig | None = None, run_name: str | None = None,
                  stages: list[str] | None = None, force: bool = False) -> dict[str, Any]:
    """Run the pipeline end to end; stages whose inputs did not change are cache hits.

    When it runs as a deployment and the config names ``train.work_pool``, the training stages
    run as a child flow run of the train flow's deployment on that pool (the GPU pool) and this
    run waits for them; evaluation then reads the models they wrote to the shared run directory.

    Args:
        config_path: YAML run config (ignored when ``config`` is given).
        run_dir: output run directory; defaults to ``<run_root>/<run_name>``.
        config: inline run config.
        run_name: overrides the config's ``run_name`` (and so the default run directory).
        stages: subset of stages to run, by name (default: all that the config enables).
        force: recompute every stage even when its inputs are unchanged.
    """
    from prefect.runtime import deployment, flow_run
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    known = [s.name for s in registry.all_stages()]
    unknown = sorted(set(stages or ()) - set(known))
    if unknown:
        raise ConfigError(f"pipeline: unknown stage {unknown[0]!r} (stages: {', '.join(known)})")
    results: dict[str, Any] = {}
    pool = cfg.train.work_pool if cfg.train is not None else None
    if pool and not (deployment.id or flow_run.parent_deployment_id):
        get_run_logger().info("train.work_pool is %r, but this pipeline does not run as a deployment (CLI): "
                              "training runs in this process", pool)
        pool = None
    with run_context(cfg, rdir, "pipeline"):
        for stage in registry.enabled_stages(cfg):
            if stages is not None and stage.name not in stages:
                continue
            options = stage.options_for_pipeline(cfg)
            if stage.name == "train" and pool:
                results.update(run_stage_on_pool(stage, cfg, rdir, pool, options, force))
                continue
            for instance in stage.instance_names(cfg, options):
                results[instance] = run_stage_instance(stage, cfg, rdir, instance, options, force)
        publish_run_summary(cfg.run_name, rdir, results)
    return results

"""The end-to-end pipeline flow: every stage the registry lists and the config enables, in order
(``embed_core.stages``); stages whose inputs did not change are cache hits."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.logging import get_run_logger

from embed_core import stages as registry
from embed_core.errors import ConfigError
from embed_core.stage_dirs import GATE, TRAIN
from flows.failures import reports_user_errors
from flows.release import settle_release
from flows.params import DEFAULT_CONFIG, flow_run_name, resolve_run, run_context, with_corpus_path, with_run_args_doc
from flows.stage import all_fresh, run_stage_on_pool
from tasks.common import publish_run_summary
from tasks.stage import run_stage_instance


@flow(name="pipeline", log_prints=True, flow_run_name=flow_run_name)
@reports_user_errors
@with_run_args_doc
def pipeline_flow(config_path: str | None = DEFAULT_CONFIG, config: dict[str, Any] | None = None,
                  run_name: str | None = None, run_dir: str | None = None,
                  stages: list[str] | None = None, force: bool = False,
                  corpus_path: str | None = None) -> dict[str, Any]:
    """Run the pipeline end to end; stages whose inputs did not change are cache hits.

    When it runs as a deployment and the config names ``train.work_pool``, the training stages
    run as a child flow run of the train flow's deployment on that pool (the GPU pool); this run
    follows it (its link, progress and end) and evaluation then reads the models it wrote to the
    shared run directory. When every training stage is fresh, nothing is sent there.

    Args:
        {run_args}
        stages: subset of stages to run, by name (default: all that the config enables).
        force: recompute every stage even when its inputs are unchanged.
        corpus_path: a folder (or file) of documents for the config's one corpus source (kind corpus), e.g. with config_path deployments/configs/corpus.yaml: relative to data_root, or absolute (a path on the worker). Refused when the config has no or several corpus sources.
    """
    from prefect.runtime import deployment, flow_run
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    cfg = with_corpus_path(cfg, corpus_path)
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
            if stage.name == TRAIN and pool:
                if not all_fresh(stage, cfg, rdir, options, force):
                    results.update(run_stage_on_pool(stage, cfg, rdir, pool, options, force))
                    continue
                get_run_logger().info("every training stage is fresh: nothing to send to work pool %s", pool)
            for instance in stage.instance_names(cfg, options):
                results[instance] = run_stage_instance(stage, cfg, rdir, instance, options, force)
            if stage.name == GATE:  # after a cache hit too: a run stopped before settling finishes it here
                settle_release(cfg, rdir)
        publish_run_summary(cfg.run_name, rdir, results)
    return results

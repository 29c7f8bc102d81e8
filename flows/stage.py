"""One Prefect flow per registered stage, made by one factory: ``prepare_flow``, ``synthesize_flow``,
``mine_flow``, ``train_flow``, ``evaluate_flow`` (the deployments' entrypoints) and any stage
registered later (``stage_flow(name)``).

Every stage flow takes the same parameters — a config (file or inline), the run directory, a run
name, ``force`` — plus the stage's own ``options`` (a typed model the UI renders as a sub-form:
``TrainOptions``, ``EvaluateOptions``). It returns ``{instance: result}`` for every stage
directory it ran (train: one per training stage).
"""

# No `from __future__ import annotations`: Prefect builds the UI form from the real annotation
# objects of the generated functions (the options class differs per stage).

import functools
from pathlib import Path
from typing import Any

from prefect import Flow, flow

from embed_core import stages
from embed_core.artifacts import read_manifest
from embed_core.config import RunConfig
from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.rundir import load_config_snapshot, lock_token, read_history
from embed_core.stage_api import Stage
from flows.params import DEFAULT_CONFIG, flow_run_name, resolve_run, run_context
from tasks.stage import run_stage_instance


def run_stage(stage: Stage, config: RunConfig, run_dir: str, options: Any = None,
              force: bool = False) -> dict[str, dict[str, Any]]:
    options = options if options is not None else stage.options()
    return {inst: run_stage_instance(stage, config, run_dir, inst, options, force)
            for inst in stage.instance_names(config, options)}


@functools.cache
def stage_flow(name: str) -> Flow:
    stage = stages.get(name)
    Options = stage.options  # noqa: N806 (a class)

    def run_one_stage(config_path: str = DEFAULT_CONFIG, run_dir: str | None = None, config: RunConfig | None = None,
                      run_name: str | None = None, force: bool = False, options: Options | None = None,
                      parent_lock: str | None = None) -> dict[str, dict[str, Any]]:
        cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
        with run_context(cfg, rdir, name, parent_lock):
            return run_stage(stage, cfg, rdir, options, force)

    run_one_stage.__doc__ = f"""Run the {name} stage: {stage.help}.

    Args:
        config_path: YAML run config (ignored when ``config`` is given).
        run_dir: run directory; defaults to ``<run_root>/<run_name>``.
        config: inline run config, as an alternative to ``config_path``.
        run_name: overrides the config's ``run_name`` (and so the default run directory).
        force: recompute even when the inputs are unchanged (a cache hit otherwise).
        options: options of this stage ({Options.__name__}).
        parent_lock: set by a pipeline that runs this stage on another work pool (its flow run id,
            under which it holds the run directory's lock); leave empty otherwise.
    """
    return flow(name=name, log_prints=True, flow_run_name=flow_run_name)(run_one_stage)


def deployment_on_pool(flow_name: str, pool: str) -> str:
    """``<flow>/<deployment>`` of the deployment that runs ``flow_name`` on work pool ``pool``."""
    import asyncio

    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, WorkPoolFilter, WorkPoolFilterName

    async def find() -> list:
        async with get_client() as client:
            return await client.read_deployments(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))

    found = asyncio.run(find())
    if not found:
        raise ConfigError(f"train.work_pool: no deployment of the {flow_name} flow on work pool {pool!r}; deploy "
                          "deployments/prefect.yaml (make serve) or set train.work_pool: null to train in-process")
    return f"{flow_name}/{found[0].name}"


def run_stage_on_pool(stage: Stage, config: RunConfig, run_dir: str, pool: str, options: Any = None,
                      force: bool = False) -> dict[str, dict[str, Any]]:
    """Run ``stage`` as a child flow run of its deployment on ``pool`` (e.g. training on the GPU
    pool) and wait for it; it works in the same run directory under this run's lock, and its
    results are read back from the run directory (history and manifests)."""
    from prefect.deployments import run_deployment
    from prefect.logging import get_run_logger

    options = options if options is not None else stage.options()
    token = lock_token(run_dir)  # the lock this run works under (its own, or a data watch's around it)
    if token is None:
        raise EmbedpipeError(f"{run_dir}: its lock carries no run token, so no run on another pool can work under it")
    target = deployment_on_pool(stage.name, pool)
    snapshot = load_config_snapshot(run_dir)  # absolute data_root / run_root: valid on the other worker
    child = run_deployment(target, timeout=None, poll_interval=2, parameters={
        "config": snapshot.model_dump(mode="json"), "run_dir": str(Path(run_dir).resolve()), "force": force,
        "options": options.model_dump(mode="json"), "parent_lock": token})
    get_run_logger().info("%s ran on work pool %s as flow run %s: %s", stage.name, pool, child.name, child.state.type)
    if not child.state.is_completed():
        raise EmbedpipeError(f"{stage.name} on work pool {pool!r}: flow run {child.name} ended {child.state.type.value}")
    last = {entry.get("stage"): entry for entry in read_history(run_dir)}
    results = {}
    for instance in stage.instance_names(config, options):
        manifest = read_manifest(Path(run_dir), instance)
        if manifest is None:
            raise EmbedpipeError(f"{Path(run_dir) / instance}: flow run {child.name} on {pool!r} left no manifest")
        results[instance] = {"stage": instance, "cached": bool(last.get(instance, {}).get("cached")),
                             "seconds": last.get(instance, {}).get("seconds"), "run_dir": run_dir,
                             "manifest": manifest, "summary": stage.summarize(manifest),
                             "work_pool": pool, "flow_run": str(child.id)}
    return results


prepare_flow = stage_flow("prepare")
synthesize_flow = stage_flow("synthesize")
mine_flow = stage_flow("mine")
train_flow = stage_flow("train")
evaluate_flow = stage_flow("evaluate")

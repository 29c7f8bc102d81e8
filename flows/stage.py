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
import logging
import time
from pathlib import Path
from typing import Any

from prefect import Flow, flow
from pydantic.json_schema import SkipJsonSchema

from embed_core import stages
from embed_core.artifacts import read_manifest
from embed_core.config import RunConfig
from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.manifests import StageResult, stage_result
from embed_core.rundir import lock_token, portable_config, read_history
from embed_core.stage_api import Stage
from embed_core.stage_dirs import EVALUATE, MINE, PREPARE, SYNTHESIZE, TRAIN
from flows.failures import reports_user_errors
from flows.params import DEFAULT_CONFIG, flow_run_name, resolve_run, run_context, with_run_args_doc
from tasks.stage import run_stage_instance


def run_stage(stage: Stage, config: RunConfig, run_dir: str, options: Any = None,
              force: bool = False) -> dict[str, StageResult]:
    options = options if options is not None else stage.options()
    return {inst: run_stage_instance(stage, config, run_dir, inst, options, force)
            for inst in stage.instance_names(config, options)}


@functools.cache
def stage_flow(name: str) -> Flow:
    stage = stages.get(name)
    Options = stage.options  # noqa: N806 (a class)

    def run_one_stage(config_path: str | None = DEFAULT_CONFIG, config: dict[str, Any] | None = None,
                      run_name: str | None = None, run_dir: str | None = None, force: bool = False,
                      options: Options | None = None,
                      parent_lock: SkipJsonSchema[str | None] = None) -> dict[str, dict[str, Any]]:
        cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
        with run_context(cfg, rdir, name, parent_lock):
            return run_stage(stage, cfg, rdir, options, force)

    run_one_stage.__doc__ = f"""Run the {name} stage: {stage.help}.

    Args:
        {{run_args}}
        force: recompute even when the inputs are unchanged (a cache hit otherwise).
        options: options of this stage ({Options.__name__}).
        parent_lock: set by a pipeline that runs this stage on another work pool (its flow run id,
            under which it holds the run directory's lock); internal, so not in the deployment's
            form (``SkipJsonSchema``: the parameter schema leaves it out, the run still takes it).
    """
    return flow(name=name, log_prints=True, flow_run_name=flow_run_name)(
        reports_user_errors(with_run_args_doc(run_one_stage)))


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


def all_fresh(stage: Stage, config: RunConfig, run_dir: str, options: Any = None, force: bool = False) -> bool:
    """Whether every instance of ``stage`` would be a cache hit: then there is nothing to send to
    another work pool (a child run there would only find the artifacts intact)."""
    options = options if options is not None else stage.options()
    return not force and all(stages.cache_decision(stage, stages.context(config, run_dir, stage, inst, options), False)[1]
                             for inst in stage.instance_names(config, options))


def run_stage_on_pool(stage: Stage, config: RunConfig, run_dir: str, pool: str, options: Any = None,
                      force: bool = False) -> dict[str, dict[str, Any]]:
    """Run ``stage`` as a child flow run of its deployment on ``pool`` (e.g. training on the GPU
    pool), following it in this run's logs (its name and link, its progress, its end in words);
    it works in the same run directory under this run's lock, and its results are read back from
    the run directory (history and manifests)."""
    from prefect.deployments import run_deployment
    from prefect.logging import get_run_logger

    options = options if options is not None else stage.options()
    token = lock_token(run_dir)  # the lock this run works under (its own, or a data watch's around it)
    if token is None:
        raise EmbedpipeError(f"{run_dir}: its lock carries no run token, so no run on another pool can work under it")
    target = deployment_on_pool(stage.name, pool)
    logger = get_run_logger()
    child = run_deployment(target, timeout=0, flow_run_name=config.run_name, parameters={  # the whole config
        "config_path": None, "config": portable_config(config), "run_dir": str(Path(run_dir).resolve()),
        "force": force, "options": options.model_dump(mode="json"), "parent_lock": token})
    where = f"flow run {child.name} ({flow_run_link(child.id)})"
    logger.info("%s: sent to work pool %s as %s; its progress follows", stage.name, pool, where)
    child = follow_flow_run(child.id, logger)
    if not child.state.is_completed():
        reason = child.state.message or child.state.type.value.lower()
        raise EmbedpipeError(f"{stage.name} on work pool {pool!r}, {where}, ended {child.state.name.lower()}: {reason}")
    logger.info("%s: %s on work pool %s completed", stage.name, where, pool)
    return _results_from_run_dir(stage, config, run_dir, options, pool, child)


def _results_from_run_dir(stage: Stage, config: RunConfig, run_dir: str, options: Any, pool: str,
                          child: Any) -> dict[str, StageResult]:
    last = {entry.get("stage"): entry for entry in read_history(run_dir)}
    results = {}
    for instance in stage.instance_names(config, options):
        manifest = read_manifest(Path(run_dir), instance)
        if manifest is None:
            raise EmbedpipeError(f"{Path(run_dir) / instance}: flow run {child.name} on {pool!r} left no manifest")
        results[instance] = stage_result(instance, manifest, cached=bool(last.get(instance, {}).get("cached")),
                                         seconds=last.get(instance, {}).get("seconds"), run_dir=run_dir,
                                         summary=stage.summarize(manifest), work_pool=pool, flow_run=str(child.id))
    return results


def flow_run_link(flow_run_id: Any) -> str:
    """The flow run's page on the Prefect UI (``PREFECT_UI_URL``), else its id."""
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui else f"id {flow_run_id}"


def follow_flow_run(flow_run_id: Any, logger: Any, poll_s: float = 2.0, tail_s: float = 15.0) -> Any:
    """Wait for a flow run to end, repeating in ``logger`` what its stages say as it arrives (the
    library's lines and the stage summaries; the worker's own lines stay on its page, and its ERROR
    line becomes this run's error: it is the run's state message). Returns the run."""
    from prefect import get_client

    seen: set = set()
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        while not (run.state is not None and run.state.is_final()):
            _repeat(_new_logs(client, flow_run_id, seen), run.name, logger)
            time.sleep(poll_s)
            run = client.read_flow_run(flow_run_id)
        deadline = time.monotonic() + tail_s  # its last lines reach the server after its final state
        while True:
            logs = _new_logs(client, flow_run_id, seen)
            _repeat(logs, run.name, logger)
            if any(log.task_run_id is None and log.message.startswith("Finished in state") for log in logs) \
                    or time.monotonic() > deadline:
                return run
            time.sleep(min(poll_s, 0.5))


def _repeat(logs: list, name: str, logger: Any) -> None:
    for log in logs:
        said_by_stage = log.name.startswith("embedpipe") or (
            log.name == "prefect.task_runs" and not log.message.startswith("Finished in state"))
        if said_by_stage and logging.INFO <= log.level < logging.ERROR:
            logger.log(log.level, "[%s] %s", name, log.message)


def _new_logs(client: Any, flow_run_id: Any, seen: set) -> list:
    """The run's logs not returned before, oldest first (pages of 200; a late batch is still read)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    out, offset = [], 0
    while True:
        page = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200,
                                offset=offset, sort=LogSort.TIMESTAMP_ASC)
        out += [log for log in page if log.id not in seen]
        if len(page) < 200:
            break
        offset += len(page)
    seen.update(log.id for log in out)
    return out


prepare_flow = stage_flow(PREPARE)
synthesize_flow = stage_flow(SYNTHESIZE)
mine_flow = stage_flow(MINE)
train_flow = stage_flow(TRAIN)
evaluate_flow = stage_flow(EVALUATE)

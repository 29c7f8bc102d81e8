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
from typing import Any

from prefect import Flow, flow

from embed_core import stages
from embed_core.config import RunConfig
from flows.params import DEFAULT_CONFIG, resolve_run, run_context
from tasks.stage import run_stage_instance


def run_stage(stage: stages.Stage, config: RunConfig, run_dir: str, options: Any = None,
              force: bool = False) -> dict[str, dict[str, Any]]:
    options = options if options is not None else stage.options()
    return {inst: run_stage_instance(stage, config, run_dir, inst, options, force)
            for inst in stage.instance_names(config, options)}


@functools.cache
def stage_flow(name: str) -> Flow:
    stage = stages.get(name)
    Options = stage.options  # noqa: N806 (a class)

    def run_one_stage(config_path: str = DEFAULT_CONFIG, run_dir: str | None = None, config: RunConfig | None = None,
                      run_name: str | None = None, force: bool = False,
                      options: Options | None = None) -> dict[str, dict[str, Any]]:
        cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
        with run_context(cfg, rdir, name):
            return run_stage(stage, cfg, rdir, options, force)

    run_one_stage.__doc__ = f"""Run the {name} stage: {stage.help}.

    Args:
        config_path: YAML run config (ignored when ``config`` is given).
        run_dir: run directory; defaults to ``<run_root>/<run_name>``.
        config: inline run config, as an alternative to ``config_path``.
        run_name: overrides the config's ``run_name`` (and so the default run directory).
        force: recompute even when the inputs are unchanged (a cache hit otherwise).
        options: options of this stage ({Options.__name__}).
    """
    return flow(name=name, log_prints=True)(run_one_stage)


prepare_flow = stage_flow("prepare")
synthesize_flow = stage_flow("synthesize")
mine_flow = stage_flow("mine")
train_flow = stage_flow("train")
evaluate_flow = stage_flow("evaluate")

"""The sweep flow: the run's upstream stages (cache hits when unchanged), every variant of the swept
train stage (``embed_core.runs.sweep``), the winner's test evaluation, and the sweep report."""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.task_runners import ProcessPoolTaskRunner

from embed_core import stages as registry
from embed_core.runs import sweep
from embed_core.procs import descendants, kill_all, own_session_dying_with_parent
from embed_core.config import RunConfig
from embed_core.stage_dirs import EVALUATE, TRAIN, instance_name
from embed_core.manifests import SweepManifest
from flows.failures import reports_user_errors
from flows.params import DEFAULT_CONFIG, flow_run_name, resolve_run, run_context, with_run_args_doc
from tasks.stage import run_stage_instance
from tasks.sweep import train_variant


@flow(name="sweep", log_prints=True, flow_run_name=flow_run_name)
@reports_user_errors
@with_run_args_doc
def sweep_flow(config_path: str | None = DEFAULT_CONFIG, config: dict[str, Any] | None = None,
               run_name: str | None = None, run_dir: str | None = None, force: bool = False) -> dict[str, Any]:
    """Train every variant of ``sweep.stage`` (``sweep.max_concurrency`` at once, each in its own
    process, which dies with this one), pick the best on dev, evaluate it on the test tasks, write
    ``sweep-{stage}/``. The config needs a ``sweep`` section.

    Args:
        {run_args}
        force: retrain every variant even when its inputs are unchanged.
    """
    cfg, rdir = resolve_run(config_path, config, run_dir, run_name)
    variants = sweep.variants(cfg)
    base = variants[0][2]
    with run_context(cfg, rdir, "sweep"):
        upstream: dict[str, Any] = {}
        # what the variants read: the stages before train (prepare, synthesize, mine), then earlier train stages
        for stage in itertools.takewhile(lambda s: s.name != TRAIN, registry.enabled_stages(base)):
            for instance in stage.instance_names(base):
                upstream[instance] = run_stage_instance(stage, base, rdir, instance, stage.options(), False)
        train = registry.get(TRAIN)
        for earlier in [s.name for s in base.train.stages][:-1]:
            upstream[instance_name(earlier)] = run_stage_instance(train, base, rdir, instance_name(earlier),
                                                              train.options(stage=earlier), False)
        if cfg.sweep.max_concurrency > 1:
            results = _train_in_pool(cfg.sweep.max_concurrency, variants, rdir, force)
        else:
            results = [train_variant(c, rdir, n, force) for n, _, c in variants]
        trained = [{"variant": n, "overrides": o, "cached": r["cached"]} for (n, o, _), r in zip(variants, results)]
        scores = {t["variant"]: (sweep.dev_score(rdir, t["variant"])) for t in trained}
        winner = min(scores, key=lambda v: sweep.ranking_key(v, scores[v]))
        winner_cfg = next(c for n, _, c in variants if n == winner)
        models = [str(Path(rdir) / instance_name(winner) / "model")]
        soup = None
        if cfg.sweep.soup_top_k:
            ranked = sorted(scores, key=lambda v: sweep.ranking_key(v, scores[v]))
            soup_dir = sweep.make_soup(cfg, Path(rdir), ranked)
            soup = {"members": ranked[:cfg.sweep.soup_top_k], "path": str(soup_dir),
                    "dev_score": sweep.soup_dev_score(winner_cfg, rdir, soup_dir), "test": []}
            models.append(str(soup_dir))
        test_scores: list[dict[str, Any]] = []
        if cfg.evaluate is not None:
            evaluate = registry.get(EVALUATE)
            options = evaluate.options(models=models)
            upstream[EVALUATE] = run_stage_instance(evaluate, winner_cfg, rdir, EVALUATE, options, False,
                                                      snapshot=False)
            evaluated = sweep.main_scores(rdir)
            test_scores = [r for r in evaluated if r["model"] == winner]
            if soup is not None:
                soup["test"] = [r for r in evaluated if r["model"] == Path(soup["path"]).parent.name]
        manifest = sweep.write_report(cfg, rdir, trained, test_scores, soup)
    swept = SweepManifest.of(manifest)
    return {"winner": swept.winner, "settings": swept.winner_settings, "variants": trained,
            "dev_scores": scores, "test": test_scores, "soup": soup,
            "report": f"{rdir}/sweep-{cfg.sweep.stage}/report.md"}


def _train_in_pool(workers: int, variants: list, rdir: str, force: bool) -> list[dict[str, Any]]:
    """Every variant in a pool of ``workers`` processes. Each worker runs in a session of its own
    (a Ctrl-C to the terminal's process group reaches this process alone) and is SIGKILLed by the
    kernel when this process dies (its commits need this run's lock); on an interrupt this process
    stops them itself rather than wait for their variants to finish."""
    before = set(descendants())
    runner = ProcessPoolTaskRunner(max_workers=workers, initializer=own_session_dying_with_parent,
                                   initargs=(signal.SIGKILL, os.getpid()))
    with runner:
        try:
            futures = [runner.submit(train_variant, {"config": c, "run_dir": rdir, "variant": n, "force": force})
                       for n, _, c in variants]
            # waited for in short steps: a signal that lands on another thread of this process (torch's,
            # Prefect's) runs its handler only once the main thread is back in Python
            for future in futures:
                while not future.wrapped_future.done():
                    future.wait(timeout=0.5)
            return [f.result() for f in futures]
        except BaseException as exc:
            if not isinstance(exc, Exception):  # an interrupt (Ctrl-C, SIGTERM): no variant is waited for
                kill_all(set(descendants()) - before)
            raise

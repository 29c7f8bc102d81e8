"""``embedpipe`` command line: run the pipeline, one stage (a command per registered stage:
prepare, synthesize, mine, train, evaluate), a sweep, the data watch, the status of a run
directory, compare runs, inspect artifacts, plan the train stages' memory per GPU, or ask a trained
model's lineage (was a text trained on, and from which source row).

The parser, the command table and the error boundary live here; where output goes is
``flows.console``, the temporary Prefect server ``flows.local_server``, multi-process launchers
``flows.launch``. Errors in the config or input end the command with exit code 2 and exactly one
line on stderr (``--debug`` adds the traceback); everything else goes to stdout. SIGINT (Ctrl-C) and
SIGTERM end it within seconds with one line and exit code 130 / 143 (``flows.interrupts``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TextIO

from embed_core.errors import EmbedpipeError, user_error
from embed_core.model.onednn import cap_onednn_primitive_cache
from embed_core.stage_dirs import EVALUATE, TRAIN
from flows import console, interrupts, launch
from flows.env import apply_defaults
from flows.options import add_option_flags, stage_options

if TYPE_CHECKING:
    from embed_core.config import RunConfig

Handler = Callable[[argparse.Namespace, TextIO], "int | None"]  # the exit status; None: 0


def _run_args(p: argparse.ArgumentParser, force: bool = True) -> None:
    p.add_argument("--config", help="YAML run config (default: the run directory's config.yaml from its latest run)")
    p.add_argument("--run-dir", help="run directory (default: <run_root>/<run_name>)")
    p.add_argument("--run-name", help="override the config's run_name")
    if force:
        p.add_argument("--force", action="store_true", help="recompute even when the inputs are unchanged")


def _parser() -> argparse.ArgumentParser:
    from embed_core import stages

    p = argparse.ArgumentParser(prog="embedpipe", description="Text datasets → embedding models, orchestrated by Prefect.")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback too")
    sub = p.add_subparsers(dest="command", required=True)
    _run_args(sub.add_parser("run", help="run the whole pipeline (unchanged stages are cache hits)"), force=False)
    for stage in stages.all_stages():
        sp = sub.add_parser(stage.name, help=f"run the {stage.name} stage only: {stage.help}")
        _run_args(sp)
        add_option_flags(sp, stage.options)
    _run_args(sub.add_parser("sweep", help="train every variant of the config's sweep section on the run's cached "
                                           "upstream artifacts, pick the best on dev, evaluate it, write sweep-<stage>/"))
    _run_args(sub.add_parser("ablate", help="run the config and each variant of its ablation section with every "
                                            "seed, end to end, and write the table of test scores (mean ± spread)"))
    rel = sub.add_parser("release", help="the run's releases (MLflow model registry): list them, promote a held "
                                         "one, roll back to the one before the current")
    _run_args(rel, force=False)
    rel.add_argument("action", choices=["list", "promote", "rollback"], help="list | promote VERSION | rollback")
    rel.add_argument("version", nargs="?", type=int, help="the version to promote")
    rel.add_argument("--note", default="", help="why (kept on the version)")
    wa = sub.add_parser("watch", help="fingerprint the sources, emit change events, run the pipeline (what the "
                                      "scheduled data-watch deployment does)")
    _run_args(wa, force=False)
    wa.add_argument("--no-pipeline", action="store_true", help="only detect changes and emit events")
    st = sub.add_parser("status", help="each stage: fresh/stale/missing, input hashes, last result, timings")
    st.add_argument("--run-dir", required=True)
    st.add_argument("--config", help="judge against this config instead of the run directory's config.yaml")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    cmp_ = sub.add_parser("compare", help="main scores of several runs side by side")
    cmp_.add_argument("sources", nargs="+", help="run directories or results.parquet files")
    cmp_.add_argument("--out", default="runs/compare", help="output directory for compare.md / compare.png")
    pl = sub.add_parser("plan", help="memory per GPU of each train stage (weights, gradients, AdamW state, "
                                     "activations), whether it fits, and the largest GradCache chunk and batch that do")
    pl.add_argument("--config", help="YAML run config (default: the run directory's config.yaml)")
    pl.add_argument("--run-dir", help="a run directory whose config.yaml to plan")
    pl.add_argument("--gpus", type=int, default=1, help="processes (GPUs) the stages run on (default 1)")
    pl.add_argument("--gpus-per-node", type=int, help="of --gpus, how many each node has (default: all on one "
                    "node); under sharding: fsdp with several nodes, fsdp_mesh auto/hybrid shards over a node's GPUs")
    pl.add_argument("--gpu-memory", type=float, metavar="GIB", help="memory of one GPU in GiB (2^30 bytes: "
                    "nvidia-smi's total MiB / 1024); without it the plan is only reported")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    ins = sub.add_parser("inspect", help="show schema, counts and sample rows of a Parquet file or stage dir")
    ins.add_argument("path")
    ins.add_argument("--samples", type=int, default=3)
    lin = sub.add_parser("lineage", help="was this text trained on, by which model (and the stages it started "
                                         "from), at which steps, from which source row; exit 0 trained on, 1 not")
    lin.add_argument("model", help="a trained model: <run-dir>/train-<stage>/model (or the stage directory)")
    what = lin.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", help="a text, matched after normalisation against every record field")
    what.add_argument("--id", dest="record_id", help="a record id, as the records' id column has it (e.g. scifact:q153)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(launch.without_launcher_args(sys.argv[1:] if argv is None else argv))
    apply_defaults()  # before prefect is imported
    cap_onednn_primitive_cache()  # before any stage runs a oneDNN op; stage subprocesses inherit it
    with console.stderr_for_errors_only() as error_stream, interrupts.interruptible(error_stream):
        try:
            with launch.as_launched_rank():  # under torchrun / deepspeed: torn down at the end, however it ends
                return _commands()[args.command](args, error_stream) or 0
        except Exception as exc:  # noqa: BLE001 — the error boundary: user-input errors become one line
            message = user_error(exc)
            if message is None:
                raise
            if args.debug:
                traceback.print_exception(exc, file=error_stream)
            print(f"embedpipe: error: {message}", file=error_stream)
            return 2
        except BaseException as exc:  # Ctrl-C, SIGTERM: one line, the shell's code for the signal
            if not interrupts.is_interrupt(exc):
                raise
            if args.debug:
                traceback.print_exception(exc, file=error_stream)
            print(f"embedpipe: {interrupts.interrupted_line(exc)}", file=error_stream)
            return interrupts.exit_code(exc)


def _load(args: argparse.Namespace):
    """(config, config_path): ``--config`` if given, else the run directory's snapshot."""
    from embed_core.config import load_config
    from embed_core.rundir import CONFIG_SNAPSHOT, load_config_snapshot

    if args.config:
        return load_config(args.config), args.config
    if args.run_dir:
        return load_config_snapshot(args.run_dir), str(Path(args.run_dir) / CONFIG_SNAPSHOT)
    raise EmbedpipeError("give --config, or --run-dir of a directory that has been run before")


def _flow_command(run: Callable[[argparse.Namespace, dict, "RunConfig"], None]) -> Handler:
    """A command that runs a flow on ``(config, run_dir)``, resolved here once. A busy run dir is
    refused before Prefect starts; the flow takes its lock (``flows.params.run_context``)."""

    def handler(args: argparse.Namespace, error_stream: TextIO) -> None:
        from embed_core.rundir import raise_if_busy
        from flows.local_server import prefect_api
        from flows.params import resolve_run

        config, config_path = _load(args)  # fail fast, before any Prefect machinery starts
        config, run_dir = resolve_run(config_path, config, args.run_dir, args.run_name)
        if launch.is_other_rank(args.command):
            from embed_core import stages

            launch.train_alongside_rank_0(config, run_dir, stage_options(stages.get(TRAIN), args), args.force)
            return
        raise_if_busy(run_dir)
        with prefect_api(), console.run_logs_on_stdout(error_stream):
            # the whole config, resolved here once
            run(args, {"config_path": None, "config": config.model_dump(mode="json"), "run_name": None,
                       "run_dir": run_dir}, config)

    return handler


def _pipeline(args: argparse.Namespace, common: dict, config: "RunConfig") -> None:
    from flows.output import print_result, wall_times
    from flows.pipeline import pipeline_flow

    t0 = time.perf_counter()
    results = pipeline_flow(**common)
    for res in results.values():
        print_result(res)
    if EVALUATE in results:
        print(f"\nreport: {Path(results[EVALUATE]['run_dir']) / EVALUATE / 'report.md'}")
    print(wall_times(results, time.perf_counter() - t0))


def _stage(args: argparse.Namespace, common: dict, config: "RunConfig") -> None:
    from embed_core import stages
    from flows.output import print_downstream, print_result
    from flows.stage import stage_flow

    stage = stages.get(args.command)
    results = list(stage_flow(stage.name)(**common, force=args.force, options=stage_options(stage, args)).values())
    for res in results:
        print_result(res)
    print_downstream(config, next((r for r in results if not r["cached"]), results[-1]))
    if stage.name == EVALUATE:
        print(f"report: {Path(common['run_dir']) / EVALUATE / 'report.md'}")


def _ablate(args: argparse.Namespace, common: dict, config: "RunConfig") -> None:
    from flows.ablation import ablation_flow

    result = ablation_flow(**common, force=args.force)
    print(Path(result["report"]).read_text(encoding="utf-8"))
    print(f"report: {result['report']}")


def _sweep(args: argparse.Namespace, common: dict, config: "RunConfig") -> None:
    from flows.output import print_sweep
    from flows.sweep import sweep_flow

    print_sweep(sweep_flow(**common, force=args.force))


def _watch(args: argparse.Namespace, common: dict, config: "RunConfig") -> None:
    from flows.watch import data_watch_flow

    out = data_watch_flow(**common, run_pipeline=not args.no_pipeline)
    for c in out["changes"]:
        print(f"source {c['source']}: {c['change']}")
    print(f"data-watch: {out['verdict']} ({out['seconds']} s)")


def _status(args: argparse.Namespace, error_stream: TextIO) -> None:
    from embed_core.runs.status import format_status, run_status

    rows = run_status(_load(args)[0], args.run_dir)
    print(json.dumps([r.as_dict() for r in rows], indent=2) if args.json else format_status(rows, args.run_dir))


def _release(args: argparse.Namespace, error_stream: TextIO) -> None:
    from embed_core.release import run as releases
    from flows.params import resolve_run

    config, run_dir = resolve_run(*reversed(_load(args)), args.run_dir, args.run_name)
    if config.release is None:
        raise EmbedpipeError("the config has no release section: its runs keep no releases (docs/orchestration.md, "
                             "'Scheduled retraining')")
    if args.action == "list":
        print(releases.format_releases(config))
    elif args.action == "rollback":
        print(releases.rollback(config, run_dir).line)
    elif args.version is None:
        raise EmbedpipeError("release promote: name the version (`embedpipe release list` shows them)")
    else:
        print(releases.promote(config, run_dir, args.version, "promoted from the CLI" +
                               (f": {args.note}" if args.note else "")).line)


def _compare(args: argparse.Namespace, error_stream: TextIO) -> None:
    from embed_core.evaluate.report import compare_runs

    try:
        path = compare_runs(args.sources, args.out)
    except FileNotFoundError as exc:
        raise EmbedpipeError(str(exc)) from None
    print(path.read_text(encoding="utf-8"))
    print(f"written: {path}")


def _plan(args: argparse.Namespace, error_stream: TextIO) -> None:
    from embed_core.train.plan import check_fits, format_plan, plan_config

    config = _load(args)[0]
    if config.train is None:
        raise EmbedpipeError("the config has no train section: there is nothing to plan")
    plan = plan_config(config.train, gpus=args.gpus, gpu_memory_gib=args.gpu_memory, gpus_per_node=args.gpus_per_node)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else format_plan(plan), flush=True)
    check_fits(plan)  # a stage that does not fit: one line on stderr, exit 2


def _inspect(args: argparse.Namespace, error_stream: TextIO) -> None:
    from embed_core.runs.inspect import inspect_path

    print(inspect_path(args.path, samples=args.samples))


def _lineage(args: argparse.Namespace, error_stream: TextIO) -> int:
    from embed_core.runs.lineage import answer

    report, status = answer(args.model, text=args.text, record_id=args.record_id)
    print(report)
    return status


def _commands() -> dict[str, Handler]:
    """The command table: command name → handler."""
    from embed_core import stages

    return {"run": _flow_command(_pipeline), **{s.name: _flow_command(_stage) for s in stages.all_stages()},
            "sweep": _flow_command(_sweep), "ablate": _flow_command(_ablate), "watch": _flow_command(_watch), "status": _status, "release": _release,
            "compare": _compare,
            "plan": _plan, "inspect": _inspect, "lineage": _lineage}


if __name__ == "__main__":
    sys.exit(main())

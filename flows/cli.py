"""``embedpipe`` command line: run the pipeline, one stage (prepare, synthesize, mine, train, evaluate), the data watch,
the status of a run directory, compare runs, or inspect artifacts.

Errors in the config or input end the command with exit code 2 and a one-line reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from embed_core.errors import EmbedpipeError
from embed_core.rundir import run_dir_lock


def _run_args(p: argparse.ArgumentParser, force: bool = True) -> None:
    p.add_argument("--config", help="YAML run config (default: the run directory's config.yaml from its latest run)")
    p.add_argument("--run-dir", help="run directory (default: <run_root>/<run_name>)")
    p.add_argument("--run-name", help="override the config's run_name")
    if force:
        p.add_argument("--force", action="store_true", help="recompute even when the inputs are unchanged")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embedpipe", description="Text datasets → embedding models, orchestrated by Prefect.")
    sub = p.add_subparsers(dest="command", required=True)
    _run_args(sub.add_parser("run", help="run the whole pipeline (unchanged stages are cache hits)"), force=False)
    _run_args(sub.add_parser("prepare", help="run the prepare stage only"))
    _run_args(sub.add_parser("synthesize", help="run the synthesize stage only (LLM paraphrase, augmentation, "
                                                 "hard negatives; needs the prepare stage's output)"))
    _run_args(sub.add_parser("mine", help="run the mine stage only (needs the prepare or synthesize stage's output)"))
    tr = sub.add_parser("train", help="run the train stages (needs prepare/mine output)")
    _run_args(tr)
    tr.add_argument("--stage", help="one stage: its name or number (1, 2); default all in order")
    tr.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint of an interrupted run with the same inputs")
    ev = sub.add_parser("evaluate", help="run the evaluate stage only (MTEB on the configured local tasks)")
    _run_args(ev)
    ev.add_argument("--model", action="append", dest="models", metavar="PATH|base|trained",
                    help="model to evaluate (repeatable; default: the config's evaluate.models)")
    ev.add_argument("--tasks", help="comma-separated task names from the config (default: all)")
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
    ins = sub.add_parser("inspect", help="show schema, counts and sample rows of a Parquet file or stage dir")
    ins.add_argument("path")
    ins.add_argument("--samples", type=int, default=3)
    return p


def _load(args):
    """(config, config_path): ``--config`` if given, else the run directory's snapshot."""
    from embed_core.config import load_config
    from embed_core.rundir import CONFIG_SNAPSHOT, load_config_snapshot

    if args.config:
        return load_config(args.config), args.config
    if args.run_dir:
        return load_config_snapshot(args.run_dir), str(Path(args.run_dir) / CONFIG_SNAPSHOT)
    raise EmbedpipeError("give --config, or --run-dir of a directory that has been run before")


def _print_downstream(config, result: dict) -> None:
    """After one stage recomputed: which later stages no longer match their inputs."""
    from embed_core.status import downstream_of, run_status

    if result["cached"]:
        return
    later = set(downstream_of(config, result["stage"]))
    rows = [r for r in run_status(config, result["run_dir"]) if r.stage in later]
    stale = [r.stage for r in rows if r.state != "fresh"]
    if stale:
        print(f"downstream now out of date: {', '.join(stale)} — `embedpipe run --run-dir {result['run_dir']}` "
              "recomputes them (stages whose inputs still match are cache hits)")
    elif rows:
        print("downstream stages still match their inputs (this stage's outputs did not change what they read)")


def _print_result(result: dict) -> None:
    state = "cache hit" if result["cached"] else "computed"
    print(f"\n{result['stage']} ({state}): {Path(result['run_dir']) / result['stage']}")
    print(result["summary"])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "inspect":
            from embed_core.inspect import inspect_path

            print(inspect_path(args.path, samples=args.samples))
            return 0
        if args.command == "compare":
            from embed_core.evaluation.report import compare_runs

            try:
                path = compare_runs(args.sources, args.out)
            except FileNotFoundError as exc:
                raise EmbedpipeError(str(exc)) from None
            print(path.read_text(encoding="utf-8"))
            print(f"written: {path}")
            return 0
        if args.command == "status":
            from embed_core.status import format_status, run_status

            config, _ = _load(args)
            rows = run_status(config, args.run_dir)
            print(json.dumps([r.as_dict() for r in rows], indent=2) if args.json else format_status(rows, args.run_dir))
            return 0
        config, config_path = _load(args)  # fail fast, before any Prefect machinery starts
        if args.run_name:
            config = config.model_copy(update={"run_name": args.run_name})
        run_dir = args.run_dir or str(config.default_run_dir())
        # Taken here (the flow re-enters it) so a busy run dir is refused before Prefect starts.
        with run_dir_lock(run_dir, f"embedpipe {args.command}"):
            _run_command(args, config, config_path, run_dir)
        return 0
    except EmbedpipeError as exc:
        print(f"embedpipe: error: {exc}", file=sys.stderr)
        return 2


def _run_command(args, config, config_path: str, run_dir: str) -> None:
    import flows  # noqa: F401  (environment defaults)

    common = {"config_path": config_path, "run_dir": run_dir, "config": config, "run_name": None}
    if args.command == "prepare":
        from flows.prepare import prepare_flow

        res = prepare_flow(**common, force=args.force)
        _print_result(res)
        _print_downstream(config, res)
    elif args.command == "synthesize":
        from flows.synthesize import synthesize_flow

        res = synthesize_flow(**common, force=args.force)
        _print_result(res)
        _print_downstream(config, res)
    elif args.command == "mine":
        from flows.mine import mine_flow

        res = mine_flow(**common, force=args.force)
        _print_result(res)
        _print_downstream(config, res)
    elif args.command == "train":
        from flows.train import train_flow

        results = train_flow(**common, stage=args.stage, resume=args.resume, force=args.force)
        for res in results:
            _print_result(res)
        _print_downstream(config, next((r for r in results if not r["cached"]), results[-1]))
    elif args.command == "evaluate":
        from flows.evaluate import evaluate_flow

        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
        result = evaluate_flow(**common, models=args.models, tasks=tasks, force=args.force)
        _print_result(result)
        print(f"report: {Path(result['run_dir']) / 'evaluate' / 'report.md'}")
    elif args.command == "run":
        from flows.pipeline import pipeline_flow

        results = pipeline_flow(**common)
        for res in results.values():
            _print_result(res)
        if "evaluate" in results:
            print(f"\nreport: {Path(results['evaluate']['run_dir']) / 'evaluate' / 'report.md'}")
    elif args.command == "watch":
        from flows.watch import data_watch_flow

        out = data_watch_flow(**common, run_pipeline=not args.no_pipeline)
        for c in out["changes"]:
            print(f"source {c['source']}: {c['change']}")
        print(f"data-watch: {out['verdict']} ({out['seconds']} s)")


if __name__ == "__main__":
    sys.exit(main())

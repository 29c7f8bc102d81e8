"""``embedpipe`` command line: run the pipeline, one stage (prepare, mine, train, evaluate), compare runs, or inspect artifacts.

Errors in the config or input end the command with exit code 2 and a one-line reason.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from embed_core.errors import EmbedpipeError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embedpipe", description="Text datasets → embedding models, orchestrated by Prefect.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the whole pipeline")
    run.add_argument("--config", required=True, help="YAML run config")
    run.add_argument("--run-dir", help="run directory (default: <run_root>/<run_name>)")
    prep = sub.add_parser("prepare", help="run the prepare stage only")
    prep.add_argument("--config", required=True)
    prep.add_argument("--run-dir")
    mine = sub.add_parser("mine", help="run the mine stage only (needs the prepare stage's output)")
    mine.add_argument("--config", required=True)
    mine.add_argument("--run-dir")
    tr = sub.add_parser("train", help="run the train stages (needs prepare/mine output)")
    tr.add_argument("--config", required=True)
    tr.add_argument("--run-dir")
    tr.add_argument("--stage", help="one stage: its name or number (1, 2); default all in order")
    tr.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint of an interrupted run with the same inputs")
    ev = sub.add_parser("evaluate", help="run the evaluate stage only (MTEB on the configured local tasks)")
    ev.add_argument("--config", required=True)
    ev.add_argument("--run-dir")
    ev.add_argument("--model", action="append", dest="models", metavar="PATH|base|trained",
                    help="model to evaluate (repeatable; default: the config's evaluate.models)")
    ev.add_argument("--tasks", help="comma-separated task names from the config (default: all)")
    cmp_ = sub.add_parser("compare", help="main scores of several runs side by side")
    cmp_.add_argument("sources", nargs="+", help="run directories or results.parquet files")
    cmp_.add_argument("--out", default="runs/compare", help="output directory for compare.md / compare.png")
    ins = sub.add_parser("inspect", help="show schema, counts and sample rows of a Parquet file or stage dir")
    ins.add_argument("path")
    ins.add_argument("--samples", type=int, default=3)
    return p


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
        from embed_core.config import load_config

        config = load_config(args.config)  # fail fast, before any Prefect machinery starts
        import flows  # noqa: F401  (environment defaults)

        if args.command == "prepare":
            from flows.prepare import prepare_flow

            _print_result(prepare_flow(config_path=args.config, run_dir=args.run_dir, config=config))
        elif args.command == "mine":
            from flows.mine import mine_flow

            _print_result(mine_flow(config_path=args.config, run_dir=args.run_dir, config=config))
        elif args.command == "train":
            from flows.train import train_flow

            for res in train_flow(config_path=args.config, run_dir=args.run_dir, config=config, stage=args.stage,
                                  resume=args.resume):
                _print_result(res)
        elif args.command == "evaluate":
            from flows.evaluate import evaluate_flow

            tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
            result = evaluate_flow(config_path=args.config, run_dir=args.run_dir, config=config,
                                   models=args.models, tasks=tasks)
            _print_result(result)
            print(f"report: {Path(result['run_dir']) / 'evaluate' / 'report.md'}")
        elif args.command == "run":
            from flows.pipeline import pipeline_flow

            results = pipeline_flow(config_path=args.config, run_dir=args.run_dir, config=config)
            for res in results.values():
                _print_result(res)
            if "evaluate" in results:
                print(f"\nreport: {Path(results['evaluate']['run_dir']) / 'evaluate' / 'report.md'}")
        return 0
    except EmbedpipeError as exc:
        print(f"embedpipe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

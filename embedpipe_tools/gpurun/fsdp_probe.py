"""The first run's FSDP2 probe: a tiny two-layer model under ``fully_shard`` on the process group
of one, one AdamW step (fused on CUDA: its kernel is not the CPU one the tests run) on its DTensor
parameters against plain AdamW on an unsharded copy, then a DCP save and a load into a fresh
sharded model and optimizer, bit-equal, and one more step of each, still bit-equal."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from torch import nn

LR = 1e-2
STEP_TOLERANCE = 1e-5  # fused against plain AdamW: the same arithmetic in another order


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def _sharded(seed: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = _model(seed).to(device)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    fused = device.type == "cuda"
    return model, torch.optim.AdamW(model.parameters(), lr=LR, fused=fused)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): _local(tree)}


def _unequal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys whose values are not bit-equal (or present in one only)."""
    bad = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        same = torch.equal(x, y) if torch.is_tensor(x) and torch.is_tensor(y) else x == y
        if not same:
            bad.append(key)
    return bad


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def fsdp2_round_trip(device: torch.device) -> dict[str, Any]:
    """See the module's docstring; needs the default process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.tensor import DTensor

    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)).to(device)
    reference = _model(0).to(device)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, foreach=False, fused=False)
    model, optimizer = _sharded(0, device)
    _step(reference, ref_opt, x)
    _step(model, optimizer, x)
    dtensors = all(isinstance(p, DTensor) for p in model.parameters())
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    step_diff = max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())
    _step(model, optimizer, 0.5 * x)  # a second step: the moments and step count are not the initial ones
    fresh, fresh_opt = _sharded(1, device)
    _step(fresh, fresh_opt, -x)  # other weights and moments, which the load must replace
    with tempfile.TemporaryDirectory(prefix="fsdp-probe-dcp-") as tmp:
        dcp.save(_state(model, optimizer), checkpoint_id=tmp)
        target = _state(fresh, fresh_opt)
        dcp.load(target, checkpoint_id=tmp)
        set_state_dict(fresh, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    loaded = _unequal(_flat(_state(model, optimizer)), _flat(_state(fresh, fresh_opt)))
    _step(model, optimizer, x)
    _step(fresh, fresh_opt, x)
    after = _unequal(_flat(_state(model, optimizer)), _flat(_state(fresh, fresh_opt)))
    errors = [msg for msg, bad in (
        ("a parameter is not a DTensor after fully_shard", not dtensors),
        (f"the AdamW step on DTensors differs from plain AdamW by {step_diff:.3g} (> {STEP_TOLERANCE})",
         step_diff > STEP_TOLERANCE),
        (f"after the DCP load, not bit-equal: {', '.join(loaded[:5])}", bool(loaded)),
        (f"one step after the load, not bit-equal: {', '.join(after[:5])}", bool(after))) if bad]
    return {"fused_adamw": device.type == "cuda", "dtensor_parameters": dtensors,
            "step_max_abs_diff_vs_plain_adamw": step_diff, "step_tolerance": STEP_TOLERANCE,
            "dcp_round_trip_bit_equal": not loaded, "step_after_load_bit_equal": not after,
            "state_entries": len(_flat(_state(model, optimizer))), "errors": errors}

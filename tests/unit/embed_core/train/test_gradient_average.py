"""The bucketed gradient average (``embed_core.dist.distributed.GradientAverage``): buckets are
all-reduced while the step's last backward runs, and the averaged gradients equal a plain
all-reduce of every gradient. Two real gloo processes."""

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _backward_passes(model: torch.nn.Module, rank: int, on_last=None) -> None:
    """Three backward passes, as GradCache's chunks make (only the last one's gradients are final)."""
    for chunk in range(3):
        torch.manual_seed(100 * rank + chunk)
        if on_last is not None:
            on_last(chunk == 2)
        model(torch.randn(5, 8)).pow(2).sum().backward()


def _rank(rank: int, store: str, out: str) -> None:
    from embed_core.dist.distributed import GradientAverage

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    plain = _model(rank)
    _backward_passes(plain, rank)
    for p in plain.parameters():
        torch.distributed.all_reduce(p.grad)
        p.grad.div_(2)
    bucketed = _model(rank)
    averager = GradientAverage(bucketed, bucket_mb=1024 / 2**20)  # 1 KiB buckets: one per weight matrix
    _backward_passes(bucketed, rank, averager.arm)
    launched_during_backward = len(averager._pending)
    averager.finish()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), bucketed.parameters()))
    Path(out, f"rank{rank}").write_text(f"{same} {launched_during_backward}")
    torch.distributed.destroy_process_group()  # not left to interpreter exit, where gloo can abort


def test_bucketed_average_is_launched_during_the_last_backward_and_equals_a_plain_all_reduce(tmp_path):
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    results = [(tmp_path / f"rank{r}").read_text().split() for r in (0, 1)]
    assert all(same == "True" for same, _ in results), results
    assert all(int(n) >= 2 for _, n in results), results  # buckets went out before finish()

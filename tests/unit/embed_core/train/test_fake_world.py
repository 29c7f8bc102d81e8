"""A training step as rank 0 of 8 (FSDP2, bf16) and as rank 11 of 16 (plain back end), in one
process on torch's fake process group: every collective a real NCCL job would make is issued (the
ranks' pass agreement, the loss's embedding gathers, FSDP's all-gathers and reduce-scatters, the
gradient and metric reductions), recorded at the dispatcher, and checked for what NCCL needs: tensors
contiguous and on the trainer's device, FSDP's weights gathered in bf16 and its gradients reduced in
fp32. The fake group answers with this rank's own data, so the numbers are not a real job's; the
shapes, dtypes, devices and the order of the calls are. The FSDP rank is rank 0: the other ranks
receive their weights from it (a broadcast the fake group cannot carry; two real gloo processes
check that path, ``test_sharded_load.py``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

pytestmark = pytest.mark.slow


class Collectives(TorchDispatchMode):
    """Every c10d op dispatched: (name, [(dtype, device type, contiguous) of each tensor argument])."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list[tuple[torch.dtype, str, bool]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            tensors = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
            self.calls.append((func.__name__.split(".")[0],
                               [(t.dtype, t.device.type, t.is_contiguous()) for t in tensors]))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_world(request, tiny_model):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank, world = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    yield rank, world
    dist.destroy_process_group()


def _trainer(tmp_path: Path, tiny_model: Path, sharding: str, precision: str):
    from embed_core.config import parse_config
    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords
    from embed_core.train.engine.trainer import Trainer

    config = parse_config({"prepare": {"sources": [{"name": "x", "kind": "sts", "path": "x"}]}, "train": {
        "base_model": str(tiny_model), "max_length": 32, "precision": precision, "sharding": sharding, "stages": [{
            "name": "s", "steps": 2, "batch_size": {"retrieval": 2}, "num_hard_negatives": 1, "grad_cache_chunk": 1,
            "query_max_length": 16, "passage_max_length": 16}]}})
    table = records_to_table([Record(id=f"r{i}", dataset="d", task="retrieval", query=f"query {i} " * (1 + i % 3),
                                     positives=[f"passage {i}"], negatives=[f"negative {i}"]) for i in range(64)])
    return Trainer(config.train, config.train.stages[0], {"d": DatasetRecords("d", table)},
                   init_model=str(tiny_model), checkpoint_dir=tmp_path, seed=0)


def _step(trainer) -> tuple[dict, Collectives]:
    try:
        with Collectives() as seen:
            rows = trainer.train_step()
    finally:
        trainer.batches.close()
    return rows[-1], seen


def _check_device_contract(trainer, seen: Collectives) -> None:
    assert seen.calls
    for name, tensors in seen.calls:
        for dtype, device, contiguous in tensors:
            assert device == trainer.device.type and contiguous, (name, dtype, device, contiguous)


@pytest.mark.parametrize("fake_world", [(0, 8)], indirect=True)
def test_an_fsdp_step_as_rank_0_of_8_gathers_bf16_weights_and_reduces_fp32_gradients(fake_world, tmp_path, tiny_model):
    trainer = _trainer(tmp_path, tiny_model, "fsdp", "bf16")
    assert (trainer.rank, trainer.world) == fake_world
    row, seen = _step(trainer)
    assert torch.isfinite(torch.tensor(row["loss"]))
    _check_device_contract(trainer, seen)
    ops = Counter(name for name, _ in seen.calls)
    gathers = [t for name, t in seen.calls if name == "_allgather_base_"]
    scatters = [t for name, t in seen.calls if name == "_reduce_scatter_base_"]
    assert gathers and all(dtype == torch.bfloat16 for t in gathers for dtype, _, _ in t)
    assert scatters and all(dtype == torch.float32 for t in scatters for dtype, _, _ in t)
    # the pass agreement: one all-reduce of a pass count per micro-batch, before any encoder pass
    agreements = [t for name, t in seen.calls if name == "allreduce_" and t[0][0] == torch.int64]
    assert len(agreements) == trainer.stage.grad_accum, ops
    # the loss's gathers: the embeddings of all 8 ranks (and their row counts first)
    embedding_gathers = [t for name, t in seen.calls if name == "allgather_" and t[0][0] == torch.float32]
    assert embedding_gathers and all(len(t) == 8 + 1 for t in embedding_gathers)


@pytest.mark.parametrize("fake_world", [(11, 16)], indirect=True)
def test_a_plain_step_as_rank_11_of_16_averages_gradients_over_16_ranks(fake_world, tmp_path, tiny_model):
    trainer = _trainer(tmp_path, tiny_model, "none", "fp32")
    assert (trainer.rank, trainer.world) == fake_world
    before = [p.detach().clone() for p in trainer.model.parameters()]
    row, seen = _step(trainer)
    _check_device_contract(trainer, seen)
    assert any(name == "allreduce_" and t[0][0] == torch.float32 for name, t in seen.calls)  # gradient buckets
    embedding_gathers = [t for name, t in seen.calls if name == "allgather_" and t[0][0] == torch.float32]
    assert embedding_gathers and all(len(t) == 16 + 1 for t in embedding_gathers)
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))  # a step was taken
    assert row["examples"] == 2  # this rank's slice of the 32-record micro-batch

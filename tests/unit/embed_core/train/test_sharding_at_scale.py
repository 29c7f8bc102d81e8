"""FSDP at 7B scale without a GPU or its memory (review T4; F5, F18): a Qwen2.5-7B-config decoder
built on the meta device and sharded by the project's own sharding code on torch's fake process
group (every collective a no-op, no parameter memory), at world 8 (a flat mesh) and at 16 ranks on
2 nodes of 8 (a hybrid replicate × shard mesh). Every parameter is a DTensor with the intended
placement, every layer its own FSDP unit under the intended mixed precision, and a rank's bytes are
what ``embedpipe plan`` computes from the same shapes. The process's resident memory must not grow by
the gigabytes a real shard (3.3 GiB) or the model (26 GiB) would take."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from embed_core.train.config import TrainConfig

QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 intermediate_size=18944, vocab_size=152064)
GiB = 2 ** 30


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def fake_group():
    """Starts torch's fake process group as ``rank`` of ``world`` (collectives do nothing); torn
    down after the test with every group a mesh made, so no test leaks one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _train(mesh: str = "auto") -> TrainConfig:
    return TrainConfig.model_validate({"base_model": "qwen2.5-7b", "sharding": "fsdp", "precision": "bf16",
                                       "fsdp_mesh": mesh, "stages": [{"name": "s"}]})


def _meta_qwen25_7b():
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(**QWEN25_7B)
    with torch.device("meta"):
        return config, Qwen2Model(config)


@pytest.mark.parametrize("rank,world,local,placements,dims", [
    (0, 8, 8, "(Shard(dim=0),)", None),
    (7, 8, 8, "(Shard(dim=0),)", None),
    (3, 16, 8, "(Replicate(), Shard(dim=0))", ("replicate", "shard")),
    (12, 16, 8, "(Replicate(), Shard(dim=0))", ("replicate", "shard")),
])
def test_a_qwen2_5_7b_on_the_meta_device_shards_per_the_mesh_and_each_rank_holds_what_plan_says(
        fake_group, monkeypatch, rank, world, local, placements, dims):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from embed_core.train.engine import sharding
    from embed_core.train.plan import shape_of, states

    before = _rss()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    fake_group(rank, world)
    train = _train()
    config, model = _meta_qwen25_7b()
    shape = shape_of("qwen2.5-7b", config, {n: tuple(p.shape) for n, p in model.named_parameters()})
    assert shape.numel() == 7_070_619_136  # the 7.07 B body the review sized
    sharding.shard(model, bf16=True, mesh=sharding.mesh_for(train, world, "cpu"))

    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())
    assert {str(tuple(p.placements)) for p in params.values()} == {placements}
    mesh = params["embed_tokens.weight"].device_mesh
    assert mesh.mesh_dim_names == dims and mesh.size(-1) == 8  # sharded 8 ways either way
    assert all(isinstance(layer, FSDPModule) for layer in model.layers) and isinstance(model, FSDPModule)
    for unit in (model, model.layers[0], model.layers[-1]):
        policy = unit._get_fsdp_state()._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    local_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in params.values())
    planned = states(shape, train, world, bf16=True, local=local)
    assert local_bytes == planned.weights  # fp32 master shards, 1/8 of 28.3 GB
    assert (planned.gradients, planned.optimizer) == (local_bytes, 2 * local_bytes)
    assert 3.2 * GiB < local_bytes < 3.4 * GiB
    assert all(p.to_local().is_meta for p in params.values())  # nothing allocated ...
    assert _rss() - before < 1 * GiB  # ... and the process did not grow by a shard's (or the model's) bytes


def test_the_flat_mesh_on_two_nodes_shards_16_ways_and_the_plan_divides_by_16(fake_group, monkeypatch):
    from embed_core.train.engine import sharding
    from embed_core.train.plan import shape_of, states

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    fake_group(5, 16)
    train = _train("flat")
    config, model = _meta_qwen25_7b()
    shape = shape_of("qwen2.5-7b", config, {n: tuple(p.shape) for n, p in model.named_parameters()})
    sharding.shard(model, bf16=True, mesh=sharding.mesh_for(train, 16, "cpu"))
    local_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    assert local_bytes == states(shape, train, 16, bf16=True, local=8).weights
    assert local_bytes < states(shape, _train(), 16, bf16=True, local=8).weights  # hybrid holds twice as much


@pytest.mark.parametrize("mesh,world,local,shape", [
    ("auto", 8, 8, (8,)), ("auto", 16, 8, (2, 8)), ("flat", 16, 8, (16,)), ("hybrid", 16, 8, (2, 8)),
    ("hybrid", 8, 8, (8,)), ("auto", 1, 1, (1,))])
def test_the_mesh_is_hybrid_where_the_ranks_span_nodes_unless_the_config_says_flat(mesh, world, local, shape):
    assert _train(mesh).fsdp_mesh_shape(world, local) == shape


def test_a_hybrid_mesh_whose_local_ranks_do_not_divide_the_world_is_one_line():
    from embed_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^train.fsdp_mesh: hybrid needs .* 3 local ranks do not divide 8; "
                                          r"use fsdp_mesh: flat$"):
        _train("hybrid").fsdp_mesh_shape(8, 3)

"""Loading under ``sharding: fsdp`` (review F5): the trainer shards the model on the meta device
before anything is on its device, rank 0 alone reads the checkpoint and broadcasts it into every
rank's shards (``set_model_state_dict(broadcast_from_rank0=True)``), and the non-persistent buffers
(rotary ``inv_freq``) arrive too. A spy on ``fully_shard`` and ``Module.to`` fails where the whole
model is materialised on the device first (what the trainer did at 39b4e21: ``.to(device)``, then
``fully_shard``). A real two-process gloo run checks that a rank that never read the checkpoint ends
with its weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from embed_core.train.config import TrainConfig


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tiny_model) -> Path:
    from tests.helpers.tiny_model import build_tiny_decoder

    return build_tiny_decoder(tmp_path_factory.mktemp("sharded") / "qwen2", "qwen2", tokenizer_dir=tiny_model)


@pytest.fixture
def group_teardown():
    """The trainer starts a process group of one for FSDP: destroyed after the test."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def records():
    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords

    recs = [Record(id=str(i), dataset="d", task="retrieval", query=f"query {i} about rivers",
                   positives=[f"passage {i} on stones"], negatives=[f"other {i}"]) for i in range(16)]
    return {"d": DatasetRecords("d", records_to_table(recs))}


def _train(model: Path, **settings) -> TrainConfig:
    return TrainConfig.model_validate({
        "base_model": str(model), "max_length": 32, "precision": "fp32", "sharding": "fsdp", **settings,
        "stages": [{"name": "s", "tasks": ["retrieval"], "steps": 2, "warmup_steps": 0, "num_hard_negatives": 1,
                    "batch_size": {"retrieval": 4}, "query_max_length": 16, "passage_max_length": 16,
                    "checkpoint_every": 10 ** 6, "log_every": 10 ** 6}]})


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path)
    return {**model.state_dict(), **{n: b for n, b in model.named_buffers()}}


def test_the_trainer_shards_the_model_before_any_of_it_is_on_its_device(qwen2, records, tmp_path, monkeypatch,
                                                                       group_teardown):
    """At ``fully_shard`` every parameter is on the meta device, and ``Module.to`` moved no parameter
    bytes onto the training device; the sharded model then holds the checkpoint's weights and
    buffers exactly."""
    import torch.distributed.fsdp as fsdp

    from embed_core.train.engine.trainer import Trainer

    seen: list[int] = []  # real (non-meta) parameter bytes of the module at each fully_shard
    moved: list[int] = []  # parameter bytes Module.to put on a real device
    real_shard, real_to = fsdp.fully_shard, torch.nn.Module.to

    def spy_shard(module, *args, **kwargs):
        seen.append(sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta))
        return real_shard(module, *args, **kwargs)

    def spy_to(module, *args, **kwargs):
        target = torch._C._nn._parse_to(*args, **kwargs)[0]
        if target is not None and target.type != "meta":
            moved.append(sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta))
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", spy_shard)
    monkeypatch.setattr(torch.nn.Module, "to", spy_to)
    trainer = Trainer(_train(qwen2), _train(qwen2).stages[0], records, init_model=str(qwen2),
                      checkpoint_dir=tmp_path, seed=0, log=lambda _: None)
    monkeypatch.undo()
    assert len(seen) == 3 and set(seen) == {0}  # 2 layers and the root, all on meta when sharded
    assert sum(moved) == 0
    expected = _checkpoint(qwen2)
    state = trainer.model.model.state_dict()
    buffers = dict(trainer.model.model.named_buffers())
    for name, value in expected.items():
        got = state[name].full_tensor() if name in state else buffers[name]
        assert got.dtype == torch.float32 and torch.equal(got, value.float()), name
    assert "rotary_emb.inv_freq" in buffers  # a non-persistent buffer, checked above
    rows = trainer.train_step()  # and it trains
    assert rows and torch.isfinite(torch.tensor(rows[-1]["loss"]))


def test_the_consolidated_decoder_is_bf16_by_default_and_fp32_when_asked(qwen2, records, tmp_path, group_teardown):
    from embed_core.train.engine.trainer import Trainer

    for save_dtype, want in (("auto", torch.bfloat16), ("fp32", torch.float32)):
        train = _train(qwen2, save_dtype=save_dtype)
        trainer = Trainer(train, train.stages[0], records, init_model=str(qwen2), checkpoint_dir=tmp_path / save_dtype,
                          seed=0, log=lambda _: None)
        state = trainer.consolidated_state()
        assert {v.dtype for v in state.values() if v.is_floating_point()} == {want}
        assert torch.equal(state["embed_tokens.weight"].float(),
                           _checkpoint(qwen2)["embed_tokens.weight"].to(want).float())
        dist.destroy_process_group()


def test_save_dtype_auto_is_bf16_for_decoders_fp32_for_encoders_and_lora_merges_in_fp32(qwen2, tiny_model):
    from embed_core.model.embedder import Embedder
    from embed_core.train.engine.trainer import save_dtype

    decoder, encoder = Embedder(str(qwen2)), Embedder(str(tiny_model))
    assert save_dtype(_train(qwen2), decoder) == torch.bfloat16
    assert save_dtype(_train(tiny_model), encoder) == torch.float32
    assert save_dtype(_train(tiny_model, save_dtype="bf16"), encoder) == torch.bfloat16
    assert save_dtype(_train(qwen2, lora={"r": 4}), decoder) == torch.float32


def _rank(rank: int, store: str, model_dir: str, out: str) -> None:
    """One of two gloo ranks: rank 1 builds on meta; both end with the checkpoint's full weights."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from embed_core.model.embedder import Embedder
    from embed_core.train.engine import sharding
    from embed_core.train.engine.backends.base import stored

    model = Embedder(model_dir, meta=rank != 0)
    read = sum(p.numel() for p in model.parameters() if not p.is_meta)
    sharding.load_sharded(model, device=torch.device("cpu"), bf16=False, rank=rank,
                          stored=lambda m: stored(m, "fp32"))
    state = {k: v.full_tensor() for k, v in model.model.state_dict().items()}
    local = sum(p.to_local().numel() for p in model.parameters())
    torch.save({"read": read, "local": local, "state": state,
                "buffers": dict(model.model.named_buffers())}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_rank_that_never_read_the_checkpoint_gets_its_weights_and_buffers_from_rank_0(qwen2, tmp_path):
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(qwen2), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    expected = _checkpoint(qwen2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    total = sum(v.numel() for k, v in expected.items() if "inv_freq" not in k)
    assert ranks[0]["read"] == total and ranks[1]["read"] == 0  # only rank 0 read weights
    assert ranks[0]["local"] + ranks[1]["local"] <= total + 2 * 64  # each holds about half (dim 0 padding)
    for got in ranks:
        for name, value in expected.items():
            held = got["state"].get(name, got["buffers"].get(name))
            assert torch.equal(held, value.float()), name


def test_keep_checkpoints_is_kept_or_lowered_to_one_with_a_warning_by_the_free_disk(tmp_path):
    """(F10) keep + 1 checkpoints (the one being written) must fit the free space; else 1 is kept
    with a warning line; where even 2 do not fit, a warning line says where the stage will stop
    (the write itself then fails with one line, the last checkpoint kept); a stage that writes no
    checkpoint is not checked."""
    import shutil

    from embed_core.train.config import TrainStageConfig
    from embed_core.train.engine.trainer import kept_checkpoints

    stage = TrainStageConfig(name="s", keep_checkpoints=2, steps=10, checkpoint_every=2)
    free = shutil.disk_usage(tmp_path).free
    said: list[str] = []
    assert kept_checkpoints(stage, 1 << 20, tmp_path / "ckpt", said.append) == 2 and not said
    assert kept_checkpoints(stage, int(free / 2.5), tmp_path / "ckpt", said.append) == 1
    assert len(said) == 1 and said[0].startswith("warning: s: keeping 1 checkpoint, not 2: 3 of ")
    assert kept_checkpoints(stage, free, tmp_path / "ckpt", said.append) == 1
    assert len(said) == 2 and "not enough for one and the one being written: the stage stops at step 2" in said[1]
    none_written = TrainStageConfig(name="s", keep_checkpoints=2, steps=1, checkpoint_every=2)
    assert kept_checkpoints(none_written, 10 * free, tmp_path / "ckpt", said.append) == 2 and len(said) == 2


def test_the_checkpoint_bytes_the_trainer_sizes_are_the_ones_plan_prints(qwen2, tmp_path):
    from embed_core.model.embedder import Embedder
    from embed_core.train.engine.backends.base import stored
    from embed_core.train.plan import checkpoint_bytes as planned, committed_bytes, model_shape
    from embed_core.train.engine.trainer import checkpoint_bytes

    model = stored(Embedder(str(qwen2)), "fp32")
    shape = model_shape(str(qwen2))
    assert checkpoint_bytes(model) == planned(shape, _train(qwen2)) == 12 * shape.numel()
    assert committed_bytes(shape, _train(qwen2)) == 2 * shape.numel()  # a decoder: bf16 (save_dtype auto)
    lora = stored(Embedder(str(qwen2), lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}),
                  "fp32")
    assert checkpoint_bytes(lora) == planned(shape, _train(qwen2, lora={"r": 4}))

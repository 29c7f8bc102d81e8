"""A micro-batch's encoder passes under FSDP: two real gloo processes whose own texts make different
numbers of passes (rank 0 has hard negatives and texts of many lengths, so length buckets and
GradCache chunks split it into several passes; rank 1 has no negatives and texts of one length).
FSDP all-gathers weights in every forward, so unpaired passes wait for each other until the
collective timeout, or gloo aborts a rank when one pass's weights meet another's; agreed on (``Passes.plan``: one all-reduce, padding passes), the step finishes
on both ranks. The control without the agreement shows the wait is real."""

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow

TIMEOUT_S = 8


def _rank(rank: int, store: str, out: str, model_dir: str, collective: bool) -> None:
    from datetime import timedelta

    from embed_core.model.embedder import Embedder
    from embed_core.train.engine import sharding
    from embed_core.train.engine.batches import TaskBatch, TextGroup
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.engine.passes import Passes

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                                         timeout=timedelta(seconds=TIMEOUT_S))
    result = "?"
    try:
        model = Embedder(model_dir, pooling="mean", max_length=64)
        sharding.shard(model, bf16=False)
        stage = TrainStageConfig(name="s", grad_cache_chunk=3, length_buckets=4, bucket_pass_cost=0)
        passes = Passes(model, model, device=torch.device("cpu"), bf16=False, stage=stage, packing="off",
                        collective=collective)
        if rank == 0:  # lengths 1..24 words: several buckets per chunk, and a negatives group
            texts = ["word " * n for n in (1, 24, 3, 12, 6, 9)]
            groups = {"query": TextGroup(texts, [None] * 6, 64), "positive": TextGroup(texts[::-1], [None] * 6, 64),
                      "negative": TextGroup(texts[:4], [None] * 4, 64)}
        else:  # one length: one pass per chunk, no negatives
            texts = ["same length text"] * 6
            groups = {"query": TextGroup(texts, [None] * 6, 64), "positive": TextGroup(texts, [None] * 6, 64)}
        batch = TaskBatch("retrieval", "d", groups)
        planned = len(passes.plan(batch))
        loss = passes.forward_backward(batch, lambda emb: sum((e ** 2).mean() for e in emb.values()), 1.0,
                                       lambda loss, final: loss.backward())
        grads = sum(1 for p in model.parameters() if p.grad is not None)
        result = f"ok {planned} {loss > 0} {grads > 0}"
    except Exception as exc:  # noqa: BLE001 (the outcome is what the test reads)
        result = f"failed {type(exc).__name__}"
    Path(out, f"rank{rank}").write_text(result)
    os._exit(0)  # a gloo group whose collective timed out can abort in its destructor at exit


def _run(tmp_path: Path, tiny_model: Path, collective: bool) -> dict[str, str]:
    out = tmp_path / ("agreed" if collective else "unagreed")
    out.mkdir()
    try:
        mp.start_processes(_rank, args=(str(out / "store"), str(out), str(tiny_model), collective), nprocs=2,
                           start_method="spawn")
    except mp.ProcessExitedException as exc:  # gloo aborts a rank whose collective got another's data
        return {"aborted": str(exc)}
    return {p.name: p.read_text() for p in sorted(out.glob("rank*"))}


def test_fsdp_ranks_whose_texts_make_different_pass_counts_agree_on_one_count_and_finish_the_step(tmp_path, tiny_model):
    got = _run(tmp_path, tiny_model, collective=True)
    assert got["rank0"] == got["rank1"] and got["rank0"].startswith("ok ") and got["rank0"].endswith("True True")
    assert int(got["rank0"].split()[1]) > 4  # more than rank 1 alone makes (2 groups x 2 chunks, one length)


def test_without_the_agreement_the_same_step_waits_until_the_collective_timeout(tmp_path, tiny_model):
    got = _run(tmp_path, tiny_model, collective=False)
    assert "aborted" in got or any(v.startswith("failed") for v in got.values()), got


def test_a_padding_pass_leaves_the_random_streams_as_it_found_them_so_later_dropout_masks_do_not_shift(tiny_model):
    from embed_core.model.embedder import Embedder
    from embed_core.train.engine.batches import TextGroup
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.engine.passes import Passes

    model = Embedder(str(tiny_model), pooling="mean", max_length=64).train()  # dropout 0.1: passes draw masks
    passes = Passes(model, model, device=torch.device("cpu"), bf16=False, stage=TrainStageConfig(name="s"),
                    packing="off", collective=True)
    before = torch.get_rng_state()
    passes._run(passes._padding())
    assert torch.equal(torch.get_rng_state(), before)
    real = passes._split("query", model.tokenize(["a text", "another text"], [None, None], 64), torch.arange(2))[0]
    passes._run(real)
    assert not torch.equal(torch.get_rng_state(), before)  # a real pass draws: the check above can fail

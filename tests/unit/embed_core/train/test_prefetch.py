"""The batch source (embed_core.train.engine.prefetch): micro-batches built one ahead on a thread are the
ones built on the step, and a checkpoint's sampler state resumes exactly."""

import threading

from embed_core.train.engine.prefetch import BatchSource
from embed_core.train.engine.sampling import GroupedBatchSampler


def _sampler() -> GroupedBatchSampler:
    return GroupedBatchSampler({"a": 50, "b": 120}, {"a": 4, "b": 8}, alpha=0.5, seed=3)


def _build(drawn, index):
    return (index, drawn.dataset, tuple(drawn.indices), threading.current_thread().name)


def test_prefetched_micro_batches_are_the_ones_built_on_the_step_and_are_built_off_it():
    ahead, plain = BatchSource(_sampler(), _build, prefetch=True), BatchSource(_sampler(), _build, prefetch=False)
    got = [ahead.get(i) for i in range(12)]
    want = [plain.get(i) for i in range(12)]
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert all(g[3].startswith("embedpipe-batches") for g in got[1:])  # every one after the first
    ahead.close()


def test_the_sampler_state_saved_mid_run_resumes_the_same_micro_batches():
    source = BatchSource(_sampler(), _build, prefetch=True)
    for i in range(5):
        source.get(i)
    saved = source.sampler_state()  # what a checkpoint after micro-batch 4 holds (the one drawn ahead excluded)
    rest = [source.get(i)[:3] for i in range(5, 10)]
    resumed = BatchSource(_sampler(), _build, prefetch=True)
    resumed.get(0)  # a fresh run has drawn ahead already when the checkpoint is loaded
    resumed.reset()
    resumed.sampler.load_state_dict(saved)
    assert [resumed.get(i)[:3] for i in range(5, 10)] == rest
    source.close()
    resumed.close()


def test_an_error_while_building_ahead_reaches_the_step_that_asks_for_that_batch():
    def build(drawn, index):
        if index == 2:
            raise ValueError("bad record")
        return index

    source = BatchSource(_sampler(), build, prefetch=True)
    assert source.get(0) == 0 and source.get(1) == 1
    try:
        source.get(2)
    except ValueError as exc:
        assert "bad record" in str(exc)
    else:
        raise AssertionError("the error was lost")
    source.close()

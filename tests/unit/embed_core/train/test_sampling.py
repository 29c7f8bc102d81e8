"""Dataset-grouped sampler: empirical frequencies match Eq. 4 / the η equations; exact resume."""

import json

import pytest

from embed_core.train.engine.sampling import GroupedBatchSampler, dataset_weights

SIZES = {"a": 100, "b": 400, "c": 900}


def _freq(sampler, n):
    counts = {k: 0 for k in SIZES}
    for _ in range(n):
        counts[sampler.next_batch().dataset] += 1
    return {k: v / n for k, v in counts.items()}


def test_frequencies_follow_size_power_alpha():
    # l^0.5 = 10, 20, 30 -> 1/6, 2/6, 3/6
    assert dataset_weights(SIZES, 0.5) == pytest.approx({"a": 1 / 6, "b": 2 / 6, "c": 3 / 6})
    freq = _freq(GroupedBatchSampler(SIZES, {k: 8 for k in SIZES}, alpha=0.5, seed=1), 30000)
    assert freq == pytest.approx({"a": 1 / 6, "b": 2 / 6, "c": 3 / 6}, abs=0.01)


def test_eta_gives_retrieval_datasets_their_global_share():
    # RET = {a, b}: a = 0.72*10/30, b = 0.72*20/30, c = 0.28
    expected = {"a": 0.24, "b": 0.48, "c": 0.28}
    assert dataset_weights(SIZES, 0.5, {"a", "b"}, 0.72) == pytest.approx(expected)
    freq = _freq(GroupedBatchSampler(SIZES, {k: 8 for k in SIZES}, alpha=0.5, retrieval={"a", "b"}, eta=0.72,
                                     seed=2), 30000)
    assert freq == pytest.approx(expected, abs=0.01)


def test_dataset_weight_scales_a_datasets_share_before_eta_splits_the_sides():
    # a's l^0.5 = 10 x 4 = 40, b = 20, c = 30: without eta 40/90, 20/90, 30/90; 0 leaves c out
    assert dataset_weights(SIZES, 0.5, multipliers={"a": 4.0}) == pytest.approx({"a": 4 / 9, "b": 2 / 9, "c": 3 / 9})
    assert dataset_weights(SIZES, 0.5, multipliers={"c": 0.0}) == pytest.approx({"a": 1 / 3, "b": 2 / 3})
    # RET = {a, b} keeps eta = 0.72 whatever the multipliers: a = 0.72 * 40/60, b = 0.72 * 20/60
    assert dataset_weights(SIZES, 0.5, {"a", "b"}, 0.72, {"a": 4.0}) == pytest.approx({"a": 0.48, "b": 0.24, "c": 0.28})
    freq = _freq(GroupedBatchSampler(SIZES, {k: 8 for k in SIZES}, alpha=0.5, seed=3, multipliers={"a": 4.0}), 30000)
    assert freq == pytest.approx({"a": 4 / 9, "b": 2 / 9, "c": 3 / 9}, abs=0.01)


def test_batches_are_single_dataset_and_cover_each_pass_without_repeats():
    s = GroupedBatchSampler({"a": 10}, {"a": 3}, seed=0)
    first_pass = [i for _ in range(3) for i in s.next_batch().indices]
    assert sorted(first_pass) == sorted(set(first_pass)) and len(first_pass) == 9  # short tail dropped
    assert s.next_batch().indices != first_pass[:3] or s.epoch["a"] == 1


def test_state_round_trips_through_json_and_resumes_exactly():
    a = GroupedBatchSampler(SIZES, {"a": 7, "b": 16, "c": 32}, alpha=0.5, seed=3)
    for _ in range(57):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    expected = [(b.dataset, b.indices) for b in (a.next_batch() for _ in range(80))]
    b = GroupedBatchSampler(SIZES, {"a": 7, "b": 16, "c": 32}, alpha=0.5, seed=3)
    b.load_state_dict(state)
    assert [(x.dataset, x.indices) for x in (b.next_batch() for _ in range(80))] == expected
    with pytest.raises(ValueError):
        GroupedBatchSampler({"a": 5}, {"a": 2}, seed=3).load_state_dict(state)


def test_alternate_takes_retrieval_and_other_datasets_in_turn():
    from embed_core.train.engine.sampling import GroupedBatchSampler

    sizes = {"ret-a": 100, "ret-b": 400, "sts": 300, "nli": 50}
    sampler = GroupedBatchSampler(sizes, {n: 4 for n in sizes}, retrieval={"ret-a", "ret-b"}, alternate=True, seed=3)
    names = [sampler.next_batch().dataset for _ in range(400)]
    assert all(n.startswith("ret") for n in names[0::2]) and not any(n.startswith("ret") for n in names[1::2])
    # within a side, datasets keep their Eq. 4 proportions (size^0.5): ret-b twice ret-a
    even = names[0::2]
    assert 1.6 < even.count("ret-b") / even.count("ret-a") < 2.5
    state = sampler.state_dict()
    other = GroupedBatchSampler(sizes, {n: 4 for n in sizes}, retrieval={"ret-a", "ret-b"}, alternate=True, seed=3)
    other.load_state_dict(state)
    assert [other.next_batch().dataset for _ in range(6)] == [sampler.next_batch().dataset for _ in range(6)]

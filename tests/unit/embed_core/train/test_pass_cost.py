"""``bucket_pass_cost: auto`` follows what an extra encoder pass costs where it runs: under FSDP on a
GPU the weight traffic of one more pass (on paper: about 1,300 positions within a node, 10,000
across nodes), on the plain back end the CPU-measured 8192 under bf16 and 0 in fp32; and the
length buckets follow it."""

import pytest

from embed_core.train.engine.passes import default_pass_cost, length_buckets

H100_BF16 = 989.4


def test_a_collective_pass_costs_the_positions_its_weight_traffic_buys_within_and_across_nodes():
    within = default_pass_cost(True, True, H100_BF16, across_nodes=False)
    across = default_pass_cost(True, True, H100_BF16, across_nodes=True)
    assert within == pytest.approx(1337, abs=2) and across == pytest.approx(9894, abs=5)


def test_without_a_collective_forward_or_a_known_peak_the_cpu_measured_costs_stay():
    assert default_pass_cost(True, False, H100_BF16, False) == 8192
    assert default_pass_cost(False, False, None, False) == 0
    assert default_pass_cost(True, True, None, False) == 8192  # a CPU or an unknown GPU under FSDP


def test_a_split_worth_it_within_a_node_is_not_worth_it_across_nodes():
    # one pass: 64 x 512 = 32,768 positions; two passes: 16 x 512 + 48 x 400 = 27,392 (saves 5,376)
    lengths = [512] * 16 + [400] * 48
    assert length_buckets(lengths, 4, default_pass_cost(True, True, H100_BF16, False)) == [(0, 16), (16, 64)]
    assert length_buckets(lengths, 4, default_pass_cost(True, True, H100_BF16, True)) == [(0, 64)]

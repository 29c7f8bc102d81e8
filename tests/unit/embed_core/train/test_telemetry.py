"""Step telemetry: the FLOP model behind MFU, hand-computed on the tiny BERT; the device peak table;
peak memory."""

import pytest
import torch

from embed_core.model.embedder import Embedder
from embed_core.train.engine.telemetry import FlopModel, device_peak_tflops, peak_memory_mb


def test_the_flop_model_counts_six_flops_per_weight_and_token_plus_attention(tiny_model):
    """Tiny BERT (hidden 32, 2 layers, intermediate 64), outside its embedding tables:
    per layer q/k/v/o 4·(32·32 + 32) = 4224, two LayerNorms 2·64, feed-forward 32·64 + 64 + 64·32 + 32
    = 4192: 8544; two layers 17088, the embeddings' LayerNorm 64 and the pooler 32·32 + 32 = 1056:
    N = 18208. Per token at a mean length of 10: 6·18208 + 12·2·32·10 = 116928."""
    m = Embedder(str(tiny_model))
    flops = FlopModel(m, m.model.config)
    assert (flops.params, flops.layers, flops.hidden) == (18208, 2, 32)
    assert flops.per_token(10) == 116928
    # 1000 tokens in 100 texts in 2 s on a device of 1e-6 TFLOP/s (1e6 FLOP/s): 1000·116928/2/1e6
    assert flops.mfu(1000, 100, 2.0, 1e-6) == pytest.approx(58.464)
    assert flops.mfu(1000, 100, 2.0, None) is None  # no known peak: no MFU


def test_a_frozen_base_counts_four_flops_per_weight_and_token(tiny_model):
    m = Embedder(str(tiny_model))
    for name, p in m.named_parameters():
        p.requires_grad = "layer.1." in name  # part of the model trains
    flops = FlopModel(m, m.model.config)
    assert flops.per_token(0) == 4 * 18208


def test_the_device_peak_comes_from_the_override_else_the_gpu_table_and_is_unknown_on_cpu():
    cpu = torch.device("cpu")
    assert device_peak_tflops(cpu, True) is None
    assert device_peak_tflops(cpu, True, override=123.0) == 123.0
    assert peak_memory_mb(cpu) > 10  # this process's peak resident memory so far


def test_cuda_steps_report_the_reserved_peak_beside_the_allocated_one_and_reset_both(monkeypatch):
    """Review F12: an out-of-memory error comes when the allocator's *reserved* memory reaches the
    device's, which can be long before *allocated* does. No GPU here: torch.cuda's memory counters
    are simulated (allocated 1 GiB, reserved 1.5 GiB, both reset after being read)."""
    from embed_core.train.engine.telemetry import peak_memory

    peaks = {"allocated": 2 ** 30, "reserved": 1.5 * 2 ** 30}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: peaks.update(allocated=0,
                                                                                                 reserved=0))
    assert peak_memory(torch.device("cuda", 0)) == {"peak_memory_mb": 1024.0, "peak_reserved_mb": 1536.0}
    assert peak_memory(torch.device("cuda", 0)) == {"peak_memory_mb": 0.0, "peak_reserved_mb": 0.0}
    cpu = peak_memory(torch.device("cpu"))
    assert cpu["peak_reserved_mb"] is None and cpu["peak_memory_mb"] > 10

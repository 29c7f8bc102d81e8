"""The first run's probes (embedpipe_tools/gpurun/probes.py) can fail: a decoder left causal fails the
bidirectional probe, and a GradCache replay without the RNG states restored fails the replay probe
(the CPU first run in test_first.py shows them passing)."""

from __future__ import annotations

import torch

from embedpipe_tools.gpurun import probes


def test_a_decoder_left_causal_fails_the_bidirectional_probe_for_every_case(monkeypatch):
    import embed_core.model.embedder as embedder

    monkeypatch.setattr(embedder, "make_bidirectional", lambda config: None)
    result = probes.probe_bidirectional(torch.device("cpu"))
    assert set(result["cases"]) == {"qwen2/sdpa", "qwen3/sdpa"}
    assert all(c["bidirectional"] is False for c in result["cases"].values())
    assert len(result["errors"]) == 2 and all("causally" in e for e in result["errors"])


def test_a_replay_without_the_rng_states_restored_fails_the_grad_cache_probe(monkeypatch):
    import embed_core.train.engine.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "set_rng_state", lambda state: None)
    result = probes.probe_grad_cache_replay(torch.device("cpu"))
    assert result["max_abs_diff"] > result["tolerance"]
    assert result["errors"] and "dropout masks do not replay" in result["errors"][0]

"""The baseline: sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (its GradCache) on
the same model, records, batch size, chunk (``mini_batch_size``), precision and number of steps,
with tokens/s measured as for the project's trainer: non-padding tokens of the texts put through
the encoder with a graph, over the wall time of the timed steps, after the same warm-up steps.

Its loop is what ``SentenceTransformerTrainer`` does per step, without the dataset, data-loader and
callback machinery (which would only slow the baseline): tokenize the (anchor, positive, negative)
columns (``preprocess``), the loss (its backward hook re-embeds each mini-batch), clip to norm 1,
fused AdamW. Under bf16 the model's forward runs in bf16 autocast over fp32 weights, as
``accelerate`` wraps it for ``bf16=True`` (so the hook's second forward pass is autocast too)."""

from __future__ import annotations

import functools
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from embedpipe_tools.gpucheck.parts import release, synchronize
from embedpipe_tools.gpucheck.setup import Batches


def load_peer() -> tuple[Any, Any] | str:
    """(SentenceTransformer, CachedMultipleNegativesRankingLoss), or why they cannot be imported."""
    try:
        from sentence_transformers import SentenceTransformer
        try:
            from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
        except ImportError:  # sentence-transformers < 6
            from sentence_transformers.losses import CachedMultipleNegativesRankingLoss
    except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
        return f"sentence_transformers not importable ({type(exc).__name__}: {exc})"
    return SentenceTransformer, CachedMultipleNegativesRankingLoss


def _autocast(forward: Any, device_type: str) -> Any:
    """``forward`` in bf16 autocast with fp32 embeddings out, as ``accelerate`` wraps a model's forward
    for ``bf16=True`` (``autocast`` then ``convert_outputs_to_fp32``)."""

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = forward(*args, **kwargs)
        if isinstance(out, dict) and torch.is_tensor(out.get("sentence_embedding")):
            out["sentence_embedding"] = out["sentence_embedding"].float()
        return out

    return wrapped


def _batches(triples: list[tuple[str, str, list[str]]], size: int, seed: int = 0):
    """Batches of (queries, positives, first negatives) in a seeded order, a new one each pass."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(triples)))
        rng.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            rows = [triples[i] for i in order[start:start + size]]
            yield [[r[0] for r in rows], [r[1] for r in rows], [r[2][0] for r in rows]]


def _step(st: Any, loss_fn: Any, optimizer: Any, columns: list[list[str]], device: torch.device) -> tuple[float, int]:
    """One optimizer step on (anchors, positives, negatives): (loss, non-padding tokens embedded)."""
    features = []
    for texts in columns:
        f = st.preprocess(texts)
        features.append({k: v.to(device) if torch.is_tensor(v) else v for k, v in f.items()})
    tokens = sum(int(f["attention_mask"].sum()) for f in features)
    loss = loss_fn(features, None)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(st.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach()), tokens


def st_peer(model: Path, triples: list, batches: Batches, device: torch.device, *, bf16: bool, steps: int,
            warmup: int) -> dict[str, Any]:
    """``warmup`` + ``steps`` steps of the baseline on (query, positive, first negative) batches of
    ``triples``: tokens/s of the timed steps and every loss; or null tokens/s with the reason."""
    loaded = load_peer()
    if isinstance(loaded, str):
        return {"tokens_per_s": None, "reason": loaded}
    SentenceTransformer, Loss = loaded
    import sentence_transformers

    release(device)
    torch.manual_seed(0)
    st = SentenceTransformer(str(model), device=device.type)
    st.max_seq_length = max(batches.query_len, batches.passage_len)
    st.train()
    if bf16:
        st.forward = _autocast(st.forward, device.type)
    loss_fn = Loss(st, mini_batch_size=batches.chunk or batches.batch)
    optimizer = torch.optim.AdamW(st.parameters(), lr=2e-5, weight_decay=0.01, fused=device.type in ("cpu", "cuda"))
    source = _batches(triples, min(batches.batch, len(triples)))

    def step() -> tuple[float, int]:
        return _step(st, loss_fn, optimizer, next(source), device)

    losses = [step()[0] for _ in range(warmup)]
    synchronize(device)
    t0 = time.perf_counter()
    timed = [step() for _ in range(steps)]
    synchronize(device)
    seconds = time.perf_counter() - t0
    losses += [v for v, _ in timed]
    tokens = sum(t for _, t in timed)
    return {"version": sentence_transformers.__version__, "loss": "CachedMultipleNegativesRankingLoss",
            "mini_batch_size": batches.chunk or batches.batch, "steps": steps, "warmup_steps": warmup,
            "tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": tokens / seconds if seconds else 0.0,
            "losses": losses, "loss_finite": all(math.isfinite(v) for v in losses)}

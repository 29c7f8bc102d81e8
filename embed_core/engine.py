"""Where a stage's encode-heavy work runs: in the stage's own process (``local``) or on a Ray
cluster (``ray``), as Ray Data batch inference with actors that hold the model.

Prefect stays the orchestrator (Prefect's and Ray's guidance: heavy data-parallel work on a
distributed engine started from the task, results handed back by reference): the mine stage's task
calls :func:`ray_encode` for the texts its embedding cache lacks, Ray Data ships the texts to
``num_workers`` actors (one GPU each with ``num_gpus_per_worker: 1``, CPU otherwise), and the
embeddings come back into the same content-addressed cache the local engine fills, so a rerun or
another stage encodes nothing again whichever engine produced them. With no ``address`` a local
Ray instance is started for the stage and stopped after it (:func:`engine_session`); every process of
it dies with the process that started it, even when that one is SIGKILLed.

Ray is an optional extra (``pip install -e ".[ray]"``), imported only here and only for ``ray``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from embed_core import procs
from embed_core.model.config import EngineConfig
from embed_core.errors import ConfigError


def ray_module():
    """``ray`` with Ray Data, or a ConfigError saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ConfigError("engine kind 'ray' needs Ray Data: pip install -e '.[ray]'") from None
    return ray


@contextlib.contextmanager
def engine_session(engine: EngineConfig) -> Iterator[None]:
    """Connect to the configured Ray cluster, or start a local one (stopped on exit); nothing for
    the local engine or when this process is already connected."""
    if engine.kind != "ray":
        yield
        return
    ray = ray_module()
    if ray.is_initialized():
        yield
        return
    guarded, before = None, set(procs.descendants())
    if engine.address:
        ray.init(address=engine.address, log_to_driver=False)
    else:
        # one logical CPU per actor plus one for Ray Data's own tasks (the actors' threads are set below)
        ray.init(num_cpus=int(engine.num_workers * engine.cpus_per_worker) + 1, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
        # Ray's own processes die with this one (its PR_SET_PDEATHSIG), but the agents its raylet
        # starts linger a minute after a SIGKILL: a guard kills every process of the instance then
        guarded = procs.guard([pid for pid in procs.descendants() if pid not in before])
    try:
        yield
    finally:
        ray.shutdown()
        procs.release(guarded)


class _EncodeActor:
    """A Ray Data actor holding one encoder (on its GPU when it has one)."""

    def __init__(self, model: str, pooling: str, max_length: int, precision: str, threads: int, batch_size: int,
                 compress_tokens: int = 0):
        import torch

        from embed_core.model.encoder import Encoder

        torch.set_num_threads(threads)
        self.encoder = Encoder(model, pooling=pooling, max_length=max_length, precision=precision,
                               compress_tokens=compress_tokens)
        self.batch_size = batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        emb = self.encoder.encode([str(t) for t in batch["text"]], batch_size=self.batch_size)
        return {"row": batch["row"], "embedding": emb}


def ray_encode(texts: Sequence[str], *, model: str, pooling: str, max_length: int, precision: str,
               batch_size: int, dim: int, engine: EngineConfig, compress_tokens: int = 0) -> np.ndarray:
    """Embeddings of ``texts`` (float32, input order) computed by ``engine.num_workers`` Ray actors.
    Call inside :func:`engine_session`."""
    ray = ray_module()
    import pyarrow as pa

    out = np.zeros((len(texts), dim), dtype=np.float32)
    if not texts:
        return out
    # one block per actor batch, so every actor gets work (a single block would go to one actor)
    blocks = [pa.table({"row": np.arange(start, min(start + engine.batch_size, len(texts)), dtype=np.int64),
                        "text": list(texts[start:start + engine.batch_size])})
              for start in range(0, len(texts), engine.batch_size)]
    threads = max(1, int(engine.cpus_per_worker) if engine.address else (os.cpu_count() or 1) // engine.num_workers)
    kwargs: dict[str, Any] = dict(model=model, pooling=pooling, max_length=max_length, precision=precision,
                                  threads=threads, batch_size=batch_size, compress_tokens=compress_tokens)
    encoded = ray.data.from_arrow(blocks).map_batches(
        _EncodeActor, fn_constructor_kwargs=kwargs, batch_size=engine.batch_size, batch_format="numpy",
        concurrency=engine.num_workers, num_cpus=engine.cpus_per_worker,
        num_gpus=engine.num_gpus_per_worker or None)
    seen = 0
    for batch in encoded.iter_batches(batch_format="numpy", batch_size=None):
        out[batch["row"]] = np.stack(batch["embedding"]) if batch["embedding"].dtype == object else batch["embedding"]
        seen += len(batch["row"])
    if seen != len(texts):
        raise RuntimeError(f"Ray returned {seen} embeddings for {len(texts)} texts")
    return out

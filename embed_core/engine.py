"""Where a stage's encode-heavy work runs: in the stage's own process (``local``) or on a Ray
cluster (``ray``), on Ray actors that hold the model.

Prefect stays the orchestrator (Prefect's and Ray's guidance: heavy data-parallel work on a
distributed engine started from the task, results handed back by reference): the mine stage's task
calls :func:`ray_encode` for the texts its embedding cache lacks, the texts go in blocks to
``num_workers`` actors (one GPU each with ``num_gpus_per_worker: 1``, CPU otherwise) through Ray's
``ActorPool``, and the embeddings come back into the same content-addressed cache the local engine
fills, so a rerun or another stage encodes nothing again whichever engine produced them.

The actors load the model once per engine session, not once per call: mine encodes its queries and
its passage pools, and evaluate every task's texts (mteb asks task by task, side by side), with the
same actors; a call with another model or other settings replaces them (:class:`_Encoders`), so one
set holds the cluster's resources at a time. They are named ``embedpipe-encoder-<n>-<i>`` (what the
Ray dashboard shows). With no ``address`` a local Ray instance is started for the stage and stopped
after it (:func:`engine_session`); every process of it dies with the process that started it, even
when that one is SIGKILLed.

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
    """``ray``, or a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("engine kind 'ray' needs Ray: pip install -e '.[ray]'") from None
    return ray


@contextlib.contextmanager
def engine_session(engine: EngineConfig) -> Iterator[None]:
    """Connect to the configured Ray cluster, or start a local one (stopped on exit); nothing for
    the local engine or when this process is already connected."""
    if engine.kind != "ray":
        yield
        return
    ray = ray_module()
    if ray.is_initialized():  # already connected (an outer session, or the caller's own): its actors go at the end
        try:
            yield
        finally:
            _ENCODERS.release()
        return
    guarded, before = None, set(procs.descendants())
    if engine.address:
        ray.init(address=engine.address, log_to_driver=False)
    else:
        # one logical CPU per actor plus one to spare (the actors' threads are set below)
        ray.init(num_cpus=int(engine.num_workers * engine.cpus_per_worker) + 1, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
        # Ray's own processes die with this one (its PR_SET_PDEATHSIG), but the agents its raylet
        # starts linger a minute after a SIGKILL: a guard kills every process of the instance then
        guarded = procs.guard([pid for pid in procs.descendants() if pid not in before])
    try:
        yield
    finally:
        _ENCODERS.release()
        ray.shutdown()
        procs.release(guarded)


class _EncodeActor:
    """A Ray actor holding one encoder (on its GPU when it has one)."""

    def __init__(self, model: str, pooling: str, max_length: int, precision: str, threads: int, batch_size: int,
                 compress_tokens: int = 0):
        import torch

        from embed_core.model.encoder import Encoder

        torch.set_num_threads(threads)
        self.encoder = Encoder(model, pooling=pooling, max_length=max_length, precision=precision,
                               compress_tokens=compress_tokens)
        self.batch_size = batch_size

    def encode(self, texts: list[str]) -> np.ndarray:
        return self.encoder.encode(texts, batch_size=self.batch_size)


class _Encoders:
    """The engine session's actors: made on the first call, reused while the model and settings
    stay the same, replaced (the old ones killed first, freeing their CPUs and GPUs) when they
    change, and killed when the session ends."""

    def __init__(self):
        self.key: tuple | None = None
        self.actors: list = []
        self.made = 0

    def get(self, ray, engine: EngineConfig, kwargs: dict[str, Any]) -> list:
        key = (engine.num_workers, engine.cpus_per_worker, engine.num_gpus_per_worker, tuple(sorted(kwargs.items())))
        if key != self.key:
            self.release()
            self.made += 1
            remote = ray.remote(num_cpus=engine.cpus_per_worker, num_gpus=engine.num_gpus_per_worker or 0)(_EncodeActor)
            self.actors = [remote.options(name=f"embedpipe-encoder-{self.made}-{i}").remote(**kwargs)
                           for i in range(engine.num_workers)]
            self.key = key
        return self.actors

    def release(self) -> None:
        if self.actors:
            import ray

            for actor in self.actors:
                ray.kill(actor)
        self.key, self.actors = None, []


_ENCODERS = _Encoders()


def ray_encode(texts: Sequence[str], *, model: str, pooling: str, max_length: int, precision: str,
               batch_size: int, dim: int, engine: EngineConfig, compress_tokens: int = 0) -> np.ndarray:
    """Embeddings of ``texts`` (float32, input order) computed by ``engine.num_workers`` Ray actors,
    blocks of ``engine.batch_size`` texts each, every actor taking the next block when it is free.
    Call inside :func:`engine_session` (the actors live as long as it)."""
    ray = ray_module()
    from ray.util import ActorPool

    out = np.zeros((len(texts), dim), dtype=np.float32)
    if not texts:
        return out
    threads = max(1, int(engine.cpus_per_worker) if engine.address else (os.cpu_count() or 1) // engine.num_workers)
    kwargs: dict[str, Any] = dict(model=model, pooling=pooling, max_length=max_length, precision=precision,
                                  threads=threads, batch_size=batch_size, compress_tokens=compress_tokens)
    starts = range(0, len(texts), engine.batch_size)
    blocks = [[str(t) for t in texts[start:start + engine.batch_size]] for start in starts]
    pool = ActorPool(_ENCODERS.get(ray, engine, kwargs))
    for start, emb in zip(starts, pool.map(lambda actor, block: actor.encode.remote(block), blocks)):
        out[start:start + len(emb)] = emb
    return out

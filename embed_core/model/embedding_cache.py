"""Embedding cache keyed by (model fingerprint, text hash), stored as memory-mapped arrays.

Layout: ``<root>/<model fingerprint>-<dtype>/shard-<id>.npy`` (float16 or float32 rows) with
``shard-<id>.keys.npy`` (the 16-byte BLAKE2b hashes of the texts, same order). Shards are only ever
added, each written atomically under a name no other process uses (time and pid), vectors before
keys, so an interrupted encode loses nothing already stored and concurrent writers and readers
never see a half-written or overwritten shard. A text already in any shard is never encoded
again — across reruns, datasets and stages that use the same model (a float16 cache and a float32
one of the same model are separate directories, so a result never depends on which precision
another stage stored).

Two roots (``embedding_cache_root``): models the run trains live in ``<run_dir>/cache/embeddings/``; models
that do not change with the run (the base model, any model outside the run directory) use the
machine-wide cache, ``$EMBEDPIPE_CACHE_DIR/embeddings`` (default ``~/.cache/embedpipe/embeddings``), so a fresh run
directory on the same machine encodes the base model's texts once. The machine-wide cache is kept
under a size cap by removing the least recently used models' directories (``enforce_size_cap``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from embed_core.artifacts import FILE_MODE

log = logging.getLogger("embedpipe.cache")
MACHINE_CACHE_ENV = "EMBEDPIPE_CACHE_DIR"


def machine_cache_dir() -> Path:
    """The machine-wide embedding cache: ``embeddings/`` in embedpipe's cache directory
    (``$EMBEDPIPE_CACHE_DIR``, default ``~/.cache/embedpipe``, which also holds the file-hash memo)."""
    root = os.environ.get(MACHINE_CACHE_ENV) or Path.home() / ".cache" / "embedpipe"
    return Path(root).expanduser() / "embeddings"


def embedding_cache_root(model_path: str | Path, run_dir: str | Path, machine_wide: bool = True) -> Path:
    """Where a model's embeddings are cached: the run's own cache for models inside the run directory
    (they change whenever the run retrains them), the machine-wide cache for every other model."""
    run_dir = Path(run_dir).resolve()
    inside = Path(model_path).resolve().is_relative_to(run_dir)
    return run_dir / "cache" / "embeddings" if inside or not machine_wide else machine_cache_dir()


def cache_location(model_path: str | Path, run_dir: str | Path, settings: Any) -> tuple[Path, int | None]:
    """(root, size cap in bytes or None) of a model's cache in a run; ``settings`` is the run's
    ``EmbeddingCacheConfig``. Only the machine-wide root is capped."""
    root = embedding_cache_root(model_path, run_dir, settings.machine_wide)
    return root, int(settings.max_gb * 1e9) if root == machine_cache_dir() else None


def open_cache(model_path: str | Path, run_dir: str | Path, settings: Any, model_fingerprint: str, dim: int,
               dtype: str) -> "EmbeddingCache":
    """The cache for a model in a run (``cache_location``)."""
    root, max_bytes = cache_location(model_path, run_dir, settings)
    return EmbeddingCache(root, model_fingerprint, dim, dtype, max_bytes=max_bytes)


def model_embed(model: str, run_dir: str | Path, settings: Any, *, pooling: str, max_length: int, bf16: Callable[[], bool],
                dtype: str, make_encoder: Callable[[str, int], Callable[[list[str]], np.ndarray]]) -> "LazyCachedEmbed":
    """texts -> embeddings of ``model`` (a name or directory) through the run's embedding cache, keyed
    by the model's fingerprint under these encoding settings (``bf16()``: whether it encodes in
    bf16), so two stages encoding with the same model, pooling, length and precision share one set
    of embeddings (synthesize's round trip and mine read a corpus once). The model is resolved when
    the cache opens, and ``make_encoder(path, dim)`` runs only for a text the cache lacks."""
    import functools

    from embed_core.model.encoder import model_dim, model_fingerprint, resolve_model_path

    path = functools.cache(lambda: str(resolve_model_path(model)))

    def open_() -> "EmbeddingCache":
        return open_cache(path(), run_dir, settings, model_fingerprint(model, pooling, max_length, bf16()),
                          model_dim(path()), dtype)

    return LazyCachedEmbed(open_, lambda cache: make_encoder(path(), cache.dim))


class LazyCachedEmbed:
    """texts -> embeddings through a run's cache: the cache is opened (``open``) on the first call and
    the encoder built (``make_encoder(cache)``: texts -> embeddings) on the first text the cache
    lacks, so a rerun whose texts are all cached never loads the model. ``cache`` is None until the
    first call (the counts a manifest reports)."""

    def __init__(self, open: Callable[[], "EmbeddingCache"],
                 make_encoder: Callable[["EmbeddingCache"], Callable[[list[str]], np.ndarray]]):
        self._open, self._make_encoder = open, make_encoder
        self.cache: EmbeddingCache | None = None
        self._encoder: Callable[[list[str]], np.ndarray] | None = None

    def _encode(self, texts: list[str]) -> np.ndarray:
        if self._encoder is None:
            self._encoder = self._make_encoder(self.cache)
        return self._encoder(texts)

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        if self.cache is None:
            self.cache = self._open()
        return self.cache.get_or_encode(texts, self._encode)


def enforce_size_cap(root: str | Path, max_bytes: int, keep: Path | None = None) -> list[Path]:
    """Remove whole model directories under ``root``, least recently used first (directory mtime,
    refreshed by every ``EmbeddingCache`` that opens one), until the cache holds at most
    ``max_bytes``; ``keep`` (the one in use) is never removed. Returns what was removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = []
    for d in root.iterdir():
        if d.is_dir():
            size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            dirs.append((d.stat().st_mtime, d, size))
    total = sum(size for _, _, size in dirs)
    removed = []
    for _, d, size in sorted(dirs, key=lambda x: x[0]):
        if total <= max_bytes:
            break
        if keep is not None and d.resolve() == Path(keep).resolve():
            continue
        shutil.rmtree(d, ignore_errors=True)
        total -= size
        removed.append(d)
    if removed:
        log.info("embedding cache %s over %.1f GB: removed %d least recently used model(s)", root, max_bytes / 1e9,
                 len(removed))
    return removed


def text_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class EmbeddingCache:
    def __init__(self, root: str | Path, model_fingerprint: str, dim: int, dtype: str = "float16",
                 max_bytes: int | None = None):
        self.dtype = np.dtype(dtype)
        self.dir = Path(root) / f"{model_fingerprint}-{self.dtype.name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        if max_bytes is not None:  # a capped (machine-wide) root: make room, keeping this model's
            enforce_size_cap(root, max_bytes, keep=self.dir)
        self.dim = dim
        os.utime(self.dir)  # recently used: the size cap removes the least recently used first
        self._index: dict[bytes, tuple[str, int]] = {}
        self._shards: dict[str, np.ndarray] = {}
        for keys_path in sorted(self.dir.glob("shard-*.keys.npy")):
            name = keys_path.name[: -len(".keys.npy")]
            keys = np.load(keys_path)
            for row, key in enumerate(keys):
                self._index.setdefault(key.tobytes(), (name, row))
        self.encoded_texts = 0  # texts actually sent to the model through this cache object

    def __len__(self) -> int:
        return len(self._index)

    def _shard(self, name: str) -> np.ndarray:
        if name not in self._shards:
            self._shards[name] = np.load(self.dir / f"{name}.npy", mmap_mode="r")
        return self._shards[name]

    def _write(self, path: Path, array: np.ndarray) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, array)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def add(self, texts: Sequence[str], embeddings: np.ndarray) -> None:
        keys = [text_key(t) for t in texts]
        fresh = [i for i, k in enumerate(keys) if k not in self._index]
        if not fresh:
            return
        name = f"shard-{time.time_ns():x}-{os.getpid()}"  # unique: several processes may add at once
        vectors = embeddings[fresh].astype(self.dtype)
        key_array = np.frombuffer(b"".join(keys[i] for i in fresh), dtype="V16")
        self._write(self.dir / f"{name}.npy", vectors)  # vectors first: keys make them visible
        self._write(self.dir / f"{name}.keys.npy", key_array)
        for row, i in enumerate(fresh):
            self._index[keys[i]] = (name, row)

    def get_or_encode(self, texts: Sequence[str], encode: Callable[[list[str]], np.ndarray],
                      chunk: int = 50_000) -> np.ndarray:
        """Embeddings (float32) for ``texts``; only texts not yet cached are encoded, in chunks that
        are stored as they finish."""
        keys = [text_key(t) for t in texts]
        missing: dict[bytes, str] = {}
        for k, t in zip(keys, texts):
            if k not in self._index and k not in missing:
                missing[k] = t
        todo = list(missing.values())
        for start in range(0, len(todo), chunk):
            part = todo[start:start + chunk]
            self.add(part, encode(part))
            self.encoded_texts += len(part)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i, k in enumerate(keys):
            shard, row = self._index[k]
            out[i] = self._shard(shard)[row]
        # unmap the shards again: pages of a mapped file count in the process's resident memory, so a
        # stage streaming a large pool through the cache would otherwise hold all of it
        self._shards.clear()
        if self.dtype != np.float32:  # float16 storage: renormalise after the round trip
            out /= np.linalg.norm(out, axis=1, keepdims=True).clip(min=1e-12)
        return out

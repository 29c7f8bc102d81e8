"""Embedding cache keyed by (model fingerprint, text hash), stored as memory-mapped arrays.

Layout: ``<root>/<model fingerprint>-<dtype>/shard-<n>.npy`` (float16 or float32 rows) with
``shard-<n>.keys.npy`` (the 16-byte BLAKE2b hashes of the texts, same order). Shards are only ever
added, each written atomically, so an interrupted encode loses nothing already stored and a
concurrent reader never sees a half-written shard. A text already in any shard is never encoded
again — across reruns, datasets and stages that use the same model: mine and evaluate share
``<run_dir>/cache/embeddings/`` (a float16 cache and a float32 one of the same model are separate
directories, so a stage's result never depends on which precision another stage stored).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from embed_core.artifacts import FILE_MODE


def text_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class EmbeddingCache:
    def __init__(self, root: str | Path, model_fingerprint: str, dim: int, dtype: str = "float16"):
        self.dtype = np.dtype(dtype)
        self.dir = Path(root) / f"{model_fingerprint}-{self.dtype.name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dim = dim
        self._index: dict[bytes, tuple[int, int]] = {}
        self._shards: dict[int, np.ndarray] = {}
        for keys_path in sorted(self.dir.glob("shard-*.keys.npy")):
            n = int(keys_path.name.split("-")[1].split(".")[0])
            keys = np.load(keys_path)
            for row, key in enumerate(keys):
                self._index.setdefault(key.tobytes(), (n, row))
        self.encoded_texts = 0  # texts actually sent to the model through this cache object

    def __len__(self) -> int:
        return len(self._index)

    def _shard(self, n: int) -> np.ndarray:
        if n not in self._shards:
            self._shards[n] = np.load(self.dir / f"shard-{n:05d}.npy", mmap_mode="r")
        return self._shards[n]

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
        n = max((s for s, _ in self._index.values()), default=-1) + 1
        vectors = embeddings[fresh].astype(self.dtype)
        key_array = np.frombuffer(b"".join(keys[i] for i in fresh), dtype="V16")
        self._write(self.dir / f"shard-{n:05d}.npy", vectors)  # vectors first: keys make them visible
        self._write(self.dir / f"shard-{n:05d}.keys.npy", key_array)
        for row, i in enumerate(fresh):
            self._index[keys[i]] = (n, row)

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
        if self.dtype != np.float32:  # float16 storage: renormalise after the round trip
            out /= np.linalg.norm(out, axis=1, keepdims=True).clip(min=1e-12)
        return out

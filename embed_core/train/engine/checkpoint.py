"""Training checkpoints: ``<run_dir>/checkpoints/<stage>/step-N/`` with the back end's state (model,
optimizer, scheduler: whole, sharded or DeepSpeed's layout), every rank's RNG states (its own device's), and rank 0's
``trainer_state.json`` (step, sampler, metrics, dev rows). A checkpoint becomes visible only once
complete (written as ``.tmp-step-N``, then renamed); a write that fails keeps the last complete one.
State files are read with ``weights_only=True``: a checkpoint from a copied run directory is never
unpickled into code.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embed_core.errors import CheckpointError, ConfigError, DiskFullError, disk_full_errno, printable
from embed_core.dist.distributed import barrier

PREFIX = "step-"


@contextmanager
def checkpoint_write(tmp: Path, complete: list[Path]) -> Iterator[None]:
    """A checkpoint write that fails (torch reports a full disk as a RuntimeError with no errno) is
    one line naming the checkpoint, the free space left and the last complete checkpoint, which is
    kept (a checkpoint becomes visible only once whole)."""
    try:
        yield
    except (RuntimeError, OSError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            stat = os.statvfs(tmp.parent)
            free = f"{stat.f_bavail * stat.f_frsize / 2 ** 20:.0f} MiB free there"
        except OSError:
            free = "free space unknown"
        last = complete[-1].name if complete else "none yet"
        full = disk_full_errno(exc)
        if full is not None:
            raise DiskFullError(f"{tmp}: no space left to write the checkpoint ({errno.errorcode.get(full, full)}: the "
                                f"disk is full, or a quota or file-size limit is reached; {free} once it was removed); "
                                f"the last complete checkpoint ({last}) is kept and a rerun resumes from it: free "
                                "space on the run directory's disk and run again") from exc
        raise CheckpointError(f"{tmp}: writing the checkpoint failed ({printable(exc, 120)}; {free}: a full disk?); "
                              f"the last complete checkpoint ({last}) is kept and a rerun resumes from it") from exc


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """The RNGs' states as tensors and plain data, so ``torch.load(weights_only=True)`` reads them
    back (a checkpoint from a copied run directory is never unpickled): Python's, numpy's, torch's
    CPU generator and the generator of this rank's CUDA device (``device``; the current one when
    None, none on a CPU device), the only one its dropout draws from. Not every visible GPU's: a
    resume where a rank sees fewer GPUs (per-rank ``CUDA_VISIBLE_DEVICES``) must still fit."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    index = _cuda_index(device)
    if index is not None:
        state["cuda"] = torch.cuda.get_rng_state(index)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what :func:`rng_state` saved, the CUDA generator into ``device``'s. A checkpoint of
    before this format holds every visible GPU's generator (a list); the rank's own is the one of
    its ``LOCAL_RANK``, the device it trained on then, or the only one saved."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    index = _cuda_index(device)
    if "cuda" in state and index is not None:
        saved = state["cuda"]
        if isinstance(saved, (list, tuple)):  # every visible GPU's, as checkpoints before saved them
            local = int(os.environ.get("LOCAL_RANK", "0") or 0)
            saved = saved[local] if 0 <= local < len(saved) else saved[0]
        torch.cuda.set_rng_state(saved, index)


def _cuda_index(device: torch.device | None) -> int | None:
    """The CUDA device whose generator is this rank's: ``device``'s, the current one when None
    (None without CUDA or for a CPU device)."""
    if device is not None:
        return (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def save_plain(obj: Any, path: Path) -> None:
    """``torch.save`` through a Python file: a write that fails for lack of space is then an
    ``OSError`` with its errno (ENOSPC), which ``torch.save`` to a path reports as a RuntimeError
    with none (``disk_full_errno`` tells it from a bug)."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)


def load_plain(path: Path, **kwargs: Any) -> Any:
    """A checkpoint state file with ``weights_only=True``: tensors and plain data only. A file that
    holds any other pickled object is refused instead of run (run directories travel between people)."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        found = re.search(r"unsupported GLOBAL (\S+)|Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"it references {found.group(1) or found.group(2)}" if found else "it is not tensors and plain data"
        raise CheckpointError(f"{path}: refusing to load: {what}, and loading it could run code; "
                              "pass --no-resume to train from the stage's start, or delete the checkpoint") from None


def complete(directory: Path) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest first."""
    if not directory.exists():
        return []
    return sorted(p for p in directory.glob(f"{PREFIX}*") if (p / "trainer_state.json").exists())


def save(trainer: Any) -> Path:
    """Every rank calls this at the same step: the back end saves its state (each rank its part
    where it is sharded), every rank its own RNG states (its dropout stream), and rank 0 the
    trainer's state; rank 0 makes the checkpoint visible once it is complete."""
    directory, step, rank = trainer.checkpoint_dir, trainer.step, trainer.rank
    final = directory / f"{PREFIX}{step:07d}"
    tmp = directory / f".tmp-{PREFIX}{step:07d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    with checkpoint_write(tmp, complete(directory)):
        extra = trainer.backend.save_state(tmp)
        save_plain(rng_state(trainer.device), tmp / f"rng-{rank}.pt")
    barrier()
    if rank == 0:
        with checkpoint_write(tmp, complete(directory)):
            (tmp / "trainer_state.json").write_text(json.dumps({
                "step": step, "stage": trainer.stage.model_dump(mode="json"), "seed": trainer.seed,
                "world": trainer.world, "sampler": trainer.batches.sampler_state(), "metrics": trainer.metrics,
                "dev": trainer.dev_rows, "best": trainer.best, **extra}, default=_json_default))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # a checkpoint is visible only once complete
        for old in complete(directory)[:-trainer.stage.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load(trainer: Any, path: Path) -> dict[str, Any]:
    """Restore the back end's state and this rank's RNG states from ``path``; returns the trainer's
    state (step, sampler, metrics...). A damaged checkpoint (cut-off, edited or missing state
    files) is a ``CheckpointError`` naming it and ``--no-resume``."""
    try:
        meta = json.loads((path / "trainer_state.json").read_text())
        if meta.get("world", 1) != trainer.world:
            raise ConfigError(f"{path}: saved by {meta.get('world', 1)} processes, resumed by {trainer.world}; resume "
                              "with the same number of processes (or pass --no-resume)")
        trainer.backend.load_state(path, meta)
        set_rng_state(load_plain(path / f"rng-{trainer.rank}.pt"), trainer.device)
        return meta
    except (OSError, ValueError, KeyError, IndexError, TypeError, RuntimeError, EOFError) as exc:
        detail = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise CheckpointError(f"{path}: damaged checkpoint, cannot resume from it ({type(exc).__name__}: {detail}); "
                              "pass --no-resume to train from the stage's start, or delete the checkpoint") from exc


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    raise TypeError(f"not JSON serialisable: {type(obj)}")

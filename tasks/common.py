"""Helpers shared by the stage tasks: cache keys from content fingerprints, refresh when the
artifact on disk is not the one a cache entry stands for."""

from __future__ import annotations

import hashlib
from pathlib import Path

from embed_core.artifacts import stage_is_intact


def stage_cache_key(stage: str, fingerprint: str, run_dir: str) -> str:
    return f"{stage}-" + hashlib.sha256(f"{stage}|{fingerprint}|{Path(run_dir).resolve()}".encode()).hexdigest()


def call_stage_task(task_fn, stage: str, fingerprint: str, **kwargs):
    """Run ``task_fn`` and return its state; bypass the cache if the stage's artifact is missing,
    altered, or was produced from other inputs."""
    intact = stage_is_intact(Path(kwargs["run_dir"]), stage, fingerprint)
    fn = task_fn if intact else task_fn.with_options(refresh_cache=True)
    return fn(**kwargs, return_state=True)

"""The AutoRegEmbed CDA reference: log p_ref(d⁺|e_q) and log p_ref(d⁻ᵢ|e_q) of every CDA example under
the stage's initial encoder, an artifact of its own ``<run_dir>/reference-<stage>/`` (``scores.parquet``)
keyed by that model, the decoder, the examples and the method's settings, so that a resumed or re-run
stage reuses it. Rank 0 computes and commits it; the other ranks read what it committed."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from embed_core.artifacts import StageWriter
from embed_core.config import config_hash
from embed_core.dist.ranks import committed, on_main_rank
from embed_core.fingerprint import code_identity
from embed_core.manifests import ReferenceManifest
from embed_core.model.encoder import model_fingerprint
from embed_core.stage_dirs import reference_name
from embed_core.train.key import LIBRARIES
from embed_core.train.resolved import TrainingStep
from embed_core.train.stage import BODY

REFERENCE_SCHEMA = pa.schema([("example", pa.int64()), ("query", pa.string()), ("positive", pa.string()),
                              ("ref_pos", pa.float64()), ("ref_neg", pa.list_(pa.float64()))])


def reference_scores(step: TrainingStep, trainer, decoder: str, examples: list) -> tuple[Any, Any]:
    """The reference scores of ``examples``: read from ``reference-<stage>/`` when its key matches,
    else computed with ``trainer``'s (initial) encoder and written there, by rank 0 alone
    (``embed_core.dist.ranks``); the other ranks read what it committed."""
    from embed_core.artifacts import stage_is_intact

    arc, run_dir = step.train.autoregembed, step.run_dir
    name = reference_name(step.stage.name)
    blob = json.dumps({"init": model_fingerprint(step.init_model, "compress", arc.context_max_length, False),
                       "decoder": model_fingerprint(decoder, "lm", arc.target_max_length, False),
                       "examples": hashlib.sha256(json.dumps([list(map(str, e.__dict__.values())) for e in examples])
                                                  .encode()).hexdigest(),
                       "autoregembed": config_hash(arc), "code": code_identity(BODY, LIBRARIES)}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()

    def read() -> tuple[Any, Any]:
        committed(run_dir, name, key)
        return _read_reference(run_dir / name)

    def compute() -> tuple[Any, Any]:
        if stage_is_intact(run_dir, name, key):
            return _read_reference(run_dir / name)
        return _write_reference(step, name, key, trainer, decoder, examples)

    return on_main_rank(name, compute, read)


def _read_reference(directory: Path) -> tuple[Any, Any]:
    import pyarrow.parquet as pq
    import torch

    table = pq.read_table(directory / "scores.parquet")
    return (torch.tensor(table.column("ref_pos").to_pylist(), dtype=torch.float32),
            torch.tensor(table.column("ref_neg").to_pylist(), dtype=torch.float32))


def _write_reference(step: TrainingStep, name: str, key: str, trainer, decoder: str,
                     examples: list) -> tuple[Any, Any]:
    """Rank 0: the reference scores computed with the trainer's (initial) encoder and committed."""
    t0 = time.perf_counter()
    ref_pos, ref_neg = trainer.reference_scores()
    table = pa.Table.from_pylist([{"example": i, "query": e.query, "positive": e.positive, "ref_pos": float(p),
                                   "ref_neg": [float(x) for x in n]}
                                  for i, (e, p, n) in enumerate(zip(examples, ref_pos, ref_neg))], schema=REFERENCE_SCHEMA)
    with StageWriter(step.run_dir, name, ReferenceManifest, fingerprint=key, code=code_identity(BODY, LIBRARIES),
                     run_name=step.config.run_name) as writer:
        writer.write_table("scores.parquet", table, kind="reference_scores")
        writer.commit({"stage_name": step.stage.name,
                       "init_model": step.init_model, "decoder": decoder,
                       "counts": {"examples": len(examples), "negatives": int(ref_neg.shape[1])},
                       "timings_s": {"total": round(time.perf_counter() - t0, 3)}})
    return ref_pos, ref_neg

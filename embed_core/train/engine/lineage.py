"""Which records a training stage consumed, per step: ``train-<stage>/lineage.parquet``.

One row per (optimizer step, dataset): the record positions (rows of the upstream record file
``<dataset>.parquet``) that the step's micro-batches of that dataset trained on, sorted int32.
The file's schema metadata (``embedpipe.lineage``) names the upstream stage and, per dataset, its
record file, that file's sha256 and record count, so the answer (``embed_core.runs.lineage``) reads
the ids, texts and source rows from exactly the records that were trained on.

The sampler draws globally: every rank draws the same dataset and the same global batch of
positions and trains its own slice of it (``Trainer._slice``), so the global draw — less the tail
that a dataset smaller than the global batch leaves to no rank (``consumed_positions``) — is what
all ranks together consumed, and rank 0, which writes the stage, knows it without gathering.

A resumed run rebuilds the positions of the steps before its checkpoint by replaying a fresh
sampler for as many micro-batches (the sampler is a deterministic function of its seed and the
dataset sizes; ``replay``), and checks that the replay ends in the checkpoint's sampler state.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from embed_core.errors import EmbedpipeError, printable
from embed_core.train.engine.sampling import GroupedBatchSampler

LINEAGE_FILE = "lineage.parquet"
METADATA_KEY = b"embedpipe.lineage"
LINEAGE_SCHEMA = pa.schema([("step", pa.int32()), ("dataset", pa.dictionary(pa.int16(), pa.string())),
                            ("positions", pa.list_(pa.int32()))])

MAX_METADATA_BYTES = 16 * 1024 * 1024
FILE_NAME = r"[A-Za-z0-9][^/\\\x00]{0,250}"  # one path component in the run directory, never '..' or hidden


class DatasetLineage(BaseModel):
    """The upstream record file one dataset of the stage was drawn from."""

    model_config = ConfigDict(extra="forbid", strict=True)

    file: str = Field(pattern=rf"^{FILE_NAME}\.parquet$", description="Record file name in the upstream stage directory.")
    sha256: str | None = Field(pattern=r"^[0-9a-f]{64}$", description="Its SHA-256 when the stage trained on it.")
    records: int = Field(ge=0, description="Its record count then.")


class LineageMetadata(BaseModel):
    """The ``embedpipe.lineage`` schema metadata of a lineage file (written by ``_lineage`` in
    ``embed_core.train.run``); read back only through ``read_metadata``, which refuses anything else."""

    model_config = ConfigDict(extra="forbid", strict=True)

    upstream: str = Field(pattern=rf"^{FILE_NAME}$", description="Stage directory of the run holding the record files.")
    datasets: dict[str, DatasetLineage] = Field(description="Per dataset, the record file its positions are rows of.")
    steps: int = Field(ge=0, description="Optimizer steps the stage ran.")
    model_step: int = Field(ge=0, description="The step whose weights the stage kept.")
    grad_accum: int = Field(ge=1, description="Micro-batches per optimizer step.")
    processes: int = Field(ge=1, description="Processes that trained the stage.")
    origin_weight: dict[str, float] = Field(default_factory=dict, description="The stage's origin_weight "
                                            "(record origin -> loss and sampling weight), when it set one.")


# (optimizer step counted from 1, dataset, global record positions consumed)
Consumed = tuple[int, str, np.ndarray]


def consumed_positions(indices: list[int], world: int) -> np.ndarray:
    """The positions of a global draw that some rank trains on: ``world`` equal slices of it."""
    per = len(indices) // world
    return np.asarray(indices[:per * world], dtype=np.int32)


def replay(sampler: GroupedBatchSampler, steps: int, grad_accum: int, world: int) -> list[Consumed]:
    """What the first ``steps`` optimizer steps consumed, drawn again from a fresh copy of
    ``sampler``; raises ValueError when the replay does not end in ``sampler``'s state (the
    checkpoint's sampler was not this one's)."""
    fresh = sampler.restarted()
    out: list[Consumed] = []
    for micro in range(steps * grad_accum):
        drawn = fresh.next_batch()
        out.append((micro // grad_accum + 1, drawn.dataset, consumed_positions(drawn.indices, world)))
    if json.dumps(fresh.state_dict(), sort_keys=True) != json.dumps(sampler.state_dict(), sort_keys=True):
        raise ValueError(f"replaying {steps} steps of the sampler does not reach the checkpoint's sampler state")
    return out


def lineage_table(consumed: list[Consumed], metadata: dict[str, Any]) -> pa.Table:
    """One row per (step, dataset) with its sorted positions; ``metadata`` in the schema."""
    merged: dict[tuple[int, str], list[np.ndarray]] = {}
    for step, dataset, positions in consumed:
        merged.setdefault((step, dataset), []).append(positions)
    keys = sorted(merged)
    positions = [np.unique(np.concatenate(merged[k])).astype(np.int32) for k in keys]
    offsets = np.zeros(len(positions) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in positions], out=offsets[1:])
    flat = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int32)
    schema = LINEAGE_SCHEMA.with_metadata({METADATA_KEY: json.dumps(metadata, sort_keys=True).encode()})
    return pa.Table.from_arrays([
        pa.array([k[0] for k in keys], pa.int32()),
        pa.array([k[1] for k in keys], pa.string()).dictionary_encode().cast(LINEAGE_SCHEMA.field("dataset").type),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.int32()))], schema=schema)


def read_metadata(schema: pa.Schema, path: object = LINEAGE_FILE) -> dict[str, Any]:
    """The ``embedpipe.lineage`` metadata of the lineage file ``path`` (its schema ``schema``),
    checked against ``LineageMetadata``; an EmbedpipeError naming the file and the field otherwise
    (the file names other files to read: nothing it says is used unchecked)."""
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if not raw:
        raise EmbedpipeError(f"{path}: no lineage metadata (not a lineage file)")
    if len(raw) > MAX_METADATA_BYTES:
        raise EmbedpipeError(f"{path}: lineage metadata of {len(raw)} bytes, more than a lineage file has "
                             f"({MAX_METADATA_BYTES}): the file is damaged")
    try:
        return LineageMetadata.model_validate(json.loads(raw)).model_dump(exclude_unset=True)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        if isinstance(exc, ValidationError):
            err = exc.errors()[0]
            where = ".".join(map(str, err["loc"])) or "(top level)"
            raise EmbedpipeError(f"{path}: lineage metadata field {printable(where, 80)}: {err['msg']}: "
                                 "the file is damaged") from None
        raise EmbedpipeError(f"{path}: lineage metadata is not JSON ({exc}): the file is damaged") from None

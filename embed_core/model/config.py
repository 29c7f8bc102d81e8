"""Encoding settings the mine and evaluate stages share: where texts are encoded
(``embed_core.engine``) and where their embeddings are cached (``embed_core.model.embedding_cache``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from embed_core.config_base import StrictModel

class EngineConfig(StrictModel):
    """Where the encode-heavy work of a stage runs (``embed_core.engine``)."""

    kind: Literal["local", "ray"] = Field("local", description="local: in the stage's process; ray: Ray actors that "
                                          "hold the model, once per stage and model (needs the 'ray' extra).")
    address: str | None = Field(None, description="ray: None = start a local Ray instance for the stage and stop it "
                                "after; 'auto' = join the running cluster; 'ray://host:10001' = a remote one.")
    num_workers: int = Field(2, ge=1, description="ray: encoding actors (each loads the model once per stage).")
    num_gpus_per_worker: float = Field(0.0, ge=0, description="ray: GPUs per actor (1 = one GPU each); 0 = CPU.")
    cpus_per_worker: float = Field(1.0, gt=0, description="ray: CPUs reserved per actor.")
    batch_size: int = Field(4096, ge=1, description="ray: texts per batch sent to an actor (the actor batches "
                                                    "them by token budget, as the local encoder does).")


class EmbeddingCacheConfig(StrictModel):
    """Where embeddings of models that do not change with the run (the base model, models outside
    the run directory) are cached; the run's own models always use {run_dir}/cache/embeddings."""

    machine_wide: bool = Field(True, description="Share those embeddings across run directories on this machine "
                                                 "($EMBEDPIPE_CACHE_DIR/embeddings, default ~/.cache/embedpipe/embeddings); "
                                                 "false keeps every embedding inside the run directory.")
    max_gb: float = Field(20.0, gt=0, description="Size cap of the machine-wide cache: the least recently used "
                                                  "models' embeddings are removed beyond it.")

"""The mine stage's config section: the mining model, the rank window and margins, the FAISS index."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from embed_core.config_base import StrictModel
from embed_core.model.config import EngineConfig

class IndexConfig(StrictModel):
    """The FAISS index the pool is searched with: any ``faiss.index_factory`` string over inner
    product (cosine on the L2-normalised embeddings)."""

    factory: str = Field(
        "Flat", description="faiss.index_factory string: 'Flat' (exact, the default), 'HNSW32' (graph), "
                            "'IVF4096,Flat' (clusters), 'IVF4096,PQ64' (clusters + product quantisation: "
                            "about 64 bytes per vector for pools of 10M+). Indexes that need training are "
                            "trained on a seeded sample of train_size pool vectors.")
    nprobe: int = Field(32, ge=1, description="IVF indexes: clusters searched per query (capped at their number).")
    ef_search: int = Field(128, ge=1, description="HNSW indexes: search depth (at least 2 × range_max).")
    train_size: int = Field(100_000, ge=1, description="IVF / PQ: pool vectors sampled (seeded) to train the index; "
                                                       "faiss wants about 39 per cluster.")
    add_chunk_size: int = Field(16384, ge=1, description="Pool texts encoded and added to the index at a time "
                                                         "(memory stays flat in the pool size).")
    on_disk: bool = Field(False, description="IVF indexes only: fill the index in shards of add_chunk_size and "
                                             "merge their inverted lists into one memory-mapped file in the "
                                             "stage's scratch directory (faiss OnDiskInvertedLists), for pools "
                                             "whose index does not fit in memory; searched on the CPU.")
    gpu: bool = Field(True, description="Search on every visible GPU when faiss-gpu is installed "
                                        "(faiss.index_cpu_to_all_gpus); ignored without one, and with on_disk.")

    @model_validator(mode="after")
    def _on_disk_needs_ivf(self) -> "IndexConfig":
        if self.on_disk and "IVF" not in self.factory.upper():
            raise ValueError(f"on_disk keeps an IVF index's lists on disk; factory {self.factory!r} is no IVF index")
        return self


class TeacherConfig(StrictModel):
    """A stronger model that rescores the mined candidates (``embed_core.mine.teacher``): the window's
    candidates it scores at or above the record's lowest positive are dropped as false negatives, and
    its scores of every positive and negative are kept in ``positive_scores`` / ``negative_scores``
    (the targets of the ``margin_mse`` and ``listwise_kl`` losses)."""

    path: str = Field(description="Local model directory: a sentence-transformers CrossEncoder (kind cross_encoder, "
                                  "scored as raw logits) or any embedding model the mine stage can encode with, "
                                  "'default' included (kind embedder, scored by cosine).")
    kind: Literal["cross_encoder", "embedder"] = Field(description="How the teacher scores a (query, text) pair: "
                                                                  "jointly (cross_encoder) or by the cosine of "
                                                                  "their embeddings (embedder).")
    pooling: Literal["mean", "cls", "last_token"] = Field("mean", description="kind embedder: pooling of its token "
                                                                              "states.")
    max_length: int = Field(512, ge=8, description="Tokens per pair (cross_encoder) or per text (embedder).")
    batch_size: int = Field(32, ge=1, description="Pairs (cross_encoder) or texts (embedder) per batch.")
    margin: float = Field(0.0, ge=0, description="Drop a candidate whose teacher score is at least the lowest "
                                                 "positive's minus this margin (0: at or above the positive).")


class MineConfig(StrictModel):
    """Hard-negative mining (QZhou §6.1: ranks 10–30; NV-Retriever TopK-PercPos positive-aware filter)."""

    model: str = Field("default", description="Local model path, or 'default' (packaged all-MiniLM-L6-v2).")
    pooling: Literal["mean", "cls", "last_token"] = Field("mean",
                                                          description="Pooling of the mining model's token states.")
    max_length: int = Field(256, ge=8, description="Tokens per text when encoding.")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto",
                                                       description="auto: bf16 on CUDA or CPUs with native bf16.")
    batch_size: int = Field(64, ge=1, description="Texts per encoding batch.")
    tasks: list[str] = Field(default_factory=lambda: ["retrieval", "classification"],
                             description="Tasks whose records get mined negatives.")
    datasets: list[str] | None = Field(None, description="Only these datasets, by their prepare.sources name "
                                       "(default: all with a mined task).")
    corpora: dict[str, str] = Field(default_factory=dict,
                                    description="dataset -> BEIR directory whose corpus is the candidate pool "
                                                "(default pool: the passages of a corpus source of that name, else "
                                                "the dataset's own positives and negatives).")
    range_min: int = Field(10, ge=0, description="First rank (0-based) of the window, after removing positives.")
    range_max: int = Field(30, ge=1, description="End of the rank window (exclusive).")
    num_negatives: int = Field(4, ge=1, description="Negatives per record (QZhou §6.3: 4).")
    relative_margin: float | None = Field(0.95, gt=0, le=1, description="Keep a candidate only if score < margin × lowest positive score.")
    absolute_margin: float | None = Field(None, ge=0, description="Keep a candidate only if score < lowest positive score − margin.")
    sampling: Literal["top", "random"] = Field("top", description="top: the best-ranked candidates of the window; random: a seeded sample of it.")
    only_missing: bool = Field(True, description="Leave records that already have num_negatives negatives alone.")
    pad_random: bool = Field(False, description="Pad records with too few negatives with random pool texts (off: report them).")
    index: IndexConfig = Field(default_factory=IndexConfig, description="FAISS index for the search.")
    query_chunk_size: int = Field(2048, ge=1,
                                  description="Queries searched at once (memory stays flat in the query count).")
    cache_dtype: Literal["float16", "float32"] = Field("float16",
                                                       description="Precision of the embedding cache on disk.")
    engine: EngineConfig = Field(default_factory=EngineConfig,
                                 description="Where the pool and the queries are encoded: local or a Ray cluster.")
    teacher: TeacherConfig | None = Field(None, description="Rescore the mined candidates with a stronger model: "
                                          "drops the ones it rates as relevant as the positive and keeps its scores "
                                          "for distillation (cross-encoder teachers run locally). None: off.")

    @field_validator("range_max")
    @classmethod
    def _window(cls, v: int, info) -> int:
        if v <= info.data.get("range_min", 0):
            raise ValueError("range_max must be greater than range_min")
        return v


# Settings a re-mining step takes from its training stage, never from the config: the model is the
# one the stage starts from, pooled as the run trains it.
REMINE_FIXED = ("model", "pooling")


def check_remine_keys(overrides: dict) -> dict:
    """A training stage's ``remine`` overrides: MineConfig keys, except the fixed ones (a ValueError
    names the first bad key, with the closest allowed one)."""
    import difflib

    allowed = [k for k in MineConfig.model_fields if k not in REMINE_FIXED]
    for key in overrides:
        if key in REMINE_FIXED:
            raise ValueError(f"{key!r} is set by the stage (the model it starts from, with train.pooling)")
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            raise ValueError(f"{key!r} is not a mine setting" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return overrides


def remine_settings(mine: MineConfig | None, overrides: dict, *, model: str, pooling: str) -> MineConfig:
    """The settings of a re-mining step: the run's ``mine`` section (its defaults without one),
    ``overrides`` over it (a mapping setting such as ``index`` merges key by key), mining with
    ``model`` pooled by ``pooling``."""
    merged = mine.model_dump() if mine is not None else {}
    for key, value in overrides.items():
        merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    return MineConfig.model_validate({**merged, "model": model, "pooling": pooling})

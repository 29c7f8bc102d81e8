"""Run configuration: plain pydantic models loaded from YAML (nothing hidden in globals).

Relative paths in sources are resolved against ``data_root``, which is itself relative to the
current working directory (the repository root when run through ``make`` or the CLI).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from embed_core.errors import ConfigError
from embed_core.schema import TASKS

SourceKind = Literal[
    "title_body", "claim_evidence", "qa", "sts", "entailment", "classification",
    "pair_classification", "beir", "flagembedding",
]
SOURCE_KINDS: tuple[str, ...] = SourceKind.__args__  # type: ignore[attr-defined]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Names that become file or directory names (run, dataset, evaluation task): one path component,
# printable, short enough for any filesystem, and never '.', '..' or hidden.
PATH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,99}")


def check_path_name(value: str, what: str) -> str:
    """``value`` if it is safe as one path component, else a ValueError saying what is allowed."""
    if not PATH_NAME.fullmatch(value):
        shown = value if len(value) <= 40 else value[:40] + "…"
        raise ValueError(f"{what} {shown!r} becomes a path: use 1-100 letters, digits or '._+=-', starting with "
                         "a letter or digit")
    return value


def one_character_delimiter(v: str | None) -> str | None:
    if v is not None and (len(v) != 1 or v in "\r\n\"" or not v.isprintable() and v != "\t"):
        raise ValueError(f"delimiter must be one character other than a quote or line break, got {v!r}")
    return v


class SourceSpec(_Strict):
    """One raw source and how to turn it into records."""

    name: str = Field(description="Dataset name: the grouping key for batching and the output file name.")
    kind: SourceKind = Field(description="Converter to use.")
    path: str = Field(description="File (or BEIR directory), relative to data_root. '.gz' is read transparently.")
    format: Literal["csv", "tsv", "delimited", "jsonl", "parquet"] | None = Field(
        None, description="File format; inferred from the extension when omitted.")
    delimiter: str | None = Field(None, description="Field delimiter for format 'delimited' (one character, e.g. ';').")
    header: bool = Field(True, description="Whether the first line names the columns.")
    quoting: Literal["auto", "none", "minimal"] = Field("auto", description="CSV/TSV quoting: auto (sniffed), none (quotes are text), minimal (RFC 4180).")
    multiline: bool = Field(False, description="CSV: quoted fields may span lines (RFC 4180). Off: a quote still open "
                            "at the end of its line is a stray quote, that line is quarantined and the next line "
                            "is read as a new row, so one bad quote never swallows later rows.")
    allow_empty: bool = Field(False, description="Accept a source with no data rows (otherwise an error).")
    dev_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Set aside this fraction of the source's rows "
                                "(seeded, by source row, so both directions of a pair stay together) as dev records: "
                                "written to prepare/dev/<name>.parquet, never to training or mining.")
    dev_path: str | None = Field(None, description="A dev file of the same format and columns (e.g. STS-B's "
                                 "sts-dev.csv): all its rows are dev records. Not for beir (use dev_fraction).")
    score_range: tuple[float, float] | None = Field(
        None, description="Scored kinds (sts, flagembedding scores): inclusive [min, max] of a valid score; a row "
        "outside it is quarantined (reason score_range). None = any finite score.")
    columns: dict[str, str | int] = Field(
        default_factory=dict,
        description="Logical field -> column name (or 0-based index when header is false).")
    task: str | None = Field(None, description="Override the task the kind implies.")
    instruction: str = Field("", description="Task instruction stored with every record.")
    label_map: dict[str, Any] | None = Field(None, description="Raw label -> value; replaces the kind's default.")
    split: str = Field("train", description="BEIR qrels split (qrels/<split>.tsv).")
    corpus: str | None = Field(None,
                               description="claim_evidence: JSONL corpus (_id,title,text) to look evidence ids up in.")
    num_negatives: int = Field(4, ge=0, description="classification: negatives of other labels per record.")
    weak_positive_grades: list[float] | None = Field(
        None, description="beir: relevance grades that make a judged document a weak-positive (HMCL level 2) "
        "instead of a positive, e.g. [1] for TREC-DL's 'relevant topic, no answer'.")
    both_directions: bool = Field(True, description="sts/entailment/pair_classification: also emit (text2, text1).")
    max_rows: int | None = Field(None, ge=1, description="Read at most this many data rows (for samples).")
    match: Literal["text", "pair"] = Field(
        "text", description="Contamination sources only: 'text' excludes training records containing any "
        "test text; 'pair' (sts/entailment/pair_classification) only those containing a test pair.")

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str | None) -> str | None:
        if v is not None and v not in TASKS:
            raise ValueError(f"unknown task {v!r}; expected one of {', '.join(TASKS)}")
        return v

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_path_name(v, "dataset name")

    @field_validator("delimiter")
    @classmethod
    def _one_character(cls, v: str | None) -> str | None:
        return one_character_delimiter(v)

    @model_validator(mode="after")
    def _one_dev_split(self) -> SourceSpec:
        if self.dev_path and self.dev_fraction:
            raise ValueError("give dev_path or dev_fraction, not both")
        if self.dev_path and self.kind == "beir":
            raise ValueError("beir sources set aside dev queries with dev_fraction (dev_path is for files)")
        return self

    @field_validator("score_range")
    @classmethod
    def _ordered(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not v[0] < v[1]:
            raise ValueError(f"score_range must be [min, max] with min < max, got {list(v)}")
        return v


class CleaningConfig(_Strict):
    max_chars: int = Field(8000, ge=1, description="Texts longer than this are truncated or quarantined.")
    over_long: Literal["truncate", "quarantine"] = Field("truncate", description="Texts over max_chars: truncate them, or quarantine the row.")
    dedupe: Literal["none", "exact", "normalized"] = Field(
        "normalized", description="'normalized' removes exact duplicates, then duplicates after text normalisation.")


class PrepareConfig(_Strict):
    sources: list[SourceSpec] = Field(min_length=1, description="Raw sources to convert, each into one dataset.")
    cleaning: CleaningConfig = Field(default_factory=CleaningConfig, description="Length limits and deduplication.")
    contamination: list[SourceSpec] = Field(
        default_factory=list,
        description="Evaluation sets whose texts must not appear in training records (QZhou §6.1).")

    @field_validator("sources", "contamination")
    @classmethod
    def _unique_names(cls, specs: list[SourceSpec]) -> list[SourceSpec]:
        seen: dict[str, int] = {}
        for i, spec in enumerate(specs):
            if spec.name in seen:
                raise ValueError(f"items {seen[spec.name]} and {i}: two sources are named {spec.name!r} (each source "
                                 "writes its own dataset: give them distinct names)")
            seen[spec.name] = i
        return specs


SynthStrategy = Literal["paraphrase", "augmentation", "hard_negative"]


class LLMServerConfig(_Strict):
    """Where requests go: any OpenAI-compatible server (OpenAI, vLLM, Ollama, llama.cpp server)."""

    base_url: str | None = Field(None, description="OpenAI-compatible endpoint, e.g. https://api.openai.com/v1 or "
                                 "http://localhost:8000/v1 (vLLM); None with launch: llama_cpp = the launched server.")
    model: str = Field("gemma-3-270m", description="Model name sent with every request (part of the cache key).")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="Environment variable holding the API key; "
                                    "the key itself is never written to configs, logs or artifacts.")
    mode: Literal["chat", "completion"] = Field("completion", description="chat: /chat/completions with the "
                                                "template's messages; completion: /completions with its few-shot text "
                                                "(base models).")
    launch: Literal["none", "llama_cpp"] = Field("none", description="llama_cpp: start a local llama.cpp server "
                                                 "(llama-cpp-python) on loopback when a request needs it, stop it after.")
    gguf: str = Field("default", description="launch: GGUF weights path, or 'default' (packaged Gemma-3-270M).")
    port: int = Field(0, ge=0, le=65535, description="launch: loopback port (0 = a free one).")
    n_ctx: int = Field(2048, ge=256, description="launch: context length.")
    n_threads: int | None = Field(None, ge=1, description="launch: CPU threads. None = the cores minus one (at least "
                                  "1, at most 8): llama.cpp's threads spin at barriers, so with every core in use one "
                                  "other busy process can slow generation 40x; a spare core keeps it steady.")
    startup_timeout_s: float = Field(300.0, gt=0, description="launch: seconds to wait for the server's health check.")
    timeout_s: float = Field(60.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(4, ge=0, description="Retries of a request on timeouts, 429, 5xx and connection errors.")
    backoff_s: float = Field(0.5, ge=0, description="First retry delay; doubles per retry, with full jitter. A "
                             "Retry-After (or retry-after-ms) header of the server wins, up to max_retry_after_s.")
    max_backoff_s: float = Field(20.0, ge=0, description="Longest retry delay.")
    max_retry_after_s: float = Field(60.0, ge=0, description="Longest Retry-After honoured; a server asking for "
                                     "more gets the jittered backoff instead.")
    structured_output: Literal["auto", "on", "off"] = Field(
        "auto", description="mode chat: send a JSON-schema response_format built from the answer model "
        "(OpenAI, vLLM and llama.cpp constrain the reply to it). auto = on, and off for the rest of the run "
        "when the server rejects it; the reply is parsed and validated the same way either way.")
    max_concurrency: int = Field(4, ge=1, description="Requests in flight at once (per endpoint).")
    base_urls: list[str] = Field(default_factory=list, description="Several OpenAI-compatible endpoints serving the "
                                 "same model (instead of base_url): requests are shared, max_concurrency each, and a "
                                 "request that cannot connect, times out or gets a 5xx moves to another endpoint; the "
                                 "failing one gets no requests for endpoint_cooldown_s. The request cache does not "
                                 "depend on the endpoint, so a resumed run repeats nothing.")
    endpoint_cooldown_s: float = Field(30.0, ge=0, description="base_urls: seconds an endpoint that failed is left out "
                                       "(while another is up).")

    @model_validator(mode="after")
    def _one_kind_of_endpoint(self) -> "LLMServerConfig":
        if self.base_urls and self.base_url:
            raise ValueError("set base_url (one endpoint) or base_urls (several), not both")
        if self.base_urls and self.launch != "none":
            raise ValueError("base_urls are servers you run; launch: llama_cpp starts one itself (use launch: none)")
        if len(set(self.base_urls)) != len(self.base_urls):
            raise ValueError("base_urls lists an endpoint twice")
        return self


class SamplingConfig(_Strict):
    temperature: float = Field(0.7, ge=0, description="Sampling temperature.")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling mass.")
    max_tokens: int = Field(192, ge=1, description="Max generated tokens per request.")
    seed: int | None = Field(None, description="Sent to servers that honour it (per attempt: seed + attempt).")


class SynthFilterConfig(_Strict):
    """Quality filters (QZhou §6.1: dedupe, drop low query–positive scores; NV-style easiness bounds)."""

    model: str = Field("default",
                       description="Embedding model that scores generated text ('default': packaged MiniLM).")
    max_length: int = Field(256, ge=8, description="Tokens the filter model reads per text.")
    paraphrase_min_sim: float = Field(0.7, ge=-1, le=1, description="A rewrite must stay this close to its source.")
    pair_min_sim: float = Field(0.3, ge=-1, le=1,
                                description="Generated (query, positive) pairs below this are dropped.")
    negative_min_sim: float = Field(0.2, ge=-1, le=1,
                                    description="A generated hard negative must score above this floor …")
    negative_margin: float = Field(0.0, ge=0, description="… and below sim(query, positive) − margin.")
    min_chars: int = Field(8, ge=1, description="Generated texts shorter than this are dropped.")
    max_chars: int = Field(2000, ge=1, description="Generated texts longer than this are dropped.")


class SynthesizeConfig(_Strict):
    """LLM data synthesis (QZhou §4, §6.1): paraphrase, augmentation, hard-negative generation."""

    server: LLMServerConfig = Field(default_factory=LLMServerConfig,
                                    description="The OpenAI-compatible server (or the local llama.cpp one to launch).")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig,
                                     description="Generation parameters sent with every request.")
    filter: SynthFilterConfig = Field(default_factory=SynthFilterConfig,
                                      description="Quality filters on generated text (embedding similarity, length).")
    strategies: list[SynthStrategy] = Field(default_factory=lambda: ["paraphrase", "augmentation", "hard_negative"],
                                            description="Task rules: retrieval gets all three; nli/sts/pair "
                                            "classification and classification only paraphrase (single sentences).")
    prompt_dir: str | None = Field(None, description="Directory of prompt templates overriding the packaged ones.")
    datasets: list[str] | None = Field(None, description="Only these datasets (default: every dataset below "
                                       "max_dataset_rows).")
    max_dataset_rows: int = Field(60000, ge=1, description="Datasets larger than this are left alone (QZhou: <60k).")
    max_records_per_dataset: int | None = Field(None, ge=1, description="Synthesize from the first N records of a "
                                                "dataset only (bounded runs).")
    hard_negative_fraction: float = Field(0.3, ge=0, le=1, description="Share of retrieval records that get an LLM "
                                          "hard negative (QZhou §6.1: 30%).")
    max_parse_retries: int = Field(2, ge=0, description="Extra requests for an answer that does not parse or validate.")
    max_requests: int | None = Field(None, ge=0, description="Run budget: HTTP requests (cached answers are free).")
    max_tokens: int | None = Field(None, ge=0, description="Run budget: prompt + completion tokens.")


class IndexConfig(_Strict):
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


class EngineConfig(_Strict):
    """Where the encode-heavy work of a stage runs (``embed_core.engine``)."""

    kind: Literal["local", "ray"] = Field("local", description="local: in the stage's process; ray: Ray Data actors "
                                          "that hold the model (needs the 'ray' extra).")
    address: str | None = Field(None, description="ray: None = start a local Ray instance for the stage and stop it "
                                "after; 'auto' = join the running cluster; 'ray://host:10001' = a remote one.")
    num_workers: int = Field(2, ge=1, description="ray: encoding actors (each loads the model once).")
    num_gpus_per_worker: float = Field(0.0, ge=0, description="ray: GPUs per actor (1 = one GPU each); 0 = CPU.")
    cpus_per_worker: float = Field(1.0, gt=0, description="ray: CPUs reserved per actor.")
    batch_size: int = Field(4096, ge=1, description="ray: texts per batch sent to an actor (the actor batches "
                                                    "them by token budget, as the local encoder does).")


class MineConfig(_Strict):
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
    datasets: list[str] | None = Field(None, description="Only these datasets (default: all with a mined task).")
    corpora: dict[str, str] = Field(default_factory=dict,
                                    description="dataset -> BEIR directory whose corpus is the candidate pool "
                                                "(default pool: the dataset's own positives and negatives).")
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

    @field_validator("range_max")
    @classmethod
    def _window(cls, v: int, info) -> int:
        if v <= info.data.get("range_min", 0):
            raise ValueError("range_max must be greater than range_min")
        return v


EvalTaskType = Literal["sts", "retrieval", "classification", "pair_classification"]


class EvalTaskSpec(_Strict):
    """One evaluation task on local files. When ``name`` is an MTEB task name (STSBenchmark, SICK-R,
    SciFact, Banking77Classification, EmotionClassification, AmazonCounterfactualClassification, …)
    MTEB's own task definition is used (metric, splits, classifier protocol, prompt) and only the
    data comes from here; any other name defines a local task of ``type``."""

    name: str = Field(description="Task name; an MTEB name reuses MTEB's task definition.")
    type: EvalTaskType = Field(description="Task type (decides the file layout and the MTEB evaluator).")
    path: str | list[str] = Field(description="sts / pair_classification / classification: the evaluated file "
                                  "(a list is read in order as one split, e.g. SICK-R's three files); "
                                  "retrieval: a BEIR directory (corpus.jsonl[.gz], queries.jsonl, qrels/<split>.tsv).")
    train_path: str | None = Field(None, description="classification: file the classifier is fitted on.")
    format: Literal["csv", "tsv", "delimited", "jsonl", "parquet"] | None = Field(None, description="File format; None = from the file extension.")
    delimiter: str | None = Field(None, description="Field delimiter for format 'delimited' (one character).")
    header: bool = Field(True, description="Whether the first line names the columns.")
    quoting: Literal["auto", "none", "minimal"] = Field("auto", description="CSV/TSV quoting: auto (sniffed), none (quotes are text), minimal (RFC 4180).")
    multiline: bool = Field(False, description="CSV: quoted fields may span lines (RFC 4180), in the evaluated "
                            "file and in train_path. Off: a quote still open at the end of its line is an error.")
    columns: dict[str, str | int] = Field(
        default_factory=dict,
        description="sts: text1, text2, score; pair_classification: text1, text2, label; classification: text, label.")
    label_map: dict[str, int] | None = Field(None, description="pair_classification: raw label -> 0/1.")
    split: str = Field("test", description="Split name reported (and the BEIR qrels split).")
    subset: str = Field("default", description="MTEB subset (e.g. 'en' for AmazonCounterfactualClassification).")
    main_metric: str | None = Field(None, description="Default: MTEB's main score for the task or type.")
    score_range: tuple[float, float] = Field((0.0, 5.0), description="sts: gold score range.")
    instruction: str | None = Field(None, description="Instruction for instruction-following models "
                                                      "(default: MTEB's task prompt, else none).")
    max_rows: int | None = Field(None, ge=1, description="Evaluate only the first N rows/queries (smoke runs).")
    max_corpus: int | None = Field(None, ge=1, description="retrieval: search a corpus of N documents: every "
                                   "document judged for the evaluated queries plus a seeded sample of the others "
                                   "(quick runs; scores are not comparable with the full corpus's, so give the task "
                                   "its own name).")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_path_name(v, "task name")

    @field_validator("delimiter")
    @classmethod
    def _one_character(cls, v: str | None) -> str | None:
        return one_character_delimiter(v)


class GeometryConfig(_Strict):
    task: str = Field(description="Name of an sts task in evaluate.tasks whose sentences are analysed.")
    max_texts: int = Field(1000, ge=2, description="Unique sentences analysed (first N of the file).")
    max_length: int = Field(128, ge=4, description="Tokens per sentence.")


class EmbeddingCacheConfig(_Strict):
    """Where embeddings of models that do not change with the run (the base model, models outside
    the run directory) are cached; the run's own models always use <run_dir>/cache/embeddings."""

    machine_wide: bool = Field(True, description="Share those embeddings across run directories on this machine "
                                                 "($EMBEDPIPE_CACHE_DIR/embeddings, default ~/.cache/embedpipe/embeddings); "
                                                 "false keeps every embedding inside the run directory.")
    max_gb: float = Field(20.0, gt=0, description="Size cap of the machine-wide cache: the least recently used "
                                                  "models' embeddings are removed beyond it.")


class EvaluateConfig(_Strict):
    """Evaluate stage: MTEB on local task data (metrics computed by mteb)."""

    models: list[str] = Field(default_factory=lambda: ["base"],
                              description="'base' (the run's base model), 'trained' (every train-stage checkpoint "
                                          "in the run), or local model directories.")
    base_model: str = Field("default", description="Local path or 'default' (packaged all-MiniLM-L6-v2).")
    tasks: list[EvalTaskSpec] = Field(min_length=1, description="Tasks to evaluate every model on.")
    batch_size: int = Field(64, ge=1, description="Texts per encoding batch.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "fp32", description="fp32 by default so published scores reproduce on any hardware.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Where the task texts are encoded "
                                 "(local, or Ray Data actors); not part of the stage's key: any engine gives the "
                                 "same scores.")
    geometry: GeometryConfig | None = Field(None, description="Token-embedding geometry of every evaluated model "
                                            "(CoDiEmb §4) on the sentences of an STS task; omitted = not computed.")
    push_to_hub: bool = Field(False, description="Upload the released model (<run_dir>/evaluate/model: weights, "
                              "prompts, model card with the scores) to the Hugging Face Hub after the stage commits; "
                              "needs hub_model_id, network and a token (HF_TOKEN or huggingface-cli login).")
    hub_model_id: str | None = Field(None, description="Hub repository for push_to_hub, e.g. my-org/my-embedder.")
    hub_private: bool = Field(True, description="Create the Hub repository as private (if it does not exist).")

    @model_validator(mode="after")
    def _hub_target(self) -> "EvaluateConfig":
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("push_to_hub needs hub_model_id (e.g. my-org/my-embedder)")
        return self

    @model_validator(mode="after")
    def _geometry_task(self) -> "EvaluateConfig":
        if self.geometry is not None:
            sts = [t.name for t in self.tasks if t.type == "sts"]
            if self.geometry.task not in sts:
                raise ValueError(f"geometry.task {self.geometry.task!r} must name an sts task of this section "
                                 f"(sts tasks: {', '.join(sts) or 'none'})")
        return self


class LoraSettings(_Strict):
    """LoRA adapters (peft) on the base model's linear layers; the saved model has them merged, so it
    loads with plain ``transformers``."""

    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling α (the update is scaled by α / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA path.")
    target_modules: list[str] | str = Field("all-linear", description="peft target_modules ('all-linear' = every "
                                            "linear layer except the output head).")


class AutoRegEmbedConfig(_Strict):
    """AutoRegEmbed (autoregembed.txt §3; methods notes part B): k compression tokens appended after
    text + instruction, their last hidden states the embedding and a frozen decoder's prefix.
    Defaults are the paper's (k 5, τ 0.05, β 0.1, sigmoid, one negative, the Table 5 instructions)."""

    compress_tokens: int = Field(5, ge=1, description="k compression tokens <EMBED0..k-1>.")
    context_max_length: int = Field(128, ge=8, description="Encoder input tokens (text + instruction + k).")
    target_max_length: int = Field(64, ge=4, description="Decoder target tokens (plus EOS).")
    decoder: str | None = Field(None, description="Frozen decoder (a causal LM path); None = the base model.")
    beta: float = Field(0.1, gt=0, description="CDA β (DPO-style scale).")
    tau: float = Field(0.05, gt=0, description="CDA temperature τ (the public run script uses 0.1).")
    squash: Literal["sigmoid", "tanh", "logsigmoid"] = Field(
        "sigmoid", description="CDA bounding function (paper: sigmoid; Appendix B/C: tanh, log-sigmoid).")
    reference_sign: Literal["paper", "repo"] = Field(
        "paper", description="CDA S₂'s reference term: 'paper' subtracts β(log p_ref(d⁺) − log p_ref(d⁻)) (DPO), "
        "'repo' adds it, as the authors' code does.")
    num_negatives: int = Field(1, ge=1, description="CDA negatives per example (paper's NLI runs: 1).")
    positive_level: float = Field(0.8, gt=0, le=1, description="CDA: a scored pair is a positive when its score is "
                                  "at least this share of the dataset's highest score.")
    sts_instruction: str = Field("This sentence means in one word: \u201c", description="I_next = I_self for "
                                 "symmetric tasks (Table 5).")
    query_instruction: str = Field("Use one word to represent the query in a retrieval task. The word is: \u201c",
                                   description="Retrieval I_next (queries).")
    passage_instruction: str = Field("Use one word to represent the passage in a retrieval task. The word is: "
                                     "\u201c", description="Retrieval I_self (passages).")
    instruction_template: str = Field("{text}\n{instruction}\n", description="Encoder text before the k tokens "
                                      "(the authors' layout: text, newline, instruction, newline).")


TrainMode = Literal["contrastive", "autoregembed_ic", "autoregembed_cda"]


# Flat loss fields of configs before the loss registry: old key -> (task, loss, parameter), for
# the error that says what to write instead.
MOVED_LOSS_FIELDS: dict[str, tuple[str, str, str]] = {
    "tau": ("retrieval", "infonce", "tau"), "query_negatives": ("retrieval", "infonce", "query_negatives"),
    "cosent_tau": ("sts", "cosent", "tau"), "bce_scale": ("retrieval", "pair_bce", "scale"),
    "bce_bias": ("retrieval", "pair_bce", "bias"), "bce_bias_warmup_from": ("retrieval", "pair_bce", "bias_warmup_from"),
    "bce_cutoff": ("retrieval", "pair_bce", "cutoff"), "hmcl_tau": ("retrieval", "hmcl", "tau"),
    "hmcl_weights": ("retrieval", "hmcl", "mu_c/mu_l/mu_e/mu_ed"), "hmcl_levels": ("sts", "hmcl", "levels"),
    "num_positives": ("retrieval", "codiemb_ir", "num_positives"), "codiemb_sts_tau": ("sts", "codiemb_sts", "tau"),
    "codiemb_sts_weights": ("sts", "codiemb_sts", "pearson_weight/rank_kl_weight/pro_weight")}


class DevTaskSpec(EvalTaskSpec):
    """A dev task: declared like an evaluation task (a local file or BEIR directory in ``path``), or
    ``dataset: <name>`` for the dev records prepare set aside for that dataset (sts, nli and
    pair_classification records become an sts task, retrieval records a retrieval task over their
    positives and negatives)."""

    path: str | list[str] = Field("", description="Task data as for evaluate tasks (unused with dataset).")
    dataset: str | None = Field(None, description="Use prepare's dev records of this dataset (prepare/dev/<name>.parquet).")
    weight: float = Field(1.0, ge=0, description="Weight of this task's main score in the selection score.")

    @model_validator(mode="after")
    def _data(self) -> DevTaskSpec:
        if not self.dataset and not self.path:
            raise ValueError(f"dev task {self.name!r}: give path (a task file) or dataset (prepare's dev records)")
        return self


class DevConfig(_Strict):
    """Evaluation on dev tasks while a stage trains (never on evaluate's test sets), and which
    weights the stage keeps."""

    tasks: list[DevTaskSpec] = Field(min_length=1, description="Dev tasks, scored every eval_every steps.")
    eval_every: int = Field(100, ge=1, description="Score the dev tasks every this many steps (and at the last step).")
    max_rows: int | None = Field(500, ge=1, description="Rows (pairs, queries, texts) per dev task unless the task "
                                 "sets max_rows; None = all.")
    select: Literal["best", "last"] = Field("best", description="best: the stage's model is the weights with the "
                                            "highest weighted dev score; last: the final step's.")


class TrainStageConfig(_Strict):
    """One training stage. Defaults are QZhou §6.3's where it states them (τ 0.02, 4 hard negatives,
    weight decay 0.01, warm-up 300, lr 3e-5 / 2e-5, batch 256 for InfoNCE data and 768 for CoSENT
    data, η 0.72 in stage 2); α = 0.5 is gte's (QZhou cites gte and does not give α)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="Stage name: output goes to <run_dir>/train-<name>/.")
    tasks: list[str] | None = Field(None,
                                    description="Only datasets of these tasks (stage 1: [retrieval]); None = all.")
    datasets: list[str] | None = Field(None, description="Only these datasets (default: all with a trainable task).")
    init_from: str | None = Field(None, description="Start from this earlier stage's model, or 'base' for the base "
                                  "model (default: the previous stage).")
    mode: TrainMode = Field("contrastive", description="contrastive: the task losses below on pooled embeddings; "
                            "autoregembed_ic / autoregembed_cda: AutoRegEmbed's information compression / "
                            "conditional distribution alignment (train.autoregembed).")
    steps: int = Field(32000, ge=1, description="Optimizer steps (QZhou: 32k stage 1, 8k stage 2).")
    lr: float = Field(3e-5, gt=0, description="Peak learning rate (QZhou: 3e-5 stage 1, 2e-5 stage 2).")
    warmup_steps: int = Field(300, ge=0, description="Linear warm-up steps.")
    scheduler: Literal["cosine", "linear", "constant"] = Field("cosine",
                                                               description="Learning-rate decay after warm-up.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (not on biases and norms).")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; None = off.")
    batch_size: dict[str, int] = Field(
        default_factory=lambda: {"retrieval": 256, "classification": 256, "sts": 768, "nli": 768,
                                 "pair_classification": 768},
        description="Batch size per task (per device).")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    grad_cache_chunk: int | None = Field(None, ge=1, description="GradCache: embed in chunks of this many texts "
                                         "with cached gradients (memory independent of batch size); None = off.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass (less memory, more time).")
    length_buckets: int = Field(4, ge=1, description="Each text group of a batch is length-sorted and encoded in at "
                                "most this many forward passes, each padded to its own longest text (the split "
                                "that wastes the fewest padded positions); the loss still sees the whole batch. "
                                "1 = one pass padded to the group's longest text.")
    bucket_pass_cost: int | None = Field(None, ge=0, description="Padded positions an extra length-bucket pass "
                                         "must save to be made; None = auto: 0 in fp32, 8192 under bf16 autocast, "
                                         "where small matmuls are overhead-bound (a 2-core AMX CPU: STS-B batches "
                                         "0.51 s/step in one pass, 0.67 in four; fp32 0.85 and 0.68).")
    alpha: float = Field(0.5, ge=0, description="Dataset sampling exponent (Eq. 4).")
    eta: float | None = Field(None, ge=0, le=1,
                              description="Global retrieval ratio η (stage 2: 0.72); None = Eq. 4 only.")
    dataset_weight: dict[str, float] = Field(default_factory=dict, description="Dataset -> multiplier of its "
                                             "size^α sampling weight (default 1; 0 leaves it out), applied before "
                                             "η splits retrieval from the rest, e.g. {stsb: 3.0}.")
    num_hard_negatives: int = Field(4, ge=0, description="Hard negatives per query (QZhou: 4).")
    query_max_length: int = Field(256, ge=8, description="Tokens per query (and per text of a scored pair).")
    passage_max_length: int = Field(512, ge=8, description="QZhou uses 1536 for a 7B decoder.")
    checkpoint_every: int = Field(500, ge=1, description="Save a resumable checkpoint every this many steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept (the newest).")
    log_every: int = Field(10, ge=1, description="Log a progress line every this many steps.")
    losses: dict[str, Any] = Field(default_factory=dict, description=(
        "Loss per task instead of QZhou's (retrieval infonce, classification cls_infonce, sts/nli/"
        "pair_classification cosent): {task: {name: <loss>, <parameter>: <value>, ...}} or {task: <loss>}; "
        "the losses and their parameters are listed in docs/configuration.md."))
    alternate_tasks: bool = Field(False, description="Alternate retrieval and non-retrieval batches step by step "
                                  "(CoDiEmb); off = draw by the sampling weights.")
    dev: DevConfig | None = Field(None, description="Dev evaluation during training and best-model selection; "
                                  "None = train to the last step.")

    @model_validator(mode="before")
    @classmethod
    def _moved_loss_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, (task, loss, param) in MOVED_LOSS_FIELDS.items():
                if key in data:
                    raise ValueError(f"'{key}' moved into the loss's parameters: write "
                                     f"losses: {{{task}: {{name: {loss}, {param}: {data[key]!r}}}}} instead")
        return data

    @field_validator("dataset_weight")
    @classmethod
    def _non_negative_weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in v.items() if w < 0}
        if bad:
            raise ValueError(f"dataset_weight must be >= 0 (got {bad})")
        return v

    @field_validator("losses")
    @classmethod
    def _known_losses(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            return v
        from embed_core.losses import validate_loss_spec  # torch-heavy: only when a stage names a loss

        return {task: validate_loss_spec(task, spec) for task, spec in v.items()}


class TrainConfig(_Strict):
    base_model: str = Field("default", description="Local path or 'default' (packaged all-MiniLM-L6-v2).")
    gguf_file: str | None = Field(None, description="GGUF weights file inside base_model (decoder LMs).")
    pooling: Literal["mean", "cls", "last_token"] = Field("mean",
                                                          description="Pooling of the token states into one embedding.")
    bidirectional: bool = Field(False, description="Make a decoder's causal attention bidirectional (QZhou §3.1).")
    max_length: int = Field(256, ge=8, description="Max tokens recorded in the saved model (inference).")
    use_instructions: bool = Field(True, description="Prepend each dataset's instruction (query side for "
                                   "retrieval, both sides for symmetric tasks).")
    instruction_template: str = Field("Instruct: {instruction}\nQuery: {text}",
                                      description="How an instruction is put before a text ({instruction}, {text}).")
    exclude_instruction_from_pooling: bool = Field(False, description="Pool over the text's tokens only, not the instruction's.")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="Training compute: auto = bf16 autocast "
                                                        "on CUDA and on CPUs with native bf16 (AMX / AVX512-BF16), "
                                                        "fp32 elsewhere; fp32 for bit-exact resumes.")
    deepspeed: dict[str, Any] | None = Field(None, description="DeepSpeed config (ZeRO stage etc.); needs the deepspeed extra.")
    lora: LoraSettings | None = Field(None, description="Train LoRA adapters instead of all weights (peft; the "
                                      "llm-train extra); None = full fine-tuning.")
    work_pool: str | None = Field(None, description="Prefect work pool whose deployment of the train flow runs the "
                                  "training stages when the pipeline runs as a deployment (e.g. gpu); None = in "
                                  "the pipeline's own process. The run directory must be on storage both pools mount.")
    autoregembed: AutoRegEmbedConfig = Field(default_factory=AutoRegEmbedConfig, description="Settings of the AutoRegEmbed modes (stages with mode autoregembed_*).")
    stages: list[TrainStageConfig] = Field(min_length=1, description="Training stages, run in order (QZhou: retrieval only, then all tasks).")

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, v: list[TrainStageConfig]) -> list[TrainStageConfig]:
        names = [s.name for s in v]
        if len(set(names)) != len(names):
            raise ValueError("stage names must be unique")
        return v

    @model_validator(mode="after")
    def _grad_cache_under_deepspeed(self) -> "TrainConfig":
        # GradCache runs one backward per chunk before the optimizer step; DeepSpeed reduces (ZeRO-2/3:
        # partitions) gradients in backward hooks that expect one backward per micro-batch
        # (sentence-transformers#3173, tevatron#206), so the combination is refused, not guessed at.
        cached = [s.name for s in self.stages if s.grad_cache_chunk]
        if self.deepspeed is not None and cached:
            zero = int((self.deepspeed.get("zero_optimization") or {}).get("stage", 0))
            raise ValueError(f"grad_cache_chunk (stages {', '.join(cached)}) does not work with DeepSpeed (ZeRO stage "
                             f"{zero}): train without train.deepspeed (multi-process GradCache works under torchrun), "
                             "or use gradient_checkpointing instead of GradCache")
        return self


class SweepConfig(_Strict):
    """A search over one train stage's settings (``embedpipe sweep``): every variant is that stage
    with some settings changed, trained on the run's cached upstream artifacts, scored on the
    stage's dev tasks; the best dev score wins and is evaluated on the test tasks."""

    stage: str = Field(description="Name of the train stage whose settings vary (it must have a dev section).")
    method: Literal["grid", "random"] = Field("grid", description="grid: every combination; random: `samples` "
                                              "combinations drawn with the run's seed.")
    samples: int = Field(8, ge=1, description="random: variants drawn from the grid (without repetition).")
    params: dict[str, list[Any]] = Field(min_length=1, description="Stage setting -> values to try; dotted names "
                                         "reach into mappings (losses.sts, batch_size.retrieval). E.g. "
                                         "{lr: [1.0e-5, 2.0e-5], losses.sts: [cosent, angle]}.")
    max_concurrency: int = Field(1, ge=1, description="Variants trained at once (each in its own process, so "
                                 "results do not depend on it).")
    soup_top_k: int | None = Field(None, ge=2, description="Also average the weights of the k best variants on dev "
                                   "(a uniform model soup, Wortsman et al. 2022) into sweep-<stage>-soup/model, "
                                   "scored on dev and test next to the winner; None = no soup.")

    @field_validator("params")
    @classmethod
    def _non_empty(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        empty = [k for k, values in v.items() if not values]
        if empty:
            raise ValueError(f"params.{empty[0]}: give at least one value")
        return v


class TrackingConfig(_Strict):
    """Experiment tracking (MLflow). One MLflow run per run directory (named after the run), and one
    nested run per stage result: parameters, counts, per-step training metrics, evaluation scores and
    the model as an artifact. Needs the ``tracking`` extra (``pip install -e ".[tracking]"``)."""

    uri: str | None = Field(None, description="MLflow tracking URI (http://host:5000, databricks, sqlite:///path.db); "
                            "None = sqlite:///<run_root>/mlflow.db with artifacts in <run_root>/mlartifacts.")
    experiment: str = Field("embedpipe", description="MLflow experiment the runs are logged to.")
    log_model: bool = Field(True, description="Upload the trained models (train stages) and the released model "
                            "(evaluate) as run artifacts.")


class RunConfig(_Strict):
    run_name: str = Field("run", description="Name of the run: its directory under run_root (one path component).")
    run_root: str = Field("runs", description="Runs are written to <run_root>/<run_name>/<stage>/.")
    data_root: str = Field(".", description="Base directory for relative source paths.")
    seed: int = Field(42, description="Seed of every random choice (sampling, mining, synthesis, training).")
    prepare: PrepareConfig = Field(description="Raw sources and their cleaning.")
    synthesize: SynthesizeConfig | None = Field(None, description="LLM data synthesis; omitted = stage skipped.")
    mine: MineConfig | None = Field(None, description="Hard-negative mining; omitted = stage skipped.")
    train: TrainConfig | None = Field(None, description="Training stages; omitted = stage skipped.")
    evaluate: EvaluateConfig | None = Field(None, description="MTEB evaluation; omitted = stage skipped.")
    tracking: TrackingConfig | None = Field(None, description="Experiment tracking (MLflow); omitted = off.")
    embedding_cache: EmbeddingCacheConfig = Field(default_factory=EmbeddingCacheConfig,
                                                  description="Embedding cache shared by mine and evaluate.")
    sweep: SweepConfig | None = Field(None, description="Settings search over one train stage (`embedpipe sweep`); "
                                      "ignored by the pipeline.")

    @field_validator("run_name")
    @classmethod
    def _safe_run_name(cls, v: str) -> str:
        return check_path_name(v, "run_name")

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.data_root).expanduser() / p

    def default_run_dir(self) -> Path:
        return Path(self.run_root) / self.run_name

    def with_run_name(self, run_name: str) -> RunConfig:
        """This config under another run name (checked like the config's own ``run_name``)."""
        try:
            check_path_name(run_name, "run_name")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return self.model_copy(update={"run_name": run_name})


def _merge(base: dict, override: dict) -> dict:
    """Mappings merge key by key; anything else (lists included) in ``override`` replaces."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that appears twice in one mapping (plain YAML keeps the
    last value silently, so an edited config could lose a list of sources without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<: *base' merges keys that this mapping may override: not a duplicate
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> Any:
    """A YAML file's content; a missing, unreadable, non-UTF-8 or invalid file (duplicate keys
    included) is a ConfigError naming the file and where in it."""
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, expected a YAML config file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{data[exc.start]:02x}); save the config as UTF-8") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None


def _read_raw(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'extends' loops back to itself")
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    return _merge(_read_raw(path.parent / parent, (*seen, path.resolve())), raw)


def load_config(path: str | Path) -> RunConfig:
    """Load and validate a YAML run config; errors name the file and the offending key.

    ``extends: other.yaml`` (relative to this file) starts from that config: mappings are merged
    key by key, lists and scalars here replace the parent's (so a variant states only what differs).
    """
    path = Path(path)
    return parse_config(_read_raw(path), origin=str(path))


def parse_config(raw: dict, *, origin: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "<root>"
        more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
        raise ConfigError(f"{origin}: {loc}: {first['msg'].removeprefix('Value error, ')}{more}") from None


def config_hash(model: BaseModel) -> str:
    """Content hash of a config section (canonical JSON)."""
    blob = json.dumps(model.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()

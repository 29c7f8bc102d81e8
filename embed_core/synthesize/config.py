"""The synthesize stage's config section: the OpenAI-compatible server, sampling, quality filters
and the strategies and budgets of LLM data synthesis."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from embed_core.config_base import StrictModel

SynthStrategy = Literal["paraphrase", "augmentation", "hard_negative", "queries"]
QueryType = Literal["question", "keyword", "claim", "title"]


class LLMServerConfig(StrictModel):
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
    port: int = Field(0, ge=0, le=65535, description="launch: loopback port (0 = a free one); with several "
                      "slots, the first server's, the others take the next ports.")
    n_ctx: int = Field(2048, ge=256, description="launch: context length.")
    n_threads: int | None = Field(None, ge=1, description="launch: CPU threads. None = the cores minus one (at least "
                                  "1, at most 8): llama.cpp's threads spin at barriers, so with every core in use one "
                                  "other busy process can slow generation 40x; a spare core keeps it steady.")
    slots: int | Literal["auto"] = Field(
        "auto", description="launch: parallel slots. llama-cpp-python's server answers one request at a time (no "
        "continuous batching), so N slots are N server processes, started together on their own loopback ports, "
        "each with n_threads // N threads (at least 1), and the requests are shared among them as with base_urls "
        "(failover, answered/failed per endpoint in the manifest); all are stopped at the end. auto = 2 on a "
        "machine with 2 or more cores (1 if n_threads is 1): measured 1.41-1.68x the requests per minute of one "
        "server on an idle 2-core machine (tests/benchmarks/bench_llama_slots.py, docs/experiments.md).")
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

    @field_validator("slots", mode="before")
    @classmethod
    def _a_number_of_servers_or_auto(cls, value: object) -> object:
        if value == "auto" or (type(value) is int and 1 <= value <= 64):
            return value
        raise ValueError(f"a number of llama.cpp servers, 1 to 64, or auto; got {value!r}")

    @model_validator(mode="after")
    def _slots_are_launched_servers(self) -> "LLMServerConfig":
        if self.slots == "auto":
            return self
        if self.base_urls or self.base_url:
            raise ValueError(f"slots: {self.slots} starts that many local llama.cpp servers, but base_url(s) name "
                             "servers you run: leave slots out, or drop base_url(s) and use launch: llama_cpp")
        if self.launch != "llama_cpp":
            raise ValueError(f"slots: {self.slots} needs launch: llama_cpp (the servers it starts); without it there "
                             "is nothing to start")
        if self.n_threads is not None and self.slots > self.n_threads:
            raise ValueError(f"slots: {self.slots} servers need a thread each, but n_threads is {self.n_threads}: "
                             "raise n_threads or lower slots")
        if self.port and self.port + self.slots - 1 > 65535:
            raise ValueError(f"slots: {self.slots} servers from port {self.port} run past port 65535: lower port "
                             "(or 0 = free ports)")
        return self


class SamplingConfig(StrictModel):
    temperature: float = Field(0.7, ge=0, description="Sampling temperature.")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling mass.")
    max_tokens: int = Field(192, ge=1, description="Max generated tokens per request.")
    seed: int | None = Field(None, description="Sent to servers that honour it (per attempt: seed + attempt).")


class SynthFilterConfig(StrictModel):
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


class RoundTripConfig(StrictModel):
    """Round-trip consistency (Promptagator, GPL-style): a generated query is kept only when its own
    passage ranks within ``top_k`` among every passage of its corpus, by an embedding model."""

    model: str = Field("base", description="Model that ranks: 'base' = train.base_model (the packaged "
                       "all-MiniLM-L6-v2 without a train section), 'default', or a model directory.")
    pooling: Literal["mean", "cls", "last_token"] = Field("mean", description="Pooling of that model.")
    max_length: int = Field(256, ge=8, description="Tokens the model reads per text.")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="Encoding precision, as mine's (auto: "
                                                       "bf16 on a GPU or a CPU with native bf16). The embeddings go "
                                                       "into the run's embedding cache: with mine's model, pooling, "
                                                       "max_length and precision, mine reads the corpus's from there "
                                                       "instead of encoding it again.")
    top_k: int = Field(5, ge=1, description="The passage must rank at or above this among the corpus.")


class JudgeConfig(StrictModel):
    """The optional LLM judge of generated queries (InPars-v2, Promptagator): the same server is asked
    whether the passage answers the query; pairs scored below ``threshold`` are dropped."""

    threshold: float = Field(0.5, ge=0, le=1, description="Pairs whose score is below this are dropped (reason "
                             "judge). Score: P(yes) / (P(yes) + P(no)) over the first non-blank answer token's top "
                             "logprobs when the server returns them (llama.cpp, vLLM, OpenAI do), else 1 for an answer "
                             "starting with yes and 0 for no.")
    prompt: str = Field("judge-relevance", min_length=1, description="Template asked (packaged "
                        "judge-relevance.yaml, or a same-named file of prompt_dir); its output must be judgment.")
    max_tokens: int = Field(2, ge=1, le=64, description="Tokens the judge may answer with (yes or no needs one or "
                            "two).")
    top_logprobs: int = Field(5, ge=1, le=20, description="Top logprobs asked for per answer token (the yes and no "
                              "tokens are looked for among them).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of the judge's requests (0: greedy).")


class QueriesConfig(StrictModel):
    """Strategy ``queries``: queries generated for the passages of the corpus sources (``kind:
    corpus``); each (query, passage) is a retrieval record of the corpus's dataset (its name),
    origin synthetic."""

    max_passages: int | None = Field(1000, ge=1, description="Budget: passages per corpus asked about, a seeded "
                                     "sample (stable: a larger budget keeps the smaller one's passages). None = all.")
    types: list[QueryType] = Field(default_factory=lambda: ["question", "keyword", "claim", "title"], min_length=1,
                                   description="Kinds of query asked for, one request per passage and kind "
                                   "(packaged prompts queries-TYPE.yaml).")
    per_type: int = Field(1, ge=1, le=8, description="Queries asked for per passage and kind (k).")
    min_words: int = Field(2, ge=1, description="Length filter: queries with fewer words are dropped.")
    max_words: int = Field(40, ge=1, description="Length filter: queries with more words are dropped.")
    round_trip: RoundTripConfig | None = Field(default_factory=RoundTripConfig, description="Round-trip "
                                               "consistency filter; null = off.")
    judge: JudgeConfig | None = Field(None, description="LLM judge filter after round trip (a relevance yes/no "
                                      "request per kept pair, cached like the others); null = off.")
    personas: list[str] = Field(default_factory=list, description="Who writes the queries (e.g. 'a nurse checking "
                                "drug interactions'): each passage gets one, drawn by the run's seed and its id, "
                                "named in its prompts and recorded in _queries.parquet; empty = no persona (the "
                                "prompts are the same as without this key).")

    @model_validator(mode="after")
    def _consistent(self) -> "QueriesConfig":
        if self.min_words > self.max_words:
            raise ValueError(f"min_words {self.min_words} is above max_words {self.max_words}")
        blank = [i for i, p in enumerate(self.personas) if not p.strip()]
        if blank:
            raise ValueError(f"personas[{blank[0]}] is blank")
        if len(set(self.personas)) != len(self.personas):
            raise ValueError("personas lists a persona twice")
        for i, persona in enumerate(self.personas):  # each is pasted into prompts: one line of visible text
            bad = next(((n, ch) for n, ch in enumerate(persona, 1) if unicodedata.category(ch) in _NOT_TEXT), None)
            if bad is not None:
                raise ValueError(f"personas[{i}] holds a control or invisible character (U+{ord(bad[1]):04X}) at "
                                 f"character {bad[0]}: a persona is one line of visible text")
        return self


CalibratedFilter = Literal["likelihood", "round_trip", "judge"]


class CalibrationConfig(StrictModel):
    """Filter calibration (``calibrate.py``): before the generated queries are filtered, each listed
    filter's threshold is fitted on real (query, passage) pairs against the same queries shown with
    another pair's passage, and replaces the configured one; the figures go to calibration.parquet,
    the report and the manifest."""

    filters: list[CalibratedFilter] = Field(
        default_factory=lambda: ["likelihood", "round_trip"], min_length=1,
        description="Filters calibrated, in cascade order. likelihood: the generator's mean token logprob of "
        "the query given its passage (prompt logprobs: echo on /completions; a server without them makes it "
        "step aside, said once, and the stage goes on), a generated query scoring below the fitted threshold "
        "is dropped (reason likelihood); round_trip: minus the passage's rank, the fitted threshold replaces "
        "queries.round_trip.top_k (needs queries.round_trip); judge: the LLM judge's P(yes), the fitted "
        "threshold replaces queries.judge.threshold (needs queries.judge).")
    precision_floor: float = Field(0.8, ge=0, le=1, description="A filter whose precision (real vs mismatched "
                                   "pairs, balanced prior) stays below this at every threshold is refused: the "
                                   "stage fails with one line naming it, its precision and the floor.")
    beta: float | None = Field(1.0, gt=0, description="The threshold maximises F-beta among those meeting "
                               "the floor (beta < 1 favours precision); null = the lowest threshold meeting the "
                               "floor (the most recall it allows).")
    real_pairs: Literal["auto", "records", "held_out"] = Field(
        "auto", description="Where the real pairs come from. records: (query, first positive) of the retrieval "
        "records of the datasets synthesize reads (the user's own data); held_out: a seeded slice "
        "(held_out_share) of the generated queries that passed the cheap filters (lengths, copies, "
        "contamination, word counts), for a corpus recipe without queries of its own; auto: records when they "
        "give at least 2 pairs with 2 distinct passages, else held_out.")
    held_out_share: float = Field(0.2, gt=0, le=1, description="held_out: share of those generated queries used "
                                  "as real pairs (at least 2); they stay candidates like the others.")
    max_pairs: int = Field(200, ge=2, description="At most this many real pairs (a seeded sample), and as many "
                           "mismatched ones: each filter scores 2 x max_pairs pairs plus the candidates.")
    seed: int | None = Field(None, description="Seed of the sample and of the mismatched pairs; null = the "
                             "run's seed.")
    likelihood_max_minutes: float = Field(
        20.0, gt=0, description="The likelihood filter's time budget: the shortest prompt's echo is timed first, "
        "and when every pair's would take longer (its time scaled by prompt length) the filter steps aside, said "
        "once. The packaged llama-cpp-python server answers echo but computes each prompt token's logprobs over "
        "Gemma-3's whole 262k-token vocabulary in Python: about 1 s per token on a CPU, minutes per pair.")


# Unicode categories that are not text a prompt may hold: controls (line breaks too), format
# characters (bidi overrides, zero-width), surrogates, private use, unassigned.
_NOT_TEXT = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})


class SynthesizeConfig(StrictModel):
    """LLM data synthesis (QZhou §4, §6.1): paraphrase, augmentation, hard-negative generation."""

    server: LLMServerConfig = Field(default_factory=LLMServerConfig,
                                    description="The OpenAI-compatible server (or the local llama.cpp one to launch).")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig,
                                     description="Generation parameters sent with every request.")
    filter: SynthFilterConfig = Field(default_factory=SynthFilterConfig,
                                      description="Quality filters on generated text (embedding similarity, length).")
    strategies: list[SynthStrategy] = Field(default_factory=lambda: ["paraphrase", "augmentation", "hard_negative"],
                                            description="Task rules: retrieval gets all three; nli/sts/pair "
                                            "classification and classification only paraphrase (single sentences); "
                                            "queries: queries for the passages of corpus sources (section queries).")
    queries: QueriesConfig = Field(default_factory=QueriesConfig, description="Strategy queries: query generation "
                                   "for corpus passages (budget, kinds, k, filters).")
    calibration: CalibrationConfig | None = Field(None, description="Fit the query filters' thresholds on the "
                                                  "user's data instead of the configured ones (needs strategy "
                                                  "queries); null = off (the configured thresholds).")
    prompt_dir: str | None = Field(None, description="Directory of prompt templates overriding the packaged ones.")
    datasets: list[str] | None = Field(None, description="Only these datasets, by their prepare.sources name "
                                       "(default: every dataset below "
                                       "max_dataset_rows).")
    max_dataset_rows: int = Field(60000, ge=1, description="Datasets larger than this are left alone (QZhou: <60k).")
    max_records_per_dataset: int | None = Field(None, ge=1, description="Synthesize from the first N records of a "
                                                "dataset only (bounded runs).")
    hard_negative_fraction: float = Field(0.3, ge=0, le=1, description="Share of retrieval records that get an LLM "
                                          "hard negative (QZhou §6.1: 30%).")
    max_parse_retries: int = Field(2, ge=0, description="Extra requests for an answer that does not parse or validate.")
    max_requests: int | None = Field(None, ge=0, description="Run budget: HTTP requests (cached answers are free).")
    request_cache: str | None = Field(None, description="SQLite file of cached LLM answers. None: the run's own "
                                      "cache/llm.sqlite. A path (relative to the working directory, like run_root) "
                                      "shares one cache among runs — an ablation's rows and seeds, a run in a fresh "
                                      "run directory — so no request any of them made is made again. Not part of the "
                                      "stage's key.")
    max_tokens: int | None = Field(None, ge=0, description="Run budget: prompt + completion tokens.")
    max_failed_share: float = Field(0.5, ge=0, le=1, description="Largest share of the requests that may get no "
                                    "answer from the server (connection, timeout, HTTP errors, after the retries; "
                                    "answers that do not parse and the run budget do not count). Beyond it the stage "
                                    "fails instead of committing — an outage is not a finished stage — so Prefect's "
                                    "task retry applies and the next run repeats only the unanswered requests (answers "
                                    "are cached). 1 = never fail.")
    max_malformed_share: float = Field(0.9, ge=0, le=1, description="Largest share of the answered requests whose "
                                       "answer does not parse or validate after max_parse_retries (prose instead of "
                                       "JSON, a judge that answers neither yes nor no), counted for generation and "
                                       "for the judge apart. Beyond it the stage fails instead of committing what "
                                       "little was kept — a model that does not follow the prompt's format is not a "
                                       "finished stage; the malformed answers are in the error line and the stage's "
                                       "log. 1 = never fail.")
    retry_delay_s: float = Field(30, ge=0, description="Seconds before that task retry (time for an LLM server to "
                                 "come back after a restart).")

    @model_validator(mode="after")
    def _calibrated_filters_exist(self) -> "SynthesizeConfig":
        cal = self.calibration
        if cal is None:
            return self
        if "queries" not in self.strategies:
            raise ValueError("calibration fits the filters of generated queries: add queries to strategies, or set "
                             "calibration: null")
        off = [f for f, on in (("round_trip", self.queries.round_trip), ("judge", self.queries.judge))
               if f in cal.filters and on is None]
        if off:
            raise ValueError(f"calibration.filters lists {off[0]}, but queries.{off[0]} is null (off): configure it, "
                             f"or leave {off[0]} out of calibration.filters")
        if len(set(cal.filters)) != len(cal.filters):
            raise ValueError("calibration.filters lists a filter twice")
        return self


class TargetedConfig(StrictModel):
    """Error-driven synthesis before a training stage: the dev records the model it starts from gets
    most wrong pick the training records nearest to them, and only those are synthesized from."""

    datasets: list[str] = Field(min_length=1, description="Datasets whose dev records (prepare's dev_fraction or "
                                "dev_path) are scored: retrieval (a query fails when its first positive ranks "
                                "below retrieval_k among the dev passages), sts and pair tasks (the pairs whose "
                                "cosine is furthest from the gold score scaled to 0..1) and classification (texts "
                                "whose nearest training-label centroid is another label).")
    failures: int = Field(50, ge=1, description="Worst dev records kept per dataset.")
    retrieval_k: int = Field(10, ge=1, description="Retrieval: a dev query whose first positive ranks below this fails.")
    neighbours: int = Field(2, ge=1, description="Training records taken per failure: the nearest by the query's (or "
                                                 "text's) embedding, never a dev record.")
    max_records: int = Field(200, ge=1, description="Budget: training records synthesized from, over all datasets "
                                                    "(failures are served worst first, one neighbour each per round).")
    strategies: list[SynthStrategy] = Field(default_factory=lambda: ["paraphrase", "hard_negative"],
                                            description="What is generated for a selected record (hard negatives "
                                                        "for every selected retrieval record).")


# settings that do not change what synthesize produces: left out of its config hash (its key)
NOT_IN_KEY = frozenset({"request_cache"})


def not_in_key(cfg: SynthesizeConfig) -> frozenset[str]:
    """``NOT_IN_KEY``, and ``calibration`` when it is off (so that a config without it keeps the key
    it had before the section existed)."""
    return NOT_IN_KEY | ({"calibration"} if cfg.calibration is None else set())


# where a stage's cached LLM answers live when synthesize.request_cache is unset
RUN_REQUEST_CACHE = Path("cache") / "llm.sqlite"


def request_cache_path(cfg: SynthesizeConfig, run_dir: Path) -> Path:
    """The SQLite file of cached LLM answers a run uses (``request_cache``, or the run's own)."""
    return Path(cfg.request_cache).expanduser() if cfg.request_cache else Path(run_dir) / RUN_REQUEST_CACHE

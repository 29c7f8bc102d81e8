"""The typed contract between stages: what every ``<run_dir>/<instance>/manifest.json`` holds.

Every manifest has the envelope (``Manifest``): the stage directory it describes, the step that
wrote it, the run, the cache key it was produced from (``input_fingerprint``) and the code
identity in that key, the record schema and package versions, when it was committed, and every
output file with its hash. ``StageWriter`` (``embed_core.artifacts``) fills the envelope in every
commit; a stage gives only its own sections. One class per step adds those sections, its
``counts`` typed, and is how a reader reads them (by field, never by string key):

========================  ===========================  ============================================
class                     step                          stage directory
========================  ===========================  ============================================
``PrepareManifest``       ``prepare``                   ``prepare/``
``SynthesizeManifest``    ``synthesize``                ``synthesize/``
``SynthManifest``         ``synth`` (targeted)          ``synth-<stage>/``
``MineManifest``          ``mine``                      ``mine/``
``RemineManifest``        ``remine``                    ``mine-<stage>/``
``DataValueManifest``     ``datavalue``                 ``value-<stage>/``
``TrainManifest``         ``train``                     ``train-<stage>/``
``ReferenceManifest``     ``reference`` (CDA)           ``reference-<stage>/``
``EvaluateManifest``      ``evaluate``                  ``evaluate/``
``AblationManifest``      ``ablation``                  ``<run_root>/<run>-ablation/``
``SweepManifest``         ``sweep``                     ``sweep-<stage>/``
``SoupManifest``          ``soup``                      ``sweep-<stage>-soup/``
========================  ===========================  ============================================

Strict where it matters, tolerant of age: the envelope fields a reader relies on are required
(a manifest without one is refused with one line naming the file and the field), ``run_name``,
``code`` and ``step`` may be missing in manifests earlier versions wrote, and keys a class does not
name are kept as they are (``extra="allow"``), so a manifest read and written again loses nothing.
This module imports pydantic only: a stage's light ``stage.py`` reads its manifest through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, TypedDict

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from embed_core.errors import EmbedpipeError

MANIFEST = "manifest.json"
# written in every manifest (run_name and step: whenever known; older manifests may lack them)
ALWAYS = ("stage", "input_fingerprint", "code", "schema_version", "package_version", "created_at", "outputs")


class Section(BaseModel):
    """A manifest section: its known keys typed, any other key kept as written."""

    model_config = ConfigDict(extra="allow")


class OutputInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str = Field(description="records, dev_records, corpus, model, metrics, stats, plot, results, report, ...")
    sha256: str = Field(description="SHA-256 of the file's bytes; readers refuse a file that differs.")
    rows: int | None = Field(None, description="Rows of a Parquet table.")


class Manifest(Section):
    """The envelope every stage's ``manifest.json`` has; a step's class adds its sections."""

    STEP: ClassVar[str | None] = None  # the step a subclass describes (written as ``step``)

    stage: str = Field(description="Stage directory name (the instance: prepare, mine-stage2, train-stage1, ...).")
    step: str | None = Field(None, description="The step that wrote it (prepare, remine, train, reference, ...); "
                                               "missing in manifests written before the key existed.")
    run_name: str | None = Field(None, description="The run's name (missing in older reference manifests).")
    input_fingerprint: str = Field(description="The cache key the outputs were produced from.")
    code: str | None = Field(None, description="Code identity of the stage (part of the key).")
    schema_version: str | int = Field(description="Record schema version.")
    package_version: str = Field(description="embedpipe's version.")
    created_at: str = Field(description="When the stage committed (local time with offset).")
    outputs: dict[str, OutputInfo] = Field(description="Every file of the stage directory with its hash.")
    timings_s: dict[str, float] = Field(default_factory=dict, description="Seconds per phase and in total.")
    counts: Any = Field(None, description="What the step counted: a dict here, typed by each step's class.")

    @classmethod
    def of(cls, manifest: Manifest | dict[str, Any], file: str | Path = MANIFEST) -> Any:
        """``manifest`` (a stage's returned dict, or a manifest of any class) read as this class;
        an EmbedpipeError naming ``file`` and the first field that is missing or wrong."""
        if isinstance(manifest, cls):
            return manifest
        raw = manifest.as_dict() if isinstance(manifest, Manifest) else manifest
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise EmbedpipeError(f"{file}: not a {cls.__name__.removesuffix('Manifest').lower() or 'stage'} "
                                 f"manifest: {_first_problem(exc)}") from None

    @classmethod
    def read(cls, run_dir: str | Path, instance: str) -> Any:
        """``<run_dir>/<instance>/manifest.json`` read as this class; an EmbedpipeError naming the
        file when it is missing, not JSON, or lacks a field this class requires."""
        path = Path(run_dir) / instance / MANIFEST
        try:
            raw = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise EmbedpipeError(f"{path}: missing (the stage was not run, or was interrupted)") from None
        except (OSError, ValueError) as exc:
            raise EmbedpipeError(f"{path}: not readable as JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise EmbedpipeError(f"{path}: not a stage manifest (a JSON object is expected)")
        return cls.of(raw, path)

    def as_dict(self) -> dict[str, Any]:
        """The manifest as written: its sections as given (no key added), the envelope in full."""
        out = self.model_dump(mode="json", exclude_unset=True)
        for name in ALWAYS:
            out.setdefault(name, getattr(self, name))
        out["outputs"] = {name: info.model_dump(exclude_none=True) for name, info in self.outputs.items()}
        return out

    def hashes(self, kind: str | None = None, prefix: str = "") -> dict[str, str]:
        """Output name -> sha256, of one ``kind`` and/or under ``prefix`` (e.g. ``model/``)."""
        return {name: info.sha256 for name, info in self.outputs.items()
                if (kind is None or info.kind == kind) and name.startswith(prefix)}


def _first_problem(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"field {where}: {err['msg'].lower()}{more}"


# --- prepare -------------------------------------------------------------------------------------

class PrepareTotals(Section):
    rows_read: int = Field(description="Rows read from every source (converted, skipped and quarantined).")
    records_written: int = Field(description="Training records written, over every dataset.")
    quarantined: int = Field(description="Rows sent to _quarantine.parquet.")
    quarantined_by_reason: dict[str, int] = Field(description="Quarantined rows by reason.")
    skipped: int = Field(description="Rows deliberately left out by a converter.")
    deduped: int = Field(description="Records dropped as exact or normalised duplicates.")
    excluded_contamination: int = Field(description="Records sharing a text with an evaluation set.")
    eval_texts: int = Field(0, description="Texts in the contamination sets.")
    eval_pairs: int = Field(0, description="Text pairs in the contamination sets.")
    excluded_near_duplicate: int | None = Field(None, description="Near duplicates dropped (near_duplicates on).")


class PrepareCorpus(Section):
    """What a corpus source wrote: passages, not records (``prepare/corpus.py``)."""

    file: str = Field(description="corpus-<name>.parquet.")
    passages: int = Field(description="Passages written.")
    deduped: int = Field(0, description="Passages dropped as duplicates.")
    excluded_contamination: int = Field(0, description="Passages sharing a text with an evaluation set.")
    excluded_near_duplicate: int = Field(0, description="Near duplicates of evaluation texts dropped.")


class PrepareSource(Section):
    source: str = Field(description="The source's name (its dataset).")
    corpus: PrepareCorpus | None = Field(None, description="A corpus source: its passages.")
    records_converted: int = Field(0, description="Records (a corpus: passages) converted.")
    rows_skipped: int = Field(0, description="Rows the converter left out.")
    quarantined: int = Field(0, description="Rows quarantined.")


class PrepareDataset(Section):
    dataset: str = Field(description="Dataset name.")
    records_in: int = Field(description="Training records before deduplication and exclusion.")
    deduped_exact: int = Field(description="Dropped as exact duplicates.")
    deduped_normalized: int = Field(description="Dropped as duplicates after normalisation.")
    excluded_contamination: int = Field(description="Dropped: a text of an evaluation set.")
    written: int = Field(description="Records written to <dataset>.parquet.")
    tasks: dict[str, int] = Field(description="Records written per task.")
    excluded_near_duplicate: int | None = Field(None, description="Near duplicates dropped (near_duplicates on).")


class PrepareCounts(Section):
    totals: PrepareTotals
    sources: list[PrepareSource]
    datasets: list[PrepareDataset]


class PrepareManifest(Manifest):
    STEP: ClassVar[str] = "prepare"
    counts: PrepareCounts

    @property
    def near_duplicates_on(self) -> bool:
        return self.counts.totals.excluded_near_duplicate is not None


# --- synthesize (the stage) and synth (targeted synthesis before a training stage) ---------------

class SynthesizeDataset(Section):
    dataset: str
    records: int = 0
    synthesized: bool = False
    added: int = 0
    llm_negatives: int = 0
    corpus: bool = False


class SynthesizeCounts(Section):
    datasets: list[SynthesizeDataset]
    strategies: dict[str, dict[str, int]] = Field(description="Per strategy: requested, answered, kept, "
                                                              "failed:<reason>, filtered:<reason>.")
    client: dict[str, Any] = Field(description="The LLM client's requests, retries, cache hits and tokens.")
    judge_client: dict[str, Any] | None = Field(None, description="The judge's client counters (queries.judge).")
    failed: int = 0
    filtered: int = 0
    kept: int = 0


class SynthesizeManifest(Manifest):
    STEP: ClassVar[str] = "synthesize"
    counts: SynthesizeCounts
    queries: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Query generation per corpus.")
    calibration: dict[str, Any] | None = Field(None, description="The query filters' calibration (real_pairs, "
                                               "filters: the rows of calibration.parquet); None when it is off.")


class SynthManifest(SynthesizeManifest):
    STEP: ClassVar[str] = "synth"
    targeted: dict[str, Any] = Field(default_factory=dict, description="Failures and selected records per dataset.")


# --- mine (the stage) and remine (mine-<stage>) --------------------------------------------------

class MineDataset(Section):
    dataset: str
    records: int
    mined: bool
    negatives_added: int | None = None  # None: the dataset was not mined
    too_few: int | None = None
    filtered_by_margin: int | None = None
    dropped_by_teacher: int | None = None
    index: dict[str, Any] | None = None
    positive_score: dict[str, Any] | None = None
    kept_score: dict[str, Any] | None = None
    negatives_by_source: dict[str, int] | None = Field(None, description="The records' negatives by where they came "
                                                       "from: original (the data's own or an earlier mining's), llm "
                                                       "(the synthesize stage's hard negative), mined (this mining).")


class MineCounts(Section):
    datasets: list[MineDataset]
    texts_encoded: int = Field(description="Texts the model encoded (the rest came from the embedding cache).")
    cache_size: int | None = Field(None, description="Embeddings the cache holds after the stage.")


class MineManifest(Manifest):
    STEP: ClassVar[str] = "mine"
    counts: MineCounts


class RemineManifest(MineManifest):
    STEP: ClassVar[str] = "remine"


# --- the data-value gate (value-<stage>) ------------------------------------------------------------

class DataValueManifest(Manifest):
    STEP: ClassVar[str] = "datavalue"
    stage_name: str = Field(description="The training stage it gates.")
    units: dict[str, dict[str, Any]] = Field(description="Per unit: mode, action, weight, delta, spread, reason.")
    weights: dict[str, dict[str, float]] = Field(description="dataset / origin -> the multiplier the stage applies "
                                                            "(0: dropped).")
    noise: float = Field(description="Sample standard deviation of the reference proxies' dev score ×100.")
    reference_score: float = Field(description="Mean dev score ×100 of the reference proxies.")
    counts: dict[str, Any]


# --- train and its CDA reference scores -----------------------------------------------------------

class TrainCounts(Section):
    steps: int | None = Field(None, description="Optimizer steps taken.")
    examples: int = Field(description="Training examples consumed.")
    tokens: int = Field(description="Tokens consumed.")
    final_loss: float | None = Field(description="The last step's loss.")
    selected_step: int | None = Field(None, description="The step whose weights were kept (dev selection).")
    selected_dev_score: float | None = Field(None, description="Its dev score.")


class TrainDataset(Section):
    task: str
    records: int
    weight: float


class TrainManifest(Manifest):
    STEP: ClassVar[str] = "train"
    stage_name: str = Field(description="The training stage's name (train.stages[].name).")
    init_model: str = Field(description="The model it started from.")
    steps: int = Field(description="Steps trained.")
    processes: int = Field(1, description="Processes of the job.")
    hardware: dict[str, Any] = Field(default_factory=dict, description="Device, precision, back end.")
    datasets: dict[str, TrainDataset] = Field(default_factory=dict, description="Per dataset: task, records, weight.")
    counts: TrainCounts
    selected: dict[str, Any] | None = Field(None, description="Dev selection: rule, step, best.")
    merged_with: dict[str, Any] | None = Field(None, description="train.stages[].merge, when set.")
    probe: dict[str, Any] | None = Field(None, description="The saved model's probe.")
    untrained: str | None = Field(None, description="Why the stage kept its start model untrained (its data-value "
                                  "decision left it no record); None for a trained stage.")


class ReferenceCounts(Section):
    examples: int
    negatives: int


class ReferenceManifest(Manifest):
    STEP: ClassVar[str] = "reference"
    stage_name: str
    init_model: str
    decoder: str
    counts: ReferenceCounts


# --- evaluate ---------------------------------------------------------------------------------------

class MainScore(Section):
    model: str
    task: str
    metric: str
    value: float


class EvaluateCounts(Section):
    texts_encoded: int = 0
    result_rows: int = 0
    main_scores: list[MainScore] = Field(default_factory=list, description="mteb's main score per task and model.")


class EvaluatedModel(Section):
    label: str
    path: str
    fingerprint: str | None = None
    settings: dict[str, Any]
    texts_encoded: int = 0


class EvaluateManifest(Manifest):
    STEP: ClassVar[str] = "evaluate"
    models: list[EvaluatedModel]
    counts: EvaluateCounts


class GateCounts(Section):
    tasks: int
    failed: int


class GateManifest(Manifest):
    STEP: ClassVar[str] = "gate"
    verdict: str = Field(description="first, passed, failed, or none (evaluate released no model).")
    line: str = Field(description="The verdict in one line.")
    registered_model: str = Field(description="The registered model (MLflow's registry) the candidate is a version of.")
    registry_uri: str = Field(description="The registry it is in.")
    candidate: dict[str, Any] | None = Field(None, description="version, fingerprint and trained stage of the "
                                             "candidate; None when there is nothing to release.")
    current: dict[str, Any] | None = Field(None, description="version and fingerprint of the release it was "
                                           "measured against; None for a first release.")
    counts: GateCounts


# --- ablation and sweep (run-level artifacts) --------------------------------------------------------

class AblationManifest(Manifest):
    STEP: ClassVar[str] = "ablation"
    rows: list[str] = Field(default_factory=list)
    seeds: list[int] = Field(default_factory=list)


class SweepCounts(Section):
    variants: int
    trained: int


class SweepManifest(Manifest):
    STEP: ClassVar[str] = "sweep"
    winner: str
    winner_settings: dict[str, Any]
    counts: SweepCounts


class SoupManifest(Manifest):
    STEP: ClassVar[str] = "soup"
    soup_of: list[str]


STEPS: dict[str, type[Manifest]] = {cls.STEP: cls for cls in (
    PrepareManifest, SynthesizeManifest, SynthManifest, MineManifest, RemineManifest, DataValueManifest, TrainManifest,
    ReferenceManifest, EvaluateManifest, GateManifest, AblationManifest, SweepManifest, SoupManifest)}


def step_class(manifest: Manifest | dict[str, Any]) -> type[Manifest]:
    """The class of the step that wrote ``manifest``: its ``step``; for one written before the key
    existed, told by its sections (the train stage's directories: a targeted synthesis step has
    ``targeted``, a reference ``decoder``, a training stage ``stage_name``; a re-mining step none),
    else the envelope's ``Manifest``."""
    raw = manifest.as_dict() if isinstance(manifest, Manifest) else manifest
    if raw.get("step") in STEPS:
        return STEPS[raw["step"]]
    if raw.get("stage") in STEPS:
        return STEPS[raw["stage"]]  # prepare, synthesize, mine, evaluate: the directory is named by its step
    for key, cls in (("targeted", SynthManifest), ("decoder", ReferenceManifest), ("stage_name", TrainManifest),
                     ("counts", RemineManifest)):
        if key in raw:
            return cls
    return Manifest


# --- what running a stage instance gave -------------------------------------------------------------

class StageResult(TypedDict, total=False):
    """What running one stage instance returns (the task, a flow, a child run on another pool):
    a plain dict, so Prefect hands it on as it is."""

    stage: str                  # the instance
    cached: bool                # a cache hit
    seconds: float | None
    run_dir: str
    manifest: dict[str, Any]    # as committed (read it with the step's class)
    summary: str                # the stage's summarize(manifest)
    work_pool: str              # only when it ran on another work pool
    flow_run: str               # that pool's flow run id


def stage_result(instance: str, manifest: dict[str, Any], *, cached: bool, seconds: float | None,
                 run_dir: str | Path, summary: str, **where: str) -> StageResult:
    """The one way a stage result is built (``where``: ``work_pool`` and ``flow_run``)."""
    return StageResult(stage=instance, cached=cached, seconds=seconds, run_dir=str(run_dir), manifest=manifest,
                       summary=summary, **where)  # type: ignore[typeddict-item]

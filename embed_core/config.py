"""Run configuration: plain pydantic models loaded from YAML (nothing hidden in globals).

Each stage's section lives beside its stage (``embed_core/<stage>/config.py``), the pieces they
share in ``embed_core.config_base``; here are the run as a whole (``RunConfig``), the sections of
no single stage (tracking, sweep) and the YAML loader. Relative paths in sources are resolved
against ``data_root``, which is itself relative to the current working directory (the repository
root when run through ``make`` or the CLI).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

from embed_core.config_base import StrictModel, check_path_name
from embed_core.errors import ConfigError
from embed_core.evaluate.config import EvalTaskSpec, EvaluateConfig
from embed_core.mine.config import MineConfig
from embed_core.model.config import EmbeddingCacheConfig, EngineConfig
from embed_core.prepare.config import PrepareConfig
from embed_core.synthesize.config import SynthesizeConfig
from embed_core.train.config import TrainConfig, TrainStageConfig



class SweepConfig(StrictModel):
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


class TrackingConfig(StrictModel):
    """Experiment tracking (MLflow). One MLflow run per run directory (named after the run), and one
    nested run per stage result: parameters, counts, per-step training metrics, evaluation scores and
    the model as an artifact. Needs the ``tracking`` extra (``pip install -e ".[tracking]"``)."""

    uri: str | None = Field(None, description="MLflow tracking URI (http://host:5000, databricks, sqlite:///path.db); "
                            "None = sqlite:///<run_root>/mlflow.db with artifacts in <run_root>/mlartifacts.")
    experiment: str = Field("embedpipe", description="MLflow experiment the runs are logged to.")
    log_model: bool = Field(True, description="Upload the trained models (train stages) and the released model "
                            "(evaluate) as run artifacts.")


class RunConfig(StrictModel):
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

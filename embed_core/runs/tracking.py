"""Experiment tracking: every stage result of a run directory, logged to MLflow.

One MLflow run stands for one run directory (tag ``embedpipe.run_dir``, named after the run);
each stage result is a nested run under it, tagged with the stage and its input fingerprint, so a
result is logged once however often the stage is a cache hit, and a rerun that recomputes adds a
new nested run. What each nested run holds:

* every stage: the manifest's counts and timings (metrics), its input fingerprint and code (tags);
* a train stage: its settings, losses and datasets (params), the training metrics of every step
  (loss, lr, tokens/s, per step), and the saved model (artifact ``model/``);
* evaluate: every main score as ``<model>.<task>`` (also on the parent run, where runs are
  compared), the report, and the released model with its card (artifact ``model/``).

The tracking store is MLflow's: a local SQLite database by default, any tracking URI by config.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from embed_core.config import RunConfig
from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.manifests import MANIFEST, Manifest, TrainManifest, step_class
from embed_core.model.card import read_card_facts
from embed_core.stage_dirs import EVALUATE

log = logging.getLogger("embedpipe.tracking")

RUN_DIR_TAG = "embedpipe.run_dir"
STAGE_TAG = "embedpipe.stage"
FINGERPRINT_TAG = "embedpipe.input_fingerprint"
ROLE_TAG = "embedpipe.role"  # 'run' (a run directory) or 'stage' (one stage result under it)
_MAX_PARAM = 500  # MLflow's limit on a param value's length is larger; this keeps the UI readable


def mlflow():
    try:
        import mlflow as _mlflow
    except ImportError:
        raise ConfigError("tracking needs MLflow: pip install -e '.[tracking]'") from None
    return _mlflow


def tracking_uri(config: RunConfig) -> str:
    if config.tracking is not None and config.tracking.uri:
        return config.tracking.uri
    return f"sqlite:///{(Path(config.run_root).expanduser().resolve() / 'mlflow.db')}"


def _client(config: RunConfig):
    ml = mlflow()
    uri = tracking_uri(config)
    client = ml.tracking.MlflowClient(tracking_uri=uri)
    name = config.tracking.experiment
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        artifacts = None
        if uri.startswith("sqlite:///"):  # keep artifacts next to the database, not in the working directory
            artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
        return client, client.create_experiment(name, artifact_location=artifacts)
    return client, experiment.experiment_id


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def _parent_run(client, experiment_id: str, run_dir: Path, config: RunConfig) -> str:
    key = str(run_dir.resolve())
    found = client.search_runs([experiment_id], max_results=1, filter_string=(
        f"tags.`{RUN_DIR_TAG}` = '{key}' and tags.`{ROLE_TAG}` = 'run'"))
    if found:
        return found[0].info.run_id
    run = client.create_run(experiment_id, run_name=config.run_name, tags={RUN_DIR_TAG: key, ROLE_TAG: "run"})
    client.set_terminated(run.info.run_id)  # a container for the stage runs, open or closed alike
    return run.info.run_id


def already_logged(config: RunConfig, run_dir: str | Path, stage: str, manifest: dict[str, Any]) -> bool:
    client, experiment_id = _client(config)
    key = str(Path(run_dir).resolve())
    found = client.search_runs([experiment_id], filter_string=(
        f"tags.`{RUN_DIR_TAG}` = '{key}' and tags.`{STAGE_TAG}` = '{stage}' and "
        f"tags.`{FINGERPRINT_TAG}` = '{Manifest.of(manifest).input_fingerprint}'"), max_results=1)
    return bool(found)


def log_stage(config: RunConfig, run_dir: str | Path, stage: str, manifest: dict[str, Any]) -> str | None:
    """Log one stage result (see the module docstring); returns the nested run's id, or None when
    this result was logged before. A store that cannot be reached is an ``EmbedpipeError``."""
    if config.tracking is None:
        return None
    try:
        if already_logged(config, run_dir, stage, manifest):
            return None
        return _log_stage(config, Path(run_dir), stage, manifest)
    except (ConfigError, ImportError):
        raise
    except Exception as exc:  # noqa: BLE001 — MLflow's REST, SQL and file errors alike
        detail = " ".join(str(exc).split())[:200]
        raise EmbedpipeError(f"tracking: could not log {stage} to {tracking_uri(config)} ({type(exc).__name__}: "
                             f"{detail}); the stage's artifact is committed, the next run logs it") from None


def _log_stage(config: RunConfig, run_dir: Path, stage: str, manifest: dict[str, Any]) -> str:
    from mlflow.entities import Metric, Param

    client, experiment_id = _client(config)
    committed = Manifest.of(manifest, run_dir / stage / MANIFEST)
    parent = _parent_run(client, experiment_id, run_dir, config)
    # The fingerprint tag is set last: a run cut short by an error does not count as logged.
    tags = {"mlflow.parentRunId": parent, RUN_DIR_TAG: str(run_dir.resolve()), STAGE_TAG: stage, ROLE_TAG: "stage",
            "embedpipe.code": str(committed.code or "")[:250]}
    run_id = client.create_run(experiment_id, run_name=stage, tags=tags).info.run_id
    now = int(time.time() * 1000)
    params: dict[str, Any] = {}
    metrics: list[Metric] = []
    numbers: dict[str, Any] = {}
    _flatten("counts", committed.counts or {}, numbers)  # whatever the step counts (the envelope's class: a dict)
    _flatten("timings_s", committed.timings_s, numbers)
    stage_dir = run_dir / stage
    card = read_card_facts(stage_dir / "model") if step_class(manifest) is TrainManifest else None
    if card is not None:
        _flatten("stage", card.get("stage", {}), params)
        _flatten("loss", card.get("losses", {}), params)
        _flatten("dataset", {n: d.get("records") for n, d in card.get("datasets", {}).items()}, params)
        params["base_model"] = card.get("base_model")
        params["init_model"] = card.get("init_model")
        for row in pq.read_table(stage_dir / "metrics.parquet").to_pylist():
            for name in ("loss", "lr", "tokens_per_s", "grad_norm", "peak_memory_mb", "mfu"):
                if row.get(name) is not None:
                    metrics.append(Metric(f"train.{name}", float(row[name]), now, int(row["step"])))
    scores: list[Metric] = []
    if stage == EVALUATE and (stage_dir / "results.parquet").exists():
        for row in pq.read_table(stage_dir / "results.parquet").to_pylist():
            if row["main"]:
                scores.append(Metric(f"{row['model']}.{row['task']}", float(row["value"]), now, 0))
    metrics += [Metric(k, float(v), now, 0) for k, v in numbers.items() if isinstance(v, (int, float))
                and not isinstance(v, bool)]
    params_list = [Param(k, str(v)[:_MAX_PARAM]) for k, v in params.items() if v is not None]
    everything = metrics + scores
    for i in range(0, max(len(everything), len(params_list), 1), 1000):  # MLflow's batch limits: 1000 / 100
        client.log_batch(run_id, metrics=everything[i:i + 1000])
    for i in range(0, len(params_list), 100):
        client.log_batch(run_id, params=params_list[i:i + 100])
    for i in range(0, len(scores), 1000):
        client.log_batch(parent, metrics=scores[i:i + 1000])
    if config.tracking.log_model:
        model_dir = stage_dir / "model"
        if model_dir.is_dir():
            client.log_artifacts(run_id, str(model_dir), artifact_path="model")
        if (stage_dir / "report.md").exists():
            client.log_artifact(run_id, str(stage_dir / "report.md"))
    client.set_tag(run_id, FINGERPRINT_TAG, committed.input_fingerprint)
    client.set_terminated(run_id)
    log.info("tracking: %s logged to %s (run %s)", stage, tracking_uri(config), run_id)
    return run_id

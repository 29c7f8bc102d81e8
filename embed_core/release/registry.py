"""A run's releases in MLflow's model registry.

A release is a version of the registered model ``release.name`` (default ``embedpipe-<run_name>``):
its files (the model the evaluate stage checked, with its card) are the artifacts of an MLflow run
in the experiment ``embedpipe-releases``, and the version carries tags: the model's fingerprint, its
scores, its lineage (the run directory and the stages it came from), the gate's verdict and the
decision that made it current or kept it out. The alias ``current`` names the release in use (as
MLflow's own UI and ``models:/<name>@current`` show it); ``candidate`` names one held for approval.
The registered model's tag ``embedpipe.history`` lists the versions that were current, in turn:
``rollback`` makes the one before the current current again. The current release's files are
also kept at ``<run_dir>/release/`` (a copy from the registry, swapped in whole).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embed_core.errors import ConfigError, EmbedpipeError

log = logging.getLogger("embedpipe.release")

EXPERIMENT = "embedpipe-releases"
CURRENT = "current"
CANDIDATE = "candidate"
ARTIFACT = "model"
RELEASE_MARKER = ".release"  # in a copy of a release: {"name", "version"}
TAG = "embedpipe."
FINGERPRINT, DECISION, VERDICT, SCORES, LINEAGE, HISTORY = (TAG + k for k in (
    "fingerprint", "decision", "gate", "scores", "lineage", "history"))
# decisions that keep a version from becoming current again without a person's `promote`
REFUSED = ("rejected", "rolled back")


@dataclass(frozen=True)
class Release:
    """One registered version, as its tags describe it."""

    version: int
    fingerprint: str
    created: str
    decision: str = ""
    verdict: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    lineage: dict[str, Any] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()


class ReleaseRegistryError(EmbedpipeError):
    """A release operation that cannot be done (no such version, nothing to roll back to)."""


def _mlflow():
    try:
        import mlflow
    except ImportError:
        raise ConfigError("releases need MLflow: pip install -e '.[tracking]'") from None
    return mlflow


class Releases:
    """The releases of one registered model (``uri``: the MLflow tracking and registry URI)."""

    def __init__(self, uri: str, name: str, artifacts: str | None = None):
        self.uri, self.name = uri, name
        self.client = _mlflow().tracking.MlflowClient(tracking_uri=uri, registry_uri=uri)
        self._artifacts = artifacts

    # --- reading ----------------------------------------------------------------------------------

    def versions(self) -> list[Release]:
        """Every version, oldest first."""
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.search_model_versions(f"name = '{self.name}'")
        except MlflowException:
            return []
        aliases = self._aliases()
        return sorted((_release(v, aliases.get(int(v.version), ())) for v in found), key=lambda r: r.version)

    def _aliases(self) -> dict[int, tuple[str, ...]]:
        model = self._model()
        out: dict[int, tuple[str, ...]] = {}
        for alias, version in (getattr(model, "aliases", None) or {}).items() if model else ():
            out[int(version)] = (*out.get(int(version), ()), alias)
        return out

    def _model(self):
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_registered_model(self.name)
        except MlflowException:
            return None

    def get(self, version: int) -> Release:
        for r in self.versions():
            if r.version == version:
                return r
        known = ", ".join(str(r.version) for r in self.versions()) or "none"
        raise ReleaseRegistryError(f"release: {self.name} has no version {version} (versions: {known})")

    def current(self) -> Release | None:
        return next((r for r in self.versions() if CURRENT in r.aliases), None)

    def find(self, fingerprint: str) -> Release | None:
        """The newest version holding the model of ``fingerprint``."""
        return next((r for r in reversed(self.versions()) if r.fingerprint == fingerprint), None)

    def history(self) -> list[int]:
        model = self._model()
        return [int(v) for v in json.loads((model.tags or {}).get(HISTORY, "[]"))] if model else []

    def baseline(self, fingerprint: str) -> Release | None:
        """The release a model of ``fingerprint`` is measured against: the latest one that was
        current and holds another model (so promoting the candidate does not change its baseline)."""
        by_version = {r.version: r for r in self.versions()}
        for version in reversed(self.history()):
            release = by_version.get(version)
            if release is not None and release.fingerprint != fingerprint:
                return release
        return None

    # --- writing ----------------------------------------------------------------------------------

    def register(self, model_dir: Path, fingerprint: str, *, scores: dict[str, float], lineage: dict[str, Any],
                 verdict: str) -> Release:
        """A new version holding a copy of ``model_dir`` (the registry's, independent of the run
        directory); the version with this fingerprint when there is one."""
        found = self.find(fingerprint)
        if found is not None:
            return found
        experiment = self._experiment()
        run = self.client.create_run(experiment, run_name=f"{self.name}-release",
                                     tags={TAG + "role": "release", FINGERPRINT: fingerprint})
        self.client.log_artifacts(run.info.run_id, str(model_dir), ARTIFACT)
        self.client.log_dict(run.info.run_id, {"scores": scores, "lineage": lineage}, "release.json")
        self.client.set_terminated(run.info.run_id)
        if self._model() is None:
            self.client.create_registered_model(self.name, description="Embedding models released by embedpipe")
        version = self.client.create_model_version(
            self.name, source=f"{run.info.artifact_uri}/{ARTIFACT}", run_id=run.info.run_id,
            tags={FINGERPRINT: fingerprint, SCORES: json.dumps(scores, sort_keys=True),
                  LINEAGE: json.dumps(lineage, sort_keys=True), VERDICT: verdict})
        return self.get(int(version.version))

    def _experiment(self) -> str:
        found = self.client.get_experiment_by_name(EXPERIMENT)
        if found is not None:
            return found.experiment_id
        artifacts = self._artifacts
        if artifacts is None and self.uri.startswith("sqlite:///"):  # beside the database, not in the cwd
            artifacts = (Path(self.uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
        return self.client.create_experiment(EXPERIMENT, artifact_location=artifacts)

    def set_verdict(self, version: int, verdict: str) -> None:
        self.client.set_model_version_tag(self.name, str(version), VERDICT, verdict)

    def hold(self, version: int) -> None:
        """Name ``version`` the candidate (held for a decision)."""
        self.client.set_registered_model_alias(self.name, CANDIDATE, str(version))

    def promote(self, version: int, decision: str) -> Release:
        """Make ``version`` current (``decision``: why, kept on the version)."""
        self.get(version)
        self.client.set_model_version_tag(self.name, str(version), DECISION, decision)
        history = [v for v in self.history() if v != version] + [version]
        self.client.set_registered_model_tag(self.name, HISTORY, json.dumps(history))
        self.client.set_registered_model_alias(self.name, CURRENT, str(version))
        self._drop_candidate(version)
        return self.get(version)

    def reject(self, version: int, decision: str = "rejected") -> Release:
        """Keep ``version`` out: it does not become current unless promoted by hand."""
        self.get(version)
        self.client.set_model_version_tag(self.name, str(version), DECISION, decision)
        self._drop_candidate(version)
        return self.get(version)

    def rollback(self) -> tuple[Release, Release]:
        """Make the release current before the current one current again; returns (restored,
        rolled back). The rolled-back version is marked so no gate makes it current again."""
        history = self.history()
        current = self.current()
        if current is None or len(history) < 2:
            raise ReleaseRegistryError(f"release: {self.name} has no earlier release to roll back to "
                                       f"(releases that were current: {history or 'none'})")
        self.client.set_model_version_tag(self.name, str(current.version), DECISION, "rolled back")
        history = [v for v in history if v != current.version]
        self.client.set_registered_model_tag(self.name, HISTORY, json.dumps(history))
        self.client.set_registered_model_alias(self.name, CURRENT, str(history[-1]))
        return self.get(history[-1]), self.get(current.version)

    def _drop_candidate(self, version: int) -> None:
        if CANDIDATE in self.get(version).aliases:
            self.client.delete_registered_model_alias(self.name, CANDIDATE)

    def materialize(self, version: int, dest: Path) -> Path:
        """Copy the files of ``version`` to ``dest``, replacing what was there in one swap."""
        run_id = self.client.get_model_version(self.name, str(version)).run_id
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            files = Path(self.client.download_artifacts(run_id, ARTIFACT, str(staging)))
            (files / RELEASE_MARKER).write_text(json.dumps({"name": self.name, "version": version}) + "\n")
            old = dest.with_name(f".{dest.name}-old")
            shutil.rmtree(old, ignore_errors=True)
            if dest.exists():
                os.replace(dest, old)
            os.replace(files, dest)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return dest


def _release(version, aliases: tuple[str, ...]) -> Release:
    tags = version.tags or {}
    from datetime import datetime, timezone

    created = datetime.fromtimestamp(version.creation_timestamp / 1000, timezone.utc).isoformat(timespec="seconds")
    return Release(version=int(version.version), fingerprint=tags.get(FINGERPRINT, ""), created=created,
                   decision=tags.get(DECISION, ""), verdict=tags.get(VERDICT, ""),
                   scores=json.loads(tags.get(SCORES, "{}")), lineage=json.loads(tags.get(LINEAGE, "{}")),
                   aliases=tuple(sorted(aliases)))

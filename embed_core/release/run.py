"""The gate stage's body: register the model the evaluate stage checked as a release, compare it with
the release it would replace, and settle it (current, or held for a decision).

``<run_dir>/gate/`` holds ``gate.parquet`` (task, kind, current, candidate, change: main scores;
tolerance in points, score × 100; passed) and ``report.md``; its manifest names both versions and the
verdict: ``first`` (no release yet), ``passed``, ``failed`` or ``none`` (nothing to release). The
registry's side of a verdict (``settle``) runs after the commit and again on every later pipeline
run, so a run stopped between the two finishes it. The key is the candidate's files, the release it
is measured against (``Releases.baseline``: unchanged when the candidate itself becomes current), the
gate's settings and the data of its tasks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from embed_core.artifacts import StageWriter, read_manifest
from embed_core.config import RunConfig, config_hash
from embed_core.errors import ConfigError
from embed_core.fingerprint import Fingerprint
from embed_core.manifests import EvaluateManifest, GateManifest
from embed_core.numbers import score
from embed_core.release import gate
from embed_core.release.config import GateConfig
from embed_core.release.registry import REFUSED, RELEASE_MARKER, Release, Releases
from embed_core.stage_dirs import EVALUATE, GATE, RELEASE_COPY

log = logging.getLogger("embedpipe.release")

LIBRARIES = ("mteb", "sentence-transformers", "torch", "transformers", "mlflow-skinny")
RESULTS = "gate.parquet"
SCHEMA = pa.schema([("task", pa.string()), ("kind", pa.string()), ("current", pa.float64()),
                    ("candidate", pa.float64()), ("change", pa.float64()), ("tolerance", pa.float64()),
                    ("passed", pa.bool_())])


def gate_config(config: RunConfig) -> GateConfig:
    if config.release is None or config.evaluate is None:
        raise ConfigError("gate: the config has no release section (or no evaluate section to release from)")
    return config.release


def releases_of(config: RunConfig) -> Releases:
    from embed_core.runs.tracking import tracking_uri

    cfg = gate_config(config)
    return Releases(cfg.registry_uri or tracking_uri(config), cfg.name or f"embedpipe-{config.run_name}")


@dataclass(frozen=True)
class Candidate:
    model_dir: Path
    fingerprint: str
    label: str
    scores: dict[str, float]        # evaluate task -> main score
    lineage: dict[str, Any]


def candidate(config: RunConfig, run_dir: Path) -> Candidate | None:
    """The model the evaluate stage released (checked) in ``run_dir``, or None."""
    raw = read_manifest(run_dir, EVALUATE)
    if raw is None or not raw.get("release"):
        return None
    evaluated = EvaluateManifest.of(raw)
    release = raw["release"]
    files = evaluated.hashes(prefix=f"{release['path']}/")
    digest = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:16]
    scores = {r.task: r.value for r in evaluated.counts.main_scores if r.model == release["model"]}
    lineage = {"run_dir": str(Path(run_dir).resolve()), "run_name": config.run_name, "model": release["model"],
               "source": release["source"], "evaluate": evaluated.input_fingerprint, "created_at": evaluated.created_at}
    return Candidate(run_dir / EVALUATE / release["path"], digest, release["model"], scores, lineage)


def guard_kinds(config: RunConfig) -> dict[str, str]:
    """Task name -> guard/probe, in the order they are compared."""
    cfg = gate_config(config)
    guards = cfg.guard_tasks or [t.name for t in config.evaluate.tasks]
    return {**{t: "guard" for t in guards}, **{p.name: "probe" for p in cfg.probes}}


def input_fingerprint(config: RunConfig, run_dir: str | Path) -> Fingerprint:
    from embed_core.evaluate.run import task_data_hashes

    run_dir = Path(run_dir)
    cfg = gate_config(config)
    found = candidate(config, run_dir)
    baseline = releases_of(config).baseline(found.fingerprint) if found else None
    specs = [t for t in config.evaluate.tasks if guard_kinds(config).get(t.name) == "guard"] + list(cfg.probes)
    return Fingerprint.of(GATE, __name__, LIBRARIES, {
        "candidate": found.fingerprint if found else None,
        "baseline": [baseline.version, baseline.fingerprint] if baseline else None,
        "config": config_hash(cfg.model_copy(update={"approval": "never", "approval_timeout_s": 1})),
        "data": task_data_hashes(config, specs)}, details={"candidate": found.fingerprint if found else None})


def input_dirs(config: RunConfig, run_dir: str | Path) -> list[Path]:
    return [Path(run_dir) / EVALUATE]


def run_gate(config: RunConfig, run_dir: str | Path, fingerprint: Fingerprint | None = None) -> dict[str, Any]:
    run_dir = Path(run_dir)
    t0 = time.perf_counter()
    fingerprint = fingerprint or input_fingerprint(config, run_dir)
    found = candidate(config, run_dir)
    releases = releases_of(config)
    rows: list[gate.GateRow] = []
    body: dict[str, Any] = {"registered_model": releases.name, "registry_uri": releases.uri}
    if found is None:
        body.update(verdict="none", line="nothing to release: the evaluate stage released no model")
    else:
        baseline = releases.baseline(found.fingerprint)
        rows = _compare(config, run_dir, found, releases, baseline) if baseline else []
        verdict = "first" if baseline is None else "failed" if gate.failed(rows) else "passed"
        version = releases.register(found.model_dir, found.fingerprint, scores=found.scores, lineage=found.lineage,
                                    verdict=verdict)
        releases.set_verdict(version.version, verdict)
        line = (f"first release: v{version.version} has no release to be measured against" if baseline is None
                else gate.verdict_line(rows, version.version, baseline.version))
        body.update(verdict=verdict, line=line, candidate={"version": version.version, "fingerprint": found.fingerprint,
                                                           "model": found.label},
                    current={"version": baseline.version, "fingerprint": baseline.fingerprint} if baseline else None)
    table = pa.Table.from_pylist([{"task": r.task, "kind": r.kind, "current": r.current, "candidate": r.candidate,
                                   "change": r.delta, "tolerance": r.tolerance, "passed": r.passed} for r in rows],
                                 schema=SCHEMA)
    with StageWriter(run_dir, GATE, GateManifest, fingerprint=fingerprint, run_name=config.run_name) as writer:
        writer.write_table(RESULTS, table, kind="results")
        writer.write_file("report.md", report(body, rows).encode(), kind="report")
        manifest = writer.commit({**body, "counts": {"tasks": len(rows), "failed": len(gate.failed(rows))},
                                  "timings_s": {"total": round(time.perf_counter() - t0, 3)}})
    log.info("gate: %s", body["line"])
    settle(config, run_dir)
    return manifest


def _compare(config: RunConfig, run_dir: Path, found: Candidate, releases: Releases,
             baseline: Release) -> list[gate.GateRow]:
    """The gate's rows: the baseline release scored now on the guard tasks and probes (the data may
    have changed since it was released), the candidate on the probes (its guard scores are the
    evaluate stage's)."""
    from embed_core.evaluate.run import evaluate_model

    cfg = gate_config(config)
    kinds = guard_kinds(config)
    guards = [t for t in config.evaluate.tasks if kinds.get(t.name) == "guard"]
    scratch = Path(tempfile.mkdtemp(prefix=".gate-", dir=run_dir))
    try:
        current_dir = releases.materialize(baseline.version, scratch / "current")
        current = _main(evaluate_model(f"v{baseline.version}", str(current_dir), guards + list(cfg.probes),
                                         config, run_dir)[0])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    scores = dict(found.scores)
    if cfg.probes:
        scores.update(_main(evaluate_model(found.label, str(found.model_dir), list(cfg.probes), config, run_dir)[0]))
    return gate.compare(scores, current, kinds, cfg.tolerance, cfg.tolerances)


def _main(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {r["task"]: r["value"] for r in rows if r["main"]}


def report(body: dict[str, Any], rows: list[gate.GateRow]) -> str:
    lines = ["# Release gate", "", body["line"] + ".", ""]
    if rows:
        lines += [gate.table(rows), "", "Scores are main scores × 100; a task fails when the candidate is more "
                  "than its tolerance below the current release.", ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class Settlement:
    """What the registry did with the run's candidate: promoted, current (already), held (waiting for
    a decision), kept out (a person rejected it or rolled it back), or none (nothing to release)."""

    action: str
    version: int | None
    line: str


def settle(config: RunConfig, run_dir: str | Path) -> Settlement:
    """Apply the gate's verdict in ``run_dir`` to the registry (idempotent)."""
    run_dir = Path(run_dir)
    raw = read_manifest(run_dir, GATE)
    if raw is None or not raw.get("candidate"):
        return Settlement("none", None, (raw or {}).get("line", "nothing to release"))
    releases = releases_of(config)
    version = releases.get(int(raw["candidate"]["version"]))
    if "current" in version.aliases:
        copy = _copied(run_dir, releases, version.version)
        return Settlement("current", version.version, f"v{version.version} is the current release; its files: {copy}")
    if version.decision in REFUSED:
        return Settlement("kept out", version.version, f"v{version.version} is not released: it was "
                          f"{version.decision} (`embedpipe release promote {version.version}` releases it)")
    if raw["verdict"] in ("first", "passed"):
        return promote(config, run_dir, version.version, f"gate {raw['verdict']}")
    releases.hold(version.version)
    line = (f"{raw['line']}; v{version.version} is held: approve it in the Prefect UI or run `embedpipe release "
            f"promote {version.version}`")
    log.warning("gate: %s", line)
    return Settlement("held", version.version, line)


def _copied(run_dir: Path, releases: Releases, version: int) -> Path:
    """``<run_dir>/release/``, holding ``version`` (copied again when it holds another or nothing:
    a run stopped between promoting and copying, or a promote or rollback from another directory)."""
    target = run_dir / RELEASE_COPY
    marker = target / RELEASE_MARKER
    if not marker.is_file() or json.loads(marker.read_text()) != {"name": releases.name, "version": version}:
        releases.materialize(version, target)
    return target


def promote(config: RunConfig, run_dir: str | Path, version: int, decision: str) -> Settlement:
    """Make ``version`` current, copy it to ``<run_dir>/release/`` and push it where configured."""
    releases = releases_of(config)
    releases.promote(version, decision)
    target = releases.materialize(version, Path(run_dir) / RELEASE_COPY)
    line = f"v{version} is the current release ({decision}); its files: {target}"
    log.info("release: %s", line)
    _publish(config, target)
    return Settlement("promoted", version, line)


def _publish(config: RunConfig, target: Path) -> None:
    """Push the release that just became current where configured (``evaluate.push_to_hub``): the
    Hub repository always holds the current release, after a promote and after a rollback."""
    if config.evaluate is not None and config.evaluate.push_to_hub:
        from embed_core.evaluate.run import push_release

        push_release(target, config.evaluate.hub_model_id, private=config.evaluate.hub_private)


def reject(config: RunConfig, version: int, decision: str = "rejected") -> Settlement:
    releases_of(config).reject(version, decision)
    line = f"v{version} is not released ({decision}); the current release stays"
    log.warning("release: %s", line)
    return Settlement("kept out", version, line)


def rollback(config: RunConfig, run_dir: str | Path) -> Settlement:
    """Make the release before the current one current again (its files ``<run_dir>/release/``,
    pushed where configured)."""
    releases = releases_of(config)
    restored, gone = releases.rollback()
    target = releases.materialize(restored.version, Path(run_dir) / RELEASE_COPY)
    line = f"rolled back: v{restored.version} is the current release again (v{gone.version} is marked rolled back); " \
           f"its files: {target}"
    log.info("release: %s", line)
    _publish(config, target)
    return Settlement("rolled back", restored.version, line)


def format_releases(config: RunConfig) -> str:
    """Every version of the run's registered model: aliases, verdict, decision, main scores × 100."""
    releases = releases_of(config)
    found = releases.versions()
    if not found:
        return f"{releases.name}: no releases yet ({releases.uri})"
    tasks = list(dict.fromkeys(t for r in found for t in r.scores))
    head = f"{'version':<9}{'aliases':<20}{'created (UTC)':<27}{'gate':<8}{'decision':<34}" + \
        "".join(f"{t[:14]:>15}" for t in tasks)
    lines = [f"{releases.name} ({releases.uri})", head]
    for r in found:
        lines.append(f"{'v' + str(r.version):<9}{','.join(r.aliases) or '-':<20}{r.created:<27}{r.verdict or '-':<8}"
                     f"{(r.decision or '-')[:33]:<34}" + "".join(f"{score(r.scores.get(t)):>15}" for t in tasks))
    return "\n".join(lines)

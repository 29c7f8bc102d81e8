"""Sweeps: a grid or random search over one train stage's settings, chosen on dev.

A variant is the swept stage with some settings changed (``sweep.params``), named
``<stage>-<hash of its settings>`` so the same settings always train into the same directory
(``train-<variant>/``) under the same cache key: an unchanged rerun of a sweep is all cache hits,
and a sweep that adds values trains only the new variants. Every variant reads the run's cached
upstream artifacts (prepare, mine, earlier train stages). The winner is the variant with the best
dev selection score (its ``dev`` section, ``select: best``); it alone is evaluated on the test
tasks. ``sweep-<stage>/`` holds ``variants.parquet``, ``report.md`` and ``winner.yaml`` — the run
config with the winner's settings, which reproduces it as an ordinary run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from embed_core import numbers
from embed_core.artifacts import StageWriter, read_manifest
from embed_core.config import RunConfig, parse_config
from embed_core.errors import ConfigError
from embed_core.manifests import SoupManifest, SweepManifest, TrainManifest
from embed_core.paths import files_within
from embed_core.stage_dirs import instance_name


def _set(mapping: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        mapping = mapping.setdefault(key, {})
        if not isinstance(mapping, dict):
            raise ConfigError(f"sweep.params.{dotted}: {key} is not a mapping")
    mapping[keys[-1]] = value


def combinations(config: RunConfig) -> list[dict[str, Any]]:
    """The settings of every variant, in a stable order (grid), or ``samples`` of them drawn with
    the run's seed (random)."""
    sweep = config.sweep
    names = sorted(sweep.params)
    grid = [dict(zip(names, values)) for values in itertools.product(*(sweep.params[n] for n in names))]
    if sweep.method == "random" and sweep.samples < len(grid):
        grid = random.Random(config.seed).sample(grid, sweep.samples)
    return grid


def variant_name(stage: str, overrides: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(overrides, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{stage}-{digest}"


def variant_config(config: RunConfig, overrides: dict[str, Any]) -> tuple[str, RunConfig]:
    """(variant stage name, the run config in which the swept stage has ``overrides`` and that name;
    later stages dropped)."""
    sweep = config.sweep
    raw = config.model_dump(mode="json")
    stages = raw["train"]["stages"]
    index = next(i for i, s in enumerate(stages) if s["name"] == sweep.stage)
    stage = json.loads(json.dumps(stages[index]))
    for dotted, value in overrides.items():
        _set(stage, dotted, value)
    name = variant_name(sweep.stage, overrides)
    stage["name"] = name
    if stage.get("init_from") is None and index > 0:
        stage["init_from"] = stages[index - 1]["name"]  # the variant starts where the swept stage would
    raw["train"]["stages"] = [*stages[:index], stage]
    raw.pop("sweep")
    return name, parse_config(raw, origin=f"sweep variant {name}")


def check(config: RunConfig) -> None:
    if config.sweep is None:
        raise ConfigError("the run config has no 'sweep' section")
    if config.train is None or config.sweep.stage not in [s.name for s in config.train.stages]:
        raise ConfigError(f"sweep.stage {config.sweep.stage!r} is not a train stage of this config")
    stage = next(s for s in config.train.stages if s.name == config.sweep.stage)
    if stage.dev is None or stage.dev.select != "best":
        raise ConfigError(f"sweep: train stage {stage.name!r} needs a dev section with select: best (the winner is "
                          "chosen on dev)")


def variants(config: RunConfig) -> list[tuple[str, dict[str, Any], RunConfig]]:
    check(config)
    out = []
    seen: set[str] = set()
    for overrides in combinations(config):
        name, cfg = variant_config(config, overrides)
        if name not in seen:  # a value listed twice is one variant (one directory, one training)
            seen.add(name)
            out.append((name, overrides, cfg))
    return out


def winner_config(config: RunConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """The run config with the swept stage's settings replaced by the winner's (name kept, later
    stages kept, the sweep section removed): it reproduces the winner as an ordinary run."""
    raw = config.model_dump(mode="json")
    raw.pop("sweep")
    stage = next(s for s in raw["train"]["stages"] if s["name"] == config.sweep.stage)
    for dotted, value in overrides.items():
        _set(stage, dotted, value)
    return raw


def dev_score(run_dir: str | Path, variant: str) -> float:
    """The dev selection score a variant's stage kept (its manifest)."""
    manifest = read_manifest(Path(run_dir), instance_name(variant))
    value = TrainManifest.of(manifest).counts.selected_dev_score if manifest is not None else None
    if value is None:
        raise ConfigError(f"sweep: {instance_name(variant)} has no dev score (was it trained with its dev section?)")
    return float(value)


def ranking_key(variant: str, score: float | None) -> tuple[float, str]:
    """Sort key of the ranking: best dev score first (a missing or NaN score last), ties by
    variant name (deterministic)."""
    usable = score is not None and score == score  # NaN != NaN
    return (-score if usable else float("inf"), variant)


def soup_dev_score(config: RunConfig, run_dir: str | Path, model_dir: Path) -> float:
    """The dev selection score of a saved model on the swept stage's dev tasks (as the variants were scored)."""
    from embed_core.model.embedder import Embedder
    from embed_core.model.settings import read_model_settings
    from embed_core.train.dev import DevEvaluator

    stage = config.train.stages[-1]
    settings = read_model_settings(model_dir)
    with tempfile.TemporaryDirectory() as work:
        evaluator = DevEvaluator(stage.dev, config, Path(run_dir), Path(work), settings)
        embedder = Embedder(str(model_dir), pooling=settings.pooling, max_length=settings.max_length)
        return evaluator.selection_score(evaluator.score(embedder))


def main_scores(run_dir: str | Path) -> list[dict[str, Any]]:
    from embed_core.evaluate.run import main_scores as evaluated

    return evaluated(run_dir)


def make_soup(config: RunConfig, run_dir: Path, ranked_variants: list[str]) -> Path:
    """``sweep-<stage>-soup/model``: the uniform average of the weights of the top-k variants (same
    architecture: they share the swept stage's initial model), with the best variant's tokenizer,
    settings and prompts, and a card that says what it averages."""
    from embed_core.model.card import read_card_facts, write_card
    from embed_core.model.merge import WEIGHTS, write_average
    from embed_core.model.settings import read_model_settings, sentence_transformers_prompts

    k = config.sweep.soup_top_k
    members = ranked_variants[:k]
    sources = [run_dir / instance_name(v) / "model" for v in members]
    name = f"sweep-{config.sweep.stage}-soup"
    key = hashlib.sha256(json.dumps([str(s) for s in sources] + [
        (read_manifest(run_dir, instance_name(v)) or {}).get("input_fingerprint", "") for v in members]).encode())
    with StageWriter(run_dir, name, SoupManifest, fingerprint=key.hexdigest(), run_name=config.run_name) as writer:
        out = writer.staging / "model"
        for path in files_within(sources[0]):  # a link out of the variant's model is refused, not copied
            if path.name in (WEIGHTS, "README.md"):
                continue
            target = out / path.relative_to(sources[0])
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
        write_average(sources, [1 / len(sources)] * len(sources), out)
        facts = read_card_facts(sources[0]) or {}
        facts = {**facts, "soup_of": members}
        write_card(out, facts, sentence_transformers_prompts(read_model_settings(out)))
        writer.register_tree("model", kind="model")
        writer.commit({"soup_of": members})
    return run_dir / name / "model"


def write_report(config: RunConfig, run_dir: Path, results: list[dict[str, Any]],
                 test_scores: list[dict[str, Any]], soup: dict[str, Any] | None = None) -> dict[str, Any]:
    """``sweep-<stage>/``: one row per variant, the report, and the winner's config."""
    rows = []
    for r in results:
        trained = TrainManifest.read(run_dir, instance_name(r["variant"]))
        rows.append({"variant": r["variant"], "settings": json.dumps(r["overrides"], sort_keys=True),
                     "dev_score": trained.counts.selected_dev_score, "selected_step": trained.counts.selected_step,
                     "train_seconds": trained.timings_s.get("total"), "cached": r["cached"]})
    ranked = sorted(rows, key=lambda r: ranking_key(r["variant"], r["dev_score"]))
    winner = ranked[0]
    overrides = json.loads(winner["settings"])
    lines = [f"# Sweep of {config.sweep.stage} ({config.sweep.method}, {len(rows)} variants)", "",
             "| variant | settings | dev score | step kept | train s |", "|---|---|---:|---:|---:|"]
    for r in ranked:
        mark = " **winner**" if r is winner else ""
        lines.append(f"| {r['variant']}{mark} | `{r['settings']}` | {numbers.score(r['dev_score'])} | {r['selected_step']} | "
                     f"{r['train_seconds']} |")
    lines += ["", f"## The winner on the test tasks ({winner['variant']})", "", "| task | metric | score |",
              "|---|---|---:|"]
    lines += [f"| {s['task']} | {s['metric']} | {numbers.score(s['value'])} |" for s in test_scores]
    if soup is not None:
        lines += ["", f"## Model soup: the mean of the {len(soup['members'])} best variants' weights", "",
                  f"Members: {', '.join(soup['members'])}; dev score {numbers.score(soup['dev_score'])} (winner "
                  f"{numbers.score(winner['dev_score'])}); `{soup['path']}`.", "", "| task | metric | score |", "|---|---|---:|"]
        lines += [f"| {s['task']} | {s['metric']} | {numbers.score(s['value'])} |" for s in soup["test"]]
    lines += ["", f"`winner.yaml` reproduces it: `embedpipe run --config runs/.../sweep-{config.sweep.stage}/winner.yaml`."]
    key = hashlib.sha256(json.dumps(ranked, sort_keys=True, default=str).encode()).hexdigest()
    with StageWriter(run_dir, f"sweep-{config.sweep.stage}", SweepManifest, fingerprint=key,
                     run_name=config.run_name) as writer:
        writer.write_table("variants.parquet", pa.Table.from_pylist(ranked), kind="sweep")
        writer.write_file("report.md", "\n".join(lines).encode(), kind="report")
        writer.write_file("winner.yaml", yaml.safe_dump(winner_config(config, overrides), sort_keys=False).encode(),
                          kind="config")
        return writer.commit({
            "winner": winner["variant"], "winner_settings": overrides, "counts": {"variants": len(rows), "trained": sum(not r["cached"] for r in rows)},
            "test": test_scores, "soup": soup, "timings_s": {"written_at": time.time()}})

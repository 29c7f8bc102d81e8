"""Ablations (``embedpipe ablate``): what each change to a recipe earns, with seeds.

A row is the run's config (``base``) or one of ``ablation.variants`` (settings changed by path:
``train.stages[stage2].remine``). Every row runs end to end once per seed, each in its own run
directory ``<run_root>/<run_name>-<row>-s<seed>/`` (so any of them can be inspected, rerun or
compared on its own, and an unchanged rerun of the ablation is all cache hits), and is evaluated
on the config's test tasks with its last training stage's model. ``<run_root>/<run_name>-ablation/``
holds ``scores.parquet`` (row, seed, task, metric, score), ``report.md`` (per task: mean ± sample
standard deviation over the seeds, and the difference to ``base``) and ``ablation.yaml`` (the
config that produced it).
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from embed_core.artifacts import StageWriter
from embed_core.config import RunConfig, config_hash, parse_config
from embed_core.errors import ConfigError
from embed_core.stage_dirs import instance_name
from embed_core.manifests import AblationManifest

BASE = "base"
ITEM = re.compile(r"^(?P<key>[^\[\]]+)\[(?P<name>[^\[\]]+)\]$")
SCORES_SCHEMA = pa.schema([("row", pa.string()), ("seed", pa.int64()), ("run_dir", pa.string()), ("task", pa.string()),
                           ("metric", pa.string()), ("score", pa.float64())])


def set_path(raw: dict[str, Any], path: str, value: Any) -> None:
    """Set ``value`` at ``path`` in a raw config: dots into mappings, ``key[name]`` the item of list
    ``key`` whose ``name`` is ``name`` (a ConfigError names the part that does not exist)."""
    node: Any = raw
    parts = path.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        found = ITEM.match(part)
        if found:
            items = node.get(found["key"]) if isinstance(node, dict) else None
            match = [x for x in items or [] if isinstance(x, dict) and x.get("name") == found["name"]]
            if not match:
                raise ConfigError(f"ablation: {path}: no item named {found['name']!r} in {found['key']}")
            if last:
                raise ConfigError(f"ablation: {path}: name a setting of the item, not the item")
            node = match[0]
        elif last:
            node[part] = value
        else:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]


def row_configs(config: RunConfig) -> list[tuple[str, int, RunConfig]]:
    """(row, seed, config) of every run: the config (``base``) and each variant, with each seed,
    under run name ``<run_name>-<row>-s<seed>``, evaluated with its last training stage's model."""
    if config.ablation is None:
        raise ConfigError("the run config has no 'ablation' section")
    if config.train is None or config.evaluate is None:
        raise ConfigError("ablation: the config needs train and evaluate sections (rows are compared on test scores)")
    raw = config.model_dump(mode="json", exclude={"ablation", "sweep"})
    out = []
    for row, changes in {BASE: {}, **config.ablation.variants}.items():
        for seed in config.ablation.seeds:
            variant = yaml.safe_load(yaml.safe_dump(raw))  # a deep copy
            for path, value in changes.items():
                set_path(variant, path, value)
            name = f"{config.run_name}-{row}-s{seed}"
            last = variant["train"]["stages"][-1]["name"]
            variant.update(run_name=name, seed=seed)
            variant.pop("release", None)  # a row is an experiment compared on its scores, never a release
            variant["evaluate"]["models"] = ["base", str(Path(config.run_root) / name / instance_name(last) / "model")]
            try:
                out.append((row, seed, parse_config(variant)))
            except ConfigError as exc:
                raise ConfigError(f"ablation.variants.{row}: {exc}") from None
    return out


def run_scores(row: str, seed: int, run_dir: str | Path, config: RunConfig,
               evaluated: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table rows of one run: the main scores of its last training stage's model (evaluate
    also scores the base model, which is the same in every run)."""
    last = config.train.stages[-1].name
    return [{"row": row, "seed": seed, "run_dir": str(run_dir), "task": r["task"], "metric": r["metric"],
             "score": r["value"]} for r in evaluated if r["model"] == last]


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (row, task): mean and sample standard deviation over the seeds (×100; NaN for one seed),
    seeds counted."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r["row"], r["task"]), []).append(100 * r["score"])
    return [{"row": row, "task": task, "mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else math.nan,
             "seeds": len(xs)} for (row, task), xs in groups.items()]


def report_markdown(config: RunConfig, stats: list[dict[str, Any]]) -> str:
    """The table: a row per variant, a column per task, mean ± std over the seeds, Δ to base."""
    tasks = list(dict.fromkeys(s["task"] for s in stats))
    rows = list(dict.fromkeys(s["row"] for s in stats))
    cell = {(s["row"], s["task"]): s for s in stats}
    lines = [f"# Ablation of {config.run_name} (seeds {', '.join(map(str, config.ablation.seeds))})", "",
             "Test scores ×100 of each row's last training stage: mean ± sample standard deviation over the "
             "seeds; (Δ) is the difference of the means to base.", "",
             "| row | changes | " + " | ".join(tasks) + " |", "|---|---|" + "---:|" * len(tasks)]
    for row in rows:
        changes = config.ablation.variants.get(row, {})
        shown = ", ".join(f"`{k}: {v}`" for k, v in changes.items()) or "the config"
        cells = []
        for task in tasks:
            s, b = cell.get((row, task)), cell.get((BASE, task))
            if s is None:
                cells.append("")
                continue
            delta = f" ({s['mean'] - b['mean']:+.2f})" if b is not None and row != BASE else ""
            spread = f" ± {s['std']:.2f}" if s["seeds"] > 1 else " (1 seed: no spread)"
            cells.append(f"{s['mean']:.2f}{spread}{delta}")
        lines.append(f"| {row} | {shown} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(config: RunConfig, rows: list[dict[str, Any]]) -> Path:
    """Commit ``<run_root>/<run_name>-ablation/``; its path."""
    root, name = Path(config.run_root), f"{config.run_name}-ablation"
    key = config_hash(config)
    with StageWriter(root, name, AblationManifest, fingerprint=key, run_name=config.run_name) as writer:
        writer.write_table("scores.parquet", pa.Table.from_pylist(rows, schema=SCORES_SCHEMA), kind="metrics")
        writer.write_file("report.md", report_markdown(config, summary(rows)).encode(), kind="report")
        writer.write_file("ablation.yaml", yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False).encode(),
                          kind="config")
        writer.commit({"rows": sorted({r["row"] for r in rows}), "seeds": config.ablation.seeds})
    return root / name

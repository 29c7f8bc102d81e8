"""The run configs ``make gpu-run`` drives the CLI with: the quality recipe at ``precision: auto``
and the quality-scale ablation's rows, in a fixed order (seed by seed: every row at the first seed,
then every row at the second, ...), all under the report folder's ``runs/``.

``tiny``: the same configs with only their sizes made CPU-sized (``TINY``) for ``make gpu-run
CPU=1``: the repository's data/ (the demo's sources, contamination and test tasks) in place of
../shared/data (the recipe's test tasks that data/ has: STS-B and SciFact, on 200 documents), a random-init 2-layer BERT built in code as every model, a few steps of batch 4
per stage; every stage, task list, loss, dev selection, merge, re-mine and variant is kept."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from embed_core.config import RunConfig, load_config, parse_config
from embed_core.runs import ablation
from embed_core.safe_yaml import read_yaml

REPO = Path(__file__).resolve().parents[2]
QUALITY = REPO / "deployments" / "configs" / "quality.yaml"
ABLATION = REPO / "deployments" / "configs" / "ablation-quality-gpu.yaml"
DEMO = REPO / "deployments" / "configs" / "demo.yaml"

# Everything the tiny sequence changes, in one place (the twin's sizes)
TINY = {
    "train": {"max_length": 32, "peak_tflops": 1.0},  # a CPU has no peak entry: a nominal 1 TFLOP/s fills MFU
    "stage": {"steps": 2, "warmup_steps": 0, "query_max_length": 16, "passage_max_length": 24, "checkpoint_every": 2,
              "log_every": 1},
    "batch": 4,
    "dev": {"eval_every": 2, "max_rows": 8},
    "mine": {"max_length": 32, "batch_size": 64, "datasets": ["scifact"]},
    "near_duplicates": {"num_perm": 16},
    # quality.yaml's test tasks that data/ has, by the recipe's names (its targets are read by name);
    # not Banking77: its classifier fits take half a minute a model on 2 cores
    "evaluate": {"STSBenchmark": {"path": "stsb/test.csv"}, "SciFact": {"path": "scifact", "max_corpus": 200}},
}


def quality_config(out: Path, *, tiny_model: Path | None = None, path: Path = QUALITY,
                   run_name: str = "gpu-run-quality") -> RunConfig:
    """quality.yaml with ``train.precision: auto``, run as ``run_name`` under ``out/runs`` (its
    evaluate models that were its own run's re-rooted there)."""
    raw = load_config(path).model_dump(mode="json")
    raw["train"]["precision"] = "auto"
    if tiny_model is not None:
        raw = tiny(raw, tiny_model)
    return parse_config(reroot(raw, out / "runs", run_name), origin=f"{path} (gpu-run)")


def shared_run_name(quality: RunConfig, runs: list[tuple[str, int, RunConfig]]) -> str | None:
    """The ablation run the quality run can share its run directory with: the first, when it is
    the base row at the quality run's seed with the same settings but for evaluate's models (the
    ablation's base row is quality.yaml at precision auto); there its prepare, mine and training
    are cache hits and only evaluate runs again. None when they differ."""
    if not runs or runs[0][0] != ablation.BASE:
        return None
    first = runs[0][2]
    skip = {"run_name", "run_root", "evaluate"}
    same = first.model_dump(mode="json", exclude=skip) == quality.model_dump(mode="json", exclude=skip)
    return first.run_name if same else None


def ablation_rows(out: Path, *, tiny_model: Path | None = None,
                  path: Path = ABLATION) -> tuple[RunConfig, list[tuple[str, int, RunConfig]]]:
    """The ablation config (under ``out/runs``) and its (row, seed, config) runs in the order
    gpu-run starts them: seed by seed, the rows in the config's order (base first)."""
    raw = load_config(path).model_dump(mode="json")
    if tiny_model is not None:
        raw = tiny(raw, tiny_model)
    raw["run_root"] = str(out / "runs")
    cfg = parse_config(raw, origin=f"{path} (gpu-run)")
    runs = ablation.row_configs(cfg)
    rows = list(dict.fromkeys(r for r, _, _ in runs))
    runs.sort(key=lambda r: (cfg.ablation.seeds.index(r[1]), rows.index(r[0])))
    return cfg, runs


def reroot(raw: dict[str, Any], run_root: Path, run_name: str) -> dict[str, Any]:
    """The config run as ``run_root/run_name``; evaluate models under its old run directory follow it."""
    old = f"{Path(raw['run_root']) / raw['run_name']}/"
    new = f"{run_root / run_name}/"
    if raw.get("evaluate"):
        raw["evaluate"]["models"] = [new + m[len(old):] if m.startswith(old) else m for m in raw["evaluate"]["models"]]
    raw.update(run_root=str(run_root), run_name=run_name)
    return raw


def tiny(raw: dict[str, Any], model: Path) -> dict[str, Any]:
    """The config with TINY's sizes, data/ for its data and ``model`` for every model."""
    cfg = copy.deepcopy(raw)
    demo = read_yaml(DEMO)
    cfg["data_root"] = str(REPO / "data")
    prepare = cfg["prepare"]
    prepare.update(sources=demo["prepare"]["sources"], contamination=demo["prepare"]["contamination"])
    for source in prepare["sources"]:
        if source["name"] == "stsb":
            source["dev_fraction"] = 0.1  # quality.yaml's STS-B dev file is a ../shared/data file
    if prepare.get("near_duplicates"):
        prepare["near_duplicates"].update(TINY["near_duplicates"])
    if cfg.get("mine"):
        cfg["mine"].update(model=str(model), corpora={"scifact": "scifact"}, **TINY["mine"])
    train = cfg["train"]
    train.update(base_model=str(model), **TINY["train"])
    for stage in train["stages"]:
        stage.update(TINY["stage"])
        stage["batch_size"] = {task: TINY["batch"] for task in stage["batch_size"]}
        if stage.get("dev"):
            stage["dev"].update(TINY["dev"])
    if cfg.get("evaluate"):
        tasks = [{**t, **TINY["evaluate"][t["name"]]} for t in cfg["evaluate"]["tasks"] if t["name"] in TINY["evaluate"]]
        cfg["evaluate"].update(base_model=str(model), tasks=tasks)
    return cfg

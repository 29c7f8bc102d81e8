"""Where the tests find the repository and the shared data, and config edits several tests share."""

import os
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]

# data/'s sources of four tasks (real texts of varying length): SciFact claims and passages,
# STS-B pairs, Banking77 labels with 4 other-class negatives each, SICK NLI pairs
MIXED_SOURCES = [
    {"name": "stsb", "kind": "sts", "path": "stsb/train.csv", "header": False, "columns": {"text1": 0, "text2": 1, "score": 2}},
    {"name": "scifact", "kind": "beir", "path": "scifact", "params": {"split": "train"}},
    {"name": "banking77", "kind": "classification", "path": "banking77/train.csv", "multiline": True,
     "columns": {"text": "text", "label": "category"}, "params": {"num_negatives": 4}},
    {"name": "sick-e", "kind": "entailment", "path": "sick/train.tsv",
     "columns": {"text1": "sentence_A", "text2": "sentence_B", "label": "entailment_judgment"}},
]
MIXED_TASKS = ["retrieval", "classification", "sts", "nli"]
SHARED_DATA = Path(os.environ.get("EMBEDPIPE_SHARED_DATA", REPO.parent / "shared" / "data"))


def add_tiny_stages(config_path: Path, tmp_path: Path, *, evaluate: bool) -> str:
    """Give a copied demo config mine + two train stages (+ evaluate) on a tiny BERT built in code."""
    from tests.helpers.tiny_model import build_tiny_bert

    cfg = yaml.safe_load(config_path.read_text())
    tiny = str(build_tiny_bert(tmp_path / "tiny"))
    cfg["mine"] = {"model": tiny, "max_length": 64, "relative_margin": None}
    if evaluate:
        cfg["evaluate"] = {"base_model": tiny, "tasks": [{"name": "STSBenchmark", "type": "sts", "path": "stsb/test.csv",
                                                          "header": False, "columns": {"text1": 0, "text2": 1, "score": 2}}]}
    small = {"batch_size": {"retrieval": 4, "classification": 4, "sts": 8, "nli": 8}, "query_max_length": 32,
             "passage_max_length": 32, "num_hard_negatives": 1, "warmup_steps": 0}
    cfg["train"] = {"base_model": tiny, "max_length": 32, "stages": [
        {"name": "stage1", "tasks": ["retrieval"], "steps": 2, **small}, {"name": "stage2", "steps": 2, "eta": 0.72, **small}]}
    config_path.write_text(yaml.safe_dump(cfg))
    return tiny


# the settings of a tiny training stage (a few steps of batch 4 on short texts); a stage's own win
TINY_STAGE = {"lr": 1e-3, "warmup_steps": 1, "num_hard_negatives": 1, "query_max_length": 16, "passage_max_length": 24,
              "log_every": 100, "checkpoint_every": 100,
              "batch_size": {"retrieval": 4, "sts": 4, "classification": 4, "nli": 4}}


def demo_prepare_only(tmp: Path) -> Path:
    """``tmp/demo.yaml``: the demo config with its prepare section alone, on a private copy of data/
    (``tmp/data``), run under ``tmp/runs``; returns its path."""
    import shutil

    shutil.copytree(REPO / "data", tmp / "data")
    demo = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    demo.update(data_root=str(tmp / "data"), run_root=str(tmp / "runs"))
    for section in ("synthesize", "mine", "evaluate", "train"):
        demo.pop(section, None)
    (tmp / "demo.yaml").write_text(yaml.safe_dump(demo))
    return tmp / "demo.yaml"


def tiny_demo_config(tmp: Path, tiny_model: str | Path, run_name: str, stages: list[dict], *,
                     keep: tuple[str, ...] = ()) -> dict:
    """The demo config (a dict) on the repository's demo data, run under ``tmp/runs/<run_name>``,
    training ``tiny_model`` (max_length 32) through ``stages`` (each a ``TINY_STAGE`` with its own
    settings over it); of the optional sections (synthesize, mine, evaluate) only ``keep`` stay."""
    cfg = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    cfg.update(data_root=str(REPO / "data"), run_root=str(tmp / "runs"), run_name=run_name)
    for key in ("synthesize", "mine", "evaluate"):
        if key not in keep:
            cfg.pop(key, None)
    cfg["train"] = {"base_model": str(tiny_model), "max_length": 32,
                    "stages": [{**TINY_STAGE, **stage} for stage in stages]}
    return cfg

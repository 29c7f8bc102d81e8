"""Where the tests find the repository and the shared data, and config edits several tests share."""

import os
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
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

"""Every phase before a training stage's first step is a log line with its seconds, in order, so
a slow start (a large model's load, its sharding, reading the records) is never silent."""

import logging
import re

import yaml

from embed_core.config import parse_config
from embed_core.stages import records_upstream
from tests.helpers.repo import REPO


def test_the_phases_before_the_first_step_are_logged_in_order_each_with_its_seconds(tmp_path, tiny_model, caplog):
    from embed_core.prepare.run import run_prepare
    from embed_core.train.run import run_train_stage

    cfg = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    cfg.update(data_root=str(REPO / "data"), run_root=str(tmp_path / "runs"))
    for key in ("synthesize", "mine", "evaluate"):
        cfg.pop(key, None)
    cfg["train"] = {"base_model": str(tiny_model), "max_length": 32, "precision": "fp32", "stages": [
        {"name": "s1", "tasks": ["retrieval"], "steps": 2, "batch_size": {"retrieval": 4}, "warmup_steps": 0,
         "num_hard_negatives": 1, "query_max_length": 16, "passage_max_length": 32}]}
    config = parse_config(cfg)
    run_dir = tmp_path / "runs/demo"
    run_prepare(config, run_dir)
    with caplog.at_level(logging.INFO, logger="embedpipe.train"):
        run_train_stage(config, run_dir, "s1", upstream=records_upstream(config, "train"))
    said = [r.getMessage() for r in caplog.records if r.name == "embedpipe.train"]
    phases = [r"s1: process group \(1 process\), input fingerprint and checkpoint directory ready in \d+\.\d s$",
              r"s1: read \d+ records of \d+ datasets from prepare in \d+\.\d s$",
              rf"s1: loaded {re.escape(str(tiny_model))} \(tokenizer and weights\) in \d+\.\d s$",
              r"s1: model placed on cpu and wrapped by the \w+ back end \(with its optimizer\) in \d+\.\d s$",
              r"s1: trainer ready \(model, back end, losses, sampler\) in \d+\.\d s$",
              r"s1: first step in \d+\.\d s, \d+\.\d s of it building and tokenizing its batch$"]
    found = [next((i for i, line in enumerate(said) if re.match(p, line)), None) for p in phases]
    assert None not in found, [p for p, i in zip(phases, found) if i is None] + said[:12]
    assert found == sorted(found), said[:12]

"""Run configs: every shipped config validates; ``extends`` merges mappings and replaces lists."""

from pathlib import Path

import pytest

from embed_core.config import load_config
from embed_core.errors import ConfigError
from tests.helpers.repo import REPO


@pytest.mark.parametrize("path", sorted((REPO / "deployments/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path):
    assert load_config(path).prepare.sources


def test_extends_merges_mappings_and_replaces_lists(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "run_name: base\nseed: 1\nprepare:\n  cleaning: {max_chars: 100, dedupe: exact}\n"
        "  sources: [{name: a, kind: sts, path: a.csv}, {name: b, kind: sts, path: b.csv}]\n")
    (tmp_path / "child.yaml").write_text(
        "extends: base.yaml\nrun_name: child\nprepare:\n  cleaning: {max_chars: 50}\n"
        "  sources: [{name: c, kind: sts, path: c.csv}]\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.run_name == "child" and cfg.seed == 1
    assert cfg.prepare.cleaning.max_chars == 50 and cfg.prepare.cleaning.dedupe == "exact"
    assert [s.name for s in cfg.prepare.sources] == ["c"]


def test_extends_loop_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "a.yaml")

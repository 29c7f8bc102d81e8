"""What a pytest command selects (tests/helpers/tiers.py), read from a real collection in a fresh
pytest process run as a developer types it."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.collected_markers import ENV
from tests.helpers.repo import REPO

SLOWER_TIERS = {"slow", "integration", "matrix", "prefect", "llama_server"}


def collect(tmp_path, *args: str) -> tuple[dict[str, list[str]], str]:
    """Node id -> markers of what ``pytest --co ARGS`` selects, and its last output line."""
    out = tmp_path / "collected.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "EMBEDPIPE_TEST_"))}
    env.update({ENV: str(out), "PYTHONPATH": str(REPO)})
    done = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                           "-p", "tests.helpers.collected_markers", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text()), done.stdout.strip().splitlines()[-1]


@pytest.mark.slow  # collects the whole suite in a fresh process (about 15 CPU-s)
def test_plain_pytest_selects_the_fast_tier_only_and_leaves_the_slower_tiers_out(tmp_path):
    selected, summary = collect(tmp_path)
    assert len(selected) > 500 and "deselected" in summary
    assert all(node.startswith("tests/unit/") for node in selected)
    assert not [node for node, markers in selected.items() if SLOWER_TIERS & set(markers)]


def test_a_named_path_runs_every_tier_of_what_it_names(tmp_path):
    path = "tests/integration/launchers/test_exits.py"
    selected, summary = collect(tmp_path, path)
    assert selected and all(node.startswith(path) for node in selected)
    assert all("integration" in markers for markers in selected.values())
    assert "deselected" not in summary


@pytest.mark.slow  # collects the whole suite in a fresh process
def test_a_marker_expression_picks_its_tier_even_without_a_path(tmp_path):
    selected, _ = collect(tmp_path, "-m", "matrix")
    assert selected and all("matrix" in markers for markers in selected.values())

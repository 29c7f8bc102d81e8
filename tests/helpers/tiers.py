"""The test tiers (docs/testing.md, "Tiers"): which tests a pytest invocation runs.

Plain ``pytest`` (no ``-m``, no path) runs the fast tier: the tests that start no server, no
launcher and no whole pipeline. The slower tiers are markers: ``slow`` (set by hand, and on every
test that starts a real server), ``integration`` (every test under ``tests/integration``, set at
collection), ``matrix`` (the distributed matrix). ``make test`` names its marker expression, so it
runs every tier but the matrix; a path on the command line runs what it names, every tier."""

from __future__ import annotations

import os
import shlex

import pytest

FAST = "not slow and not integration and not matrix"
INTEGRATION_DIR = "tests/integration/"


def named_marker_expression(config: pytest.Config) -> bool:
    """Whether the command line (or PYTEST_ADDOPTS) gave ``-m``, even an empty one."""
    args = [*config.invocation_params.args, *shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))]
    return bool(config.option.markexpr) or any(a.startswith("-m") for a in args)


def plain(config: pytest.Config) -> bool:
    """No path and no marker expression: the fast tier."""
    return config.args_source != pytest.Config.ArgsSource.ARGS and not named_marker_expression(config)


def select_default_tier(config: pytest.Config) -> None:
    """Plain ``pytest`` selects the fast tier (as if ``-m FAST`` were given)."""
    if plain(config):
        config.option.markexpr = FAST


def mark_integration(item: pytest.Item, rootpath) -> None:
    if item.path.relative_to(rootpath).as_posix().startswith(INTEGRATION_DIR):
        item.add_marker(pytest.mark.integration)

"""The layout's rules, checked on the source: the library never imports the orchestration, tasks
never import flows, the production code carries no test hooks, and every config field is
documented in docs/configuration.md as generated from its description."""

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO


def _imports(root: Path) -> list[tuple[Path, int, str]]:
    """(file, line, imported module) for every import anywhere in the files under ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out += [(path, node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.append((path, node.lineno, node.module))
    return out


@pytest.mark.parametrize(("package", "forbidden"), [
    ("embed_core", ("prefect", "tasks", "flows")),
    ("tasks", ("flows",)),
])
def test_a_lower_layer_never_imports_a_higher_one(package, forbidden):
    bad = [f"{p.relative_to(REPO)}:{line} imports {mod}" for p, line, mod in _imports(REPO / package)
           if mod.split(".")[0] in forbidden]
    assert not bad, "\n".join(bad)


def test_production_code_has_no_test_hooks():
    bad = [f"{p.relative_to(REPO)}" for root in ("embed_core", "tasks", "flows") for p in (REPO / root).rglob("*.py")
           if "EMBEDPIPE_TEST" in p.read_text(encoding="utf-8")]
    assert not bad


def test_configuration_reference_is_generated_from_the_field_descriptions():
    from embed_core.config_reference import render

    doc = REPO / "docs" / "configuration.md"
    assert doc.exists() and doc.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is out of date: run `python -m embed_core.config_reference > docs/configuration.md`")


def test_every_config_field_and_loss_parameter_has_a_description():
    from pydantic import BaseModel

    from embed_core import config
    from embed_core.losses import LOSSES

    models = [m for m in vars(config).values() if isinstance(m, type) and issubclass(m, BaseModel)
              and m.__module__ == config.__name__ and not m.__name__.startswith("_")]
    models += [cls.Params for cls in LOSSES.values()]
    missing = [f"{m.__qualname__}.{name}" for m in models for name, f in m.model_fields.items() if not f.description]
    assert not missing, missing

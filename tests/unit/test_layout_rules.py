"""The layout's rules, checked on the source: the library never imports the orchestration nor the
tools, tasks never import flows, stage packages do not reach into each other (the losses below
train, train and evaluate apart, the registry and the process plumbing below every stage, the step
engine below the train stage), the production code carries no test hooks, and every config field
is documented in docs/configuration.md as generated from its description."""

import ast
from pathlib import Path

import pytest

from tests.helpers.repo import REPO


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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports, at module level or inside a function
    (``from a import b`` counts as importing ``a.b`` when ``b`` is a module)."""
    modules = {_module_name(p): p for p in (REPO / package).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for path, _, imported in _imports(REPO / package):
        graph[_module_name(path)].add(imported)
    for path in modules.values():  # from a import b, with b a submodule
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                graph[_module_name(path)].update(f"{node.module}.{a.name}" for a in node.names
                                                 if f"{node.module}.{a.name}" in modules)
    return {name: {m for m in deps if m in modules and m != name} for name, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_library_has_no_import_cycle_function_level_imports_included():
    cycle = _cycle(_import_graph("embed_core"))
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_reports_a_cycle_it_is_given():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_stage_modules_never_import_the_registry():
    """A stage package (a folder with a stage.py) is what the registry lists, so it never imports it;
    run-level code (embed_core.runs) may."""
    graph = _import_graph("embed_core")
    stage_packages = {m.rsplit(".", 1)[0] for m in graph if m.endswith(".stage")}
    assert {"embed_core.prepare", "embed_core.train"} <= stage_packages
    bad = [m for m, deps in graph.items() if any(m.startswith(p + ".") for p in stage_packages)
           and "embed_core.stages" in deps]
    assert not bad, bad


@pytest.mark.parametrize(("package", "forbidden"), [
    ("embed_core", ("prefect", "tasks", "flows", "embedpipe_tools")),
    ("tasks", ("flows",)),
])
def test_a_lower_layer_never_imports_a_higher_one(package, forbidden):
    bad = [f"{p.relative_to(REPO)}:{line} imports {mod}" for p, line, mod in _imports(REPO / package)
           if mod.split(".")[0] in forbidden]
    assert not bad, "\n".join(bad)


def _import_targets(root: Path) -> list[tuple[Path, int, str]]:
    """(file, line, imported name) for every import in ``root`` (a module, or the modules under a
    folder), function-level ones included; ``from a import b`` gives both ``a`` and ``a.b``."""
    out = []
    for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out += [(path, node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out += [(path, node.lineno, node.module)] + [(path, node.lineno, f"{node.module}.{a.name}")
                                                              for a in node.names]
    return out


def _importing(root: Path, packages: set[str] | list[str]) -> list[str]:
    """'file:line imports name' for each import statement under ``root`` of one of ``packages`` or a
    module in one (the shortest name it matches by)."""
    found: dict[tuple[Path, int], str] = {}
    for p, line, name in _import_targets(root):
        if any(name == pkg or name.startswith(pkg + ".") for pkg in packages):
            found[p, line] = min(found.get((p, line), name), name, key=len)
    return sorted(f"{p.relative_to(REPO) if p.is_relative_to(REPO) else p}:{line} imports {name}"
                  for (p, line), name in found.items())


def _stage_packages() -> set[str]:
    """The stage packages: each folder of embed_core with a stage.py (what the registry lists)."""
    return {f"embed_core.{p.parent.name}" for p in (REPO / "embed_core").glob("*/stage.py")}


def test_the_import_finder_sees_module_level_function_level_and_from_imports(tmp_path):
    (tmp_path / "m.py").write_text("import a.b\nfrom c import d\ndef f():\n    from e.f import g\nimport eh\n")
    assert sorted(name for _, _, name in _import_targets(tmp_path)) == ["a.b", "c", "c.d", "e.f", "e.f.g", "eh"]
    assert _importing(tmp_path, ["c.d", "e"]) == [f"{tmp_path / 'm.py'}:2 imports c.d",
                                                  f"{tmp_path / 'm.py'}:4 imports e.f"]


def test_the_losses_never_import_the_train_stage_or_its_engine():
    """A loss is given a batch (``embed_core.losses.batch``) and embeddings; the engine that builds
    them sits above it."""
    bad = _importing(REPO / "embed_core" / "losses", ["embed_core.train"])
    assert not bad, "\n".join(bad)


def test_train_and_evaluate_never_import_each_other():
    """What both need (the task specs, the scoring, the directory names) is below both:
    ``embed_core.scoring`` and ``embed_core.stage_dirs``."""
    bad = _importing(REPO / "embed_core" / "train", ["embed_core.evaluate"]) + \
        _importing(REPO / "embed_core" / "evaluate", ["embed_core.train"])
    assert not bad, "\n".join(bad)


def test_the_stage_registry_imports_no_stage_package():
    """``embed_core/stages.py`` names each stage's module in ``ORDER`` and imports it on first use."""
    packages = _stage_packages()
    assert {"embed_core.prepare", "embed_core.train", "embed_core.evaluate"} <= packages
    bad = _importing(REPO / "embed_core" / "stages.py", packages)
    assert not bad, "\n".join(bad)


def test_the_process_plumbing_imports_no_stage_package():
    """``embed_core.dist`` is below every stage: a spawned rank runs the body its spec names."""
    bad = _importing(REPO / "embed_core" / "dist", _stage_packages())
    assert not bad, "\n".join(bad)


def test_the_step_engine_imports_none_of_the_train_stages_run_directory_modules():
    """``embed_core.train.engine`` runs steps on what it is given (datasets, a checkpoint directory):
    of the train stage's own modules it reads the config alone."""
    stage_modules = {f"embed_core.train.{p.stem}" for p in (REPO / "embed_core" / "train").glob("*.py")
                     if p.stem not in ("__init__", "config")}
    assert {"embed_core.train.run", "embed_core.train.stage", "embed_core.train.records",
            "embed_core.train.dev"} <= stage_modules
    bad = _importing(REPO / "embed_core" / "train" / "engine", stage_modules)
    assert not bad, "\n".join(bad)


def test_the_library_never_imports_the_tools_nor_runs_the_command_line():
    """The programs that drive embedpipe from outside (the GPU check and the GPU runs, in
    ``embedpipe_tools``) are not in the library: it neither imports them nor starts the command."""
    bad = _importing(REPO / "embed_core", ["embedpipe_tools", "flows", "tasks"])
    for path in sorted((REPO / "embed_core").rglob("*.py")):
        bad += [f"{path.relative_to(REPO)}:{node.lineno} runs {node.value}"
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and (node.value == "flows.cli" or node.value.startswith("embedpipe_tools"))]
    assert not bad, "\n".join(bad)


def test_production_code_has_no_test_hooks():
    bad = [f"{p.relative_to(REPO)}" for root in ("embed_core", "tasks", "flows", "embedpipe_tools") for p in (REPO / root).rglob("*.py")
           if "EMBEDPIPE_TEST" in p.read_text(encoding="utf-8")]
    assert not bad


def test_no_production_function_is_longer_than_eighty_lines():
    long = [f"{p.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for root in ("embed_core", "tasks", "flows", "embedpipe_tools") for p in sorted((REPO / root).rglob("*.py"))
            for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert not long


def test_configuration_reference_is_generated_from_the_field_descriptions():
    from embed_core.config_reference import render

    doc = REPO / "docs" / "configuration.md"
    assert doc.exists() and doc.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is out of date: run `python -m embed_core.config_reference > docs/configuration.md`")


def _config_modules() -> list[str]:
    """Every config module of the library (embed_core.config, embed_core.config_base and each
    embed_core.<stage>.config): the modules the fingerprint's code walk treats as config."""
    from embed_core.fingerprint import is_leaf

    names = [_module_name(p) for p in (REPO / "embed_core").rglob("*.py")]
    return sorted(n for n in names if is_leaf(n) and n != "embed_core.stages")


def test_every_config_module_is_found_and_is_a_leaf_of_the_code_walk():
    modules = _config_modules()
    assert {"embed_core.config", "embed_core.config_base", "embed_core.prepare.config", "embed_core.mine.config",
            "embed_core.train.config", "embed_core.evaluate.config", "embed_core.synthesize.config"} <= set(modules)


def test_every_config_field_loss_parameter_and_converter_parameter_has_a_description():
    import importlib

    from pydantic import BaseModel

    from embed_core.losses import LOSSES
    from embed_core.prepare.convert import CONVERTERS

    models = []
    for name in _config_modules():
        module = importlib.import_module(name)
        models += [m for m in vars(module).values() if isinstance(m, type) and issubclass(m, BaseModel)
                   and m.__module__ == name]
    models += [cls.Params for cls in LOSSES.values()]
    models += [cls.Params for cls in CONVERTERS.values()]
    assert len(models) > 30
    missing = [f"{m.__module__}.{m.__qualname__}.{name}" for m in models for name, f in m.model_fields.items()
               if not f.description]
    assert not missing, missing

"""docs/gpu-training.md's table of GPU-only behaviours names the CPU tests that check them: every
file it names exists, and every ``file::test`` is a test function in that file (a renamed or
deleted test makes the table fail here, not silently go stale)."""

import ast
import re

from tests.helpers.repo import REPO

DOC = REPO / "docs/gpu-training.md"


def _named() -> list[tuple[str, str | None]]:
    table = DOC.read_text().split("## What is checked on a CPU", 1)[1]
    out, current = [], None
    for path, name in re.findall(r"`(?:([\w/]+\.py))?(?:::(\w+))?`", table):
        if path and not path.startswith("tests/"):  # a file named before in full, by its name alone
            found = sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob(path))
            assert len(found) == 1, (path, found)
            path = found[0]
        if path:
            current = path
        if path or name:
            out.append((path or current, name or None))
    return out


def test_every_test_the_gpu_table_names_exists():
    named = _named()
    assert len(named) > 30
    for path, name in named:
        file = REPO / path
        assert file.is_file(), path
        if name:
            tests = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
            assert name in tests, f"{path}::{name}"

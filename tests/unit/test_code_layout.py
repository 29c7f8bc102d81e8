"""The code map cannot go stale: docs/orchestration.md's "Code layout" names every module under
``embed_core/``, ``flows/``, ``tasks/`` and ``embedpipe_tools/``, one line each, and names nothing that is gone.

The convention the block follows (and this file parses), one entry per line:

    <indent><name><two or more spaces><description>

* ``<indent>`` is two spaces per folder level: a line at level n sits inside the nearest line
  above it at level n - 1, which must be a folder. A top-level line (level 0) is a folder of the
  repository root (``embed_core/``, ``flows/``, ``tasks/``, ``data/`` ...).
* ``<name>`` is one path component: ``name.py`` for a module, ``name/`` for a folder (a folder with
  no Python in it, such as ``synthesize/prompts/``, may be listed too). So ``fsdp.py`` under
  ``backends/`` under ``train/`` under ``embed_core/`` names ``embed_core/train/engine/backends/fsdp.py``.
* ``<description>`` is what the entry is for, on that same line: no continuation lines, no line
  longer than 110 characters, and no entry without one.

A package's ``__init__.py`` may be left out (its folder's line says what the package is); one that
is listed must exist like any other entry. Modules are counted on the file system, so a module added
in a working tree shows up here before it is committed.
"""

import re
from pathlib import Path

from tests.helpers.repo import REPO

DOC = REPO / "docs" / "orchestration.md"
ROOTS = ("embed_core", "flows", "tasks", "embedpipe_tools")
MAX_LINE = 110
ENTRY = re.compile(r"(?P<indent>(?:  )*)(?P<name>[\w.-]+(?:\.py|/))(?: {2,}(?P<desc>\S.*))?")


def _block(doc: str) -> list[tuple[int, str]]:
    """(line number in the doc, line) for each line of the first fenced block of "## Code layout"."""
    lines = doc.splitlines()
    start = lines.index("## Code layout")
    fence = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    assert not any(line.startswith("## ") for line in lines[start + 1:fence]), \
        "docs/orchestration.md: the Code layout section has no code block"
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    return [(i + 1, lines[i]) for i in range(fence + 1, end)]


def _parse(block: list[tuple[int, str]]) -> tuple[dict[str, int], list[str]]:
    """The paths the block names (``embed_core/train/engine/backends/fsdp.py``, folders ending in ``/``),
    each with its line number, and the lines that break the convention."""
    named: dict[str, int] = {}
    problems: list[str] = []
    stack: list[str] = []  # the folders the current line is inside, one per level
    for number, line in block:
        if not line.strip():
            continue
        where = f"docs/orchestration.md:{number}"
        match = ENTRY.fullmatch(line)
        if not match:
            problems.append(f"{where}: not '<two spaces per level><name.py or name/>  <description>': {line!r}")
            continue
        level = len(match["indent"]) // 2
        if level > len(stack):
            problems.append(f"{where}: indented {level} levels, but the line above opens only {len(stack)}")
            continue
        if not match["desc"]:
            problems.append(f"{where}: {match['name']} has no description on its line")
        if len(line) > MAX_LINE:
            problems.append(f"{where}: {len(line)} characters, more than {MAX_LINE}")
        del stack[level:]
        path = "".join(stack) + match["name"]
        if path in named:
            problems.append(f"{where}: {path} is named twice (first on line {named[path]})")
        named[path] = number
        if match["name"].endswith("/"):
            stack.append(match["name"])
    return named, problems


def _layout() -> tuple[dict[str, int], list[str]]:
    return _parse(_block(DOC.read_text(encoding="utf-8")))


def _modules() -> list[str]:
    """Every module under the roots, relative to the repository, ``__init__.py`` aside."""
    return sorted(p.relative_to(REPO).as_posix() for root in ROOTS for p in (REPO / root).rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def _missing(named: dict[str, int]) -> list[str]:
    return [module for module in _modules() if module not in named]


def _stale(named: dict[str, int]) -> list[str]:
    return [f"docs/orchestration.md:{number}: {path}" for path, number in named.items()
            if not ((REPO / path).is_dir() if path.endswith("/") else (REPO / path).is_file())]


def test_every_module_under_embed_core_flows_and_tasks_is_named_in_the_code_layout():
    named, _ = _layout()
    missing = _missing(named)
    assert not missing, ("docs/orchestration.md's Code layout does not name these modules (add one line "
                         "each, under its package's folder line):\n  " + "\n  ".join(missing))


def test_every_path_the_code_layout_names_still_exists():
    named, _ = _layout()
    stale = _stale(named)
    assert not stale, ("docs/orchestration.md's Code layout names paths that do not exist (renamed or "
                       "removed: update or drop the line):\n  " + "\n  ".join(stale))


def test_the_code_layout_is_one_described_line_per_entry_in_a_tree_of_two_space_levels():
    _, problems = _layout()
    assert not problems, "docs/orchestration.md's Code layout:\n  " + "\n  ".join(problems)


def test_a_module_whose_line_is_dropped_from_the_code_layout_is_named_as_missing():
    """The check can fail: without ``ranks.py``'s line (inside ``train/``, after a subfolder of
    ``train/`` and its modules), ``embed_core/dist/ranks.py`` is missing, and nothing else is added."""
    block = _block(DOC.read_text(encoding="utf-8"))
    kept = [(n, line) for n, line in block if not re.fullmatch(r"    ranks\.py {2,}\S.*", line)]
    assert len(kept) == len(block) - 1
    before = _missing(_parse(block)[0])
    assert _missing(_parse(kept)[0]) == sorted(before + ["embed_core/dist/ranks.py"])

"""What a stage's cache key is made of: content hashes of its inputs, its config, and its code.

A cache hit must mean "the same result". So a stage's key (``Fingerprint.key``) covers

* the bytes of every input it reads (data files, upstream outputs, model weights), hashed by
  streaming and remembered by file identity — ``(path, size, mtime, ctime, inode)`` in a small
  SQLite table — so a 1 GB weights file is read once, not at every ``embedpipe status``;
* its config section (canonical JSON of the validated values, defaults included);
* the **identity of its code**: a hash of the source of every ``embed_core`` module the stage's
  module imports, directly or not (found by reading the ``import`` statements in its bytecode, function-level ones
  included; a package that hands its ``__path__`` to a discovery call (``embed_core.registry``,
  ``pkgutil.iter_modules``), like the loss registry, depends on all its modules), plus the versions of the libraries that shape its output (torch, transformers,
  faiss, mteb, ...). A fixed bug in a converter recomputes prepare; a README or test edit
  recomputes nothing; a loss edit recomputes training but not prepare or mine.

Some modules are leaves of that walk. The config modules (``embed_core.config``,
``embed_core.config_base`` and every stage's ``embed_core.<stage>.config``): what they contribute
to a stage (defaults, validators) is already in the hashed config values, and following them
would tie every stage to every loss and converter file (the registries validate parameters at
load time). ``embed_core.stages``: the registry only wires stages together; which upstream
outputs a stage read is in its key as their content hashes. ``embed_core.train.dev``: a train stage
loads its dev evaluation (and through it the scoring modules, ``embed_core.scoring``, and mteb)
only when it has dev tasks; its key then adds that module's own code identity with the scoring
libraries' versions, so a scoring edit does not retrain a stage without dev tasks, and does retrain one whose dev
scores choose the weights it keeps. A leaf is still followed when it is the walk's root.
"""

from __future__ import annotations

import dis
import functools
import hashlib
import json
import os
import sqlite3
import types
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PACKAGE = "embed_core"
PACKAGE_ROOT = Path(__file__).resolve().parent
# Modules whose effect on a stage is captured elsewhere in the key (see the module docstring):
# the config modules, named config or config_base at any level, the stage registry, and the dev
# evaluation, which a train stage loads only when it has dev tasks (its key then adds that code).
CONFIG_MODULE_NAMES = frozenset({"config", "config_base"})
LEAF_MODULES = frozenset({"embed_core.stages", "embed_core.train.dev"})


def is_leaf(module: str) -> bool:
    """Whether the code walk stops at ``module`` (a config module or the stage registry)."""
    return module in LEAF_MODULES or module.rpartition(".")[2] in CONFIG_MODULE_NAMES


# -- file hashes ----------------------------------------------------------------------------------

def hash_cache_path() -> Path:
    """SQLite file of remembered file hashes (``EMBEDPIPE_CACHE_DIR``, default ~/.cache/embedpipe)."""
    root = Path(os.environ.get("EMBEDPIPE_CACHE_DIR", Path.home() / ".cache" / "embedpipe"))
    return root / "file-hashes.sqlite"


_memo: dict[tuple, str] = {}


def _identity(path: Path) -> tuple:
    st = path.stat()
    # ctime cannot be set by a user (mtime can, e.g. `touch -d`, `cp -p`): any write changes it
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _db() -> sqlite3.Connection | None:
    try:
        path = hash_cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(path, timeout=10)
        con.execute("CREATE TABLE IF NOT EXISTS file_hash (identity TEXT PRIMARY KEY, sha256 TEXT NOT NULL)")
        return con
    except (OSError, sqlite3.Error):
        return None  # a read-only home: hashes are still right, only not remembered across processes


def _stream_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_file(path: str | Path, *, remember: bool = True) -> str:
    """SHA-256 of a file's bytes, streamed (memory stays flat), remembered by file identity
    (``remember=False``: a file about to move, e.g. in a stage's staging directory)."""
    path = Path(path)
    if not remember:
        return _stream_sha256(path)
    ident = _identity(path)
    if ident in _memo:
        return _memo[ident]
    key = json.dumps(ident)
    con = _db()
    try:
        row = con.execute("SELECT sha256 FROM file_hash WHERE identity = ?", (key,)).fetchone() if con else None
        if row:
            digest = row[0]
        else:
            digest = _stream_sha256(path)
            if con:
                with con:
                    con.execute("INSERT OR REPLACE INTO file_hash VALUES (?, ?)", (key, digest))
    except sqlite3.Error:
        digest = _stream_sha256(path)
    finally:
        if con:
            con.close()
    _memo[ident] = digest
    return digest


def forget_file_hashes() -> None:
    """Drop the in-process memo (the SQLite table stays): the next lookup goes to disk."""
    _memo.clear()


# -- code identity --------------------------------------------------------------------------------

def _module_file(name: str) -> Path | None:
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    rel = Path(*name.split(".")[1:])
    for candidate in (PACKAGE_ROOT / rel / "__init__.py", (PACKAGE_ROOT / rel).with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _imported_names(path: Path, module: str) -> set[str]:
    """Every module an ``import`` anywhere in the file may load (``from a import b``: a and a.b).

    Read from the compiled bytecode (``IMPORT_NAME`` and the level and names loaded before it),
    not from ``ast.parse``: CPython 3.11 before 3.11.8 keeps the AST constructor's recursion depth
    per interpreter, not per thread, so a parse here while another thread of a flow run parses too
    (pydantic's ``inspect.signature`` in Prefect's event-loop thread does) fails with "SystemError:
    AST constructor recursion depth mismatch" (python/cpython#106905). Compiling to bytecode
    builds no Python AST objects.
    """
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    code = compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    for obj in _code_objects(code):
        instructions = list(dis.get_instructions(obj))
        for i, ins in enumerate(instructions):
            if ins.opname == "IMPORT_NAME":
                level, fromlist = instructions[i - 2].argval, instructions[i - 1].argval
                names.update(_import_targets(module, is_package, ins.argval, level, fromlist or ()))
            elif is_package and ins.argval == "__path__" and ins.opname in {"LOAD_NAME", "LOAD_GLOBAL"}:
                # a registry that imports every module of its package: its __path__ handed to
                # embed_core.registry.discover or pkgutil.iter_modules (embed_core.losses)
                names.update(f"{module}.{p.stem}" for p in path.parent.glob("*.py") if p.name != "__init__.py")
    return names


def _import_targets(module: str, is_package: bool, name: str, level: int, fromlist: tuple) -> set[str]:
    """``import name`` or ``from <level dots>name import fromlist`` in ``module``, as absolute names."""
    if level:
        parts = module.split(".")
        base_parts = parts if is_package else parts[:-1]
        base_parts = base_parts[:len(base_parts) - level + 1]
        name = ".".join(base_parts + ([name] if name else []))
    return {name} | {f"{name}.{alias}" for alias in fromlist}


def module_closure(root: str) -> dict[str, Path]:
    """``embed_core`` modules that ``root`` imports, directly or not (and their packages), by name."""
    seen: dict[str, Path] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen[name] = path
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # importing a.b.c runs a and a.b
        if name == root or not is_leaf(name):  # a leaf of other walks is followed as a root
            todo.extend(_imported_names(path, name))
    return seen


def library_versions(libraries: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for lib in libraries:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            out[lib] = "absent"
    return out


@functools.lru_cache(maxsize=None)
def code_identity(module: str, libraries: tuple[str, ...] = ()) -> str:
    """Hash of the source of ``module``'s import closure plus the given libraries' versions."""
    h = hashlib.sha256()
    for name, path in sorted(module_closure(module).items()):
        h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    h.update(json.dumps(library_versions(libraries), sort_keys=True).encode())
    return h.hexdigest()


# -- the fingerprint ------------------------------------------------------------------------------

class Fingerprint(BaseModel):
    """A stage's inputs, computed once per run and passed down to the stage and its cache."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: str = Field(description="Stage directory name (prepare, train-stage1, ...).")
    key: str = Field(description="SHA-256 over inputs, config and code: equal keys mean the same result.")
    code: str = Field(description="Code identity (module closure source + library versions).")
    inputs: dict[str, Any] = Field(description="What went into the key, for manifests and debugging.")
    details: dict[str, Any] = Field(default_factory=dict, description="Values the stage reuses (e.g. the "
                                    "model fingerprint that names its embedding cache); not part of the key.")

    @classmethod
    def of(cls, stage: str, module: str, libraries: tuple[str, ...], inputs: dict[str, Any],
           details: dict[str, Any] | None = None) -> "Fingerprint":
        code = code_identity(module, libraries)
        blob = json.dumps({"inputs": inputs, "code": code}, sort_keys=True, default=str)
        return cls(stage=stage, key=hashlib.sha256(blob.encode()).hexdigest(), code=code, inputs=inputs,
                   details=details or {})

"""``make gpu-bundle`` (``python -m embedpipe_tools.gpurun.bundle``): the wheels a GPU machine lacks for the
project, for an offline reservation with a small transfer budget.

Such a machine has Python 3.12 with a CUDA torch, transformers, sentence-transformers, pandas,
pyarrow, peft and accelerate preinstalled (``MACHINE_HAS``) and nothing else of ours. The bundle is
the project's runtime requirements (pyproject.toml's ``dependencies``) and everything they need,
closed over the installed distributions' metadata with Python 3.12's markers, minus ``MACHINE_HAS``
and everything *they* need (the machine has those already: torch stays the machine's own), each
pinned to the version installed here (what the tests ran on) and downloaded as a Python 3.12
manylinux x86-64 wheel, plus the project itself as a wheel. All of it goes into one tar, cut into
parts of at most ``PART_BYTES`` (60 MiB; a wheel larger than that is cut too), beside ``install.sh``,
which checks the parts' SHA-256 sums, reassembles them and installs with ``pip install --no-index
--no-deps`` (so pip neither reaches an index nor touches the machine's torch), then checks that the
project imports and that torch's version did not change.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Iterable
from pathlib import Path

from embed_core.errors import EmbedpipeError, GpuRunError

REPO = Path(__file__).resolve().parents[2]
PART_BYTES = 60 * 2 ** 20
# what the GPU machines we plan for have installed (with whatever those need)
MACHINE_HAS = ("torch", "transformers", "sentence-transformers", "pandas", "pyarrow", "peft", "accelerate")
# ... and what they lack even where a version of one of MACHINE_HAS here needs it (typer, under
# transformers, needs pydantic here): always bundled, with what they need
MACHINE_LACKS = ("prefect", "mteb", "faiss-cpu", "pydantic", "datasketch")
# What install.sh imports once installed: the modules the machine lacked, then the project's packages
CHECKED_MODULES = ("prefect", "mteb", "faiss", "pydantic", "datasketch", "embed_core", "flows", "tasks",
                   "embedpipe_tools")
PYTHON = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")
# Python 3.12 on Linux x86-64: the markers a requirement is judged by
TARGET_ENV = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.0", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
              "os_name": "posix", "platform_machine": "x86_64"}
TAR_NAME = "embedpipe-gpu-bundle.tar"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """pyproject.toml's runtime ``dependencies`` (no extras)."""
    return list(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"])


def _applies(req, extras: frozenset[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**TARGET_ENV, "extra": e}) for e in (extras or {""}))


def closure(roots: Iterable[str], stop: Iterable[str] = ()) -> dict[str, dict]:
    """Every distribution ``roots`` need on Python 3.12 (themselves included), by canonical name:
    its installed version and the names it was reached from; requirements with extras
    (``sqlalchemy[asyncio]``) follow those extras' requirements too. A needed distribution that is
    not installed here is a GpuRunError (its version would be a guess). The walk does not enter
    the distributions named in ``stop``."""
    from packaging.requirements import Requirement

    found: dict[str, dict] = {}
    todo = [(Requirement(r), "pyproject.toml") for r in roots]
    seen_extras: set[tuple[str, frozenset[str]]] = set()
    stop = {canonical(n) for n in stop}
    while todo:
        req, parent = todo.pop()
        name = canonical(req.name)
        key = (name, frozenset(req.extras))
        if key in seen_extras:
            found[name]["needed_by"].add(parent)
            continue
        seen_extras.add(key)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise GpuRunError(f"{parent} needs {req} on Python {PYTHON}, which is not installed here "
                              f"(install it, or the bundle could not pin its version)") from None
        found.setdefault(name, {"name": dist.metadata["Name"], "version": dist.version, "needed_by": set()})
        found[name]["needed_by"].add(parent)
        for raw in dist.requires or []:
            sub = Requirement(raw)
            if _applies(sub, frozenset(req.extras)) and canonical(sub.name) not in stop:
                todo.append((sub, name))
    return found


def resolve(requirements: list[str], machine_has: Iterable[str] = MACHINE_HAS,
            machine_lacks: Iterable[str] = MACHINE_LACKS) -> dict[str, dict]:
    """The distributions to bundle: the closure of ``requirements`` minus the closure of what the
    machine has (only the part of that closure installed here is known; the rest is the machine's),
    a walk that does not enter ``machine_lacks``."""
    from packaging.requirements import Requirement

    have = {canonical(n) for n in machine_has}
    installed_have = [n for n in machine_has if _installed(n)]
    machine = set(closure(installed_have, stop=machine_lacks)) | have
    wanted = closure([r for r in requirements if canonical(Requirement(r).name) not in have])
    return {n: info for n, info in sorted(wanted.items()) if n not in machine}


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
        return True
    except md.PackageNotFoundError:
        return False


def download(pins: dict[str, dict], dest: Path, pip: list[str] | None = None, python: str = PYTHON) -> list[Path]:
    """``pip download`` of every pin as a Python ``python`` (3.12) manylinux x86-64 (or pure-Python)
    wheel, without dependencies (the pins are the closure already); the paths of the wheels in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [*(pip or [sys.executable, "-m", "pip"]), "download", "--only-binary=:all:", "--no-deps",
           "--python-version", python, "--implementation", "cp", "--abi", f"cp{python.replace('.', '')}",
           "--abi", "abi3", "--abi", "none", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest),
           *[f"{info['name']}=={info['version']}" for info in pins.values()]]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["(no message)"]
        raise GpuRunError(f"pip download of {len(pins)} pinned wheels failed: {' '.join(last[0].split())[:300]}")
    return sorted(dest.glob("*.whl"))


def project_wheel(dest: Path) -> Path:
    """The project as a wheel (``pip wheel --no-deps --no-build-isolation``: the setuptools here)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="embedpipe-wheel-") as tmp:
        src = Path(tmp) / "src"  # a copy: building in the checkout would leave build/ and egg-info there
        shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "dist", "build", "*.egg-info",
                                                                 "__pycache__", "data", "tests", ".prefect*"))
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                               str(dest), str(src)], capture_output=True, text=True)
    if done.returncode != 0:
        raise GpuRunError(f"building the project's wheel failed: {' '.join(done.stderr.split())[-300:]}")
    return next(dest.glob("embedpipe-*.whl"))


def split(path: Path, out: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """``path`` cut into ``<name>.part-000``, ``-001``, ... of at most ``part_bytes`` each (``cat``
    of them in order is the file again)."""
    parts = []
    with path.open("rb") as f:
        while chunk := f.read(part_bytes):
            part = out / f"{path.name}.part-{len(parts):03d}"
            part.write_bytes(chunk)
            parts.append(part)
    return parts


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(2 ** 20):
            h.update(chunk)
    return h.hexdigest()


INSTALL_SH = """#!/usr/bin/env bash
# Reassemble the embedpipe GPU bundle and install it offline into this machine's Python
# (PYTHON=..., default python3), leaving its own torch (and everything else it has) as it is.
#   bash install.sh            # in the folder holding install.sh, SHA256SUMS and the parts
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
# the machine's transformers stays: it must be one the project runs on (before 5.2 a decoder made
# bidirectional silently stays causal)
"$PY" -c 'import importlib.metadata as m, re, sys
try:
    v = m.version("transformers")
except m.PackageNotFoundError:
    sys.exit("install.sh: transformers is not installed; embedpipe needs transformers>=5.2,<6 (the bundle uses the machine'"'"'s)")
if tuple(int(n) for n in re.findall(r"\\d+", v)[:2]) < (5, 2):
    sys.exit(f"install.sh: transformers {v} is older than 5.2, which embedpipe needs: install transformers>=5.2,<6 first")' || exit 2
sha256sum -c SHA256SUMS
rm -rf wheels && mkdir wheels
cat __TAR__.part-* | tar -x -C wheels
tag="cp$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
other="$(ls wheels | grep -E -- '-cp3[0-9]+-' | grep -v -- "-$tag-" | head -1 || true)"
if [ -n "$other" ]; then
  echo "install.sh: the bundle's wheels are built for another Python ($other); $PY is Python $("$PY" -c 'import platform; print(platform.python_version())') (make gpu-bundle builds for 3.12)" >&2
  exit 2
fi
torch_before="$("$PY" -c 'import torch; print(torch.__version__)')"
# --no-deps: exactly the pinned set (resolved where it was tested); --no-index: nothing downloaded
"$PY" -m pip install --no-index --no-deps --find-links wheels wheels/*.whl
torch_after="$("$PY" -c 'import torch; print(torch.__version__)')"
if [ "$torch_before" != "$torch_after" ]; then echo "install.sh: torch changed: $torch_before -> $torch_after" >&2; exit 1; fi
"$PY" -m pip check || echo "install.sh: pip check reports the conflicts above (the machine's own packages)" >&2
"$PY" -c 'import importlib, torch; [importlib.import_module(m) for m in "__MODULES__".split()]; print("install.sh: embedpipe installed; torch", torch.__version__)'
"""


def build(out: Path, *, requirements: list[str] | None = None, part_bytes: int = PART_BYTES,
          pip: list[str] | None = None) -> dict:
    """Write the bundle into ``out`` (emptied first): the parts, SHA256SUMS, install.sh and
    bundle.json (what is in it and why); bundle.json's content."""
    pins = resolve(requirements if requirements is not None else project_requirements())
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        wheels = Path(tmp) / "wheels"
        files = download(pins, wheels, pip) if pins else []
        files.append(project_wheel(wheels))
        tar = Path(tmp) / TAR_NAME
        with tarfile.open(tar, "w") as t:
            for f in files:
                t.add(f, arcname=f.name)
        parts = split(tar, out, part_bytes)
    (out / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n" for p in parts), encoding="utf-8")
    script = out / "install.sh"
    script.write_text(INSTALL_SH.replace("__TAR__", TAR_NAME).replace("__MODULES__", " ".join(CHECKED_MODULES)),
                      encoding="utf-8")
    script.chmod(0o755)
    manifest = {"python": PYTHON, "platforms": list(PLATFORMS), "machine_has": list(MACHINE_HAS),
                "pins": {info["name"]: info["version"] for info in pins.values()},
                "needed_by": {info["name"]: sorted(info["needed_by"]) for info in pins.values()},
                "wheels": [f.name for f in files],
                "parts": {p.name: p.stat().st_size for p in parts}, "part_limit_bytes": part_bytes}
    (out / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m embedpipe_tools.gpurun.bundle", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "dist" / "gpu-bundle", help="the bundle's folder (emptied first)")
    args = p.parse_args(argv)
    try:
        manifest = build(args.out)
    except EmbedpipeError as exc:
        print(f"embedpipe: error: {exc}", file=sys.stderr)
        return 2
    total = sum(manifest["parts"].values())
    print(f"gpu-bundle: {len(manifest['wheels'])} wheels in {len(manifest['parts'])} parts ({total / 2 ** 20:.1f} MiB) "
          f"in {args.out}; on the machine: bash {args.out.name}/install.sh")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

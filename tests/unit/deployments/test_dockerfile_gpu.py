"""deployments/Dockerfile.gpu, read as text (no docker here): it installs the torch the project tests,
as a CUDA build from the PyTorch index, and every extra a training config can ask for."""

import re
import subprocess
import tomllib

from packaging.requirements import Requirement

from tests.helpers.repo import REPO

DOCKERFILE = REPO / "deployments/Dockerfile.gpu"

# Extras the code names in its install hints that the gpu pool never needs, and why.
NOT_ON_THE_GPU_POOL = {
    "llm": "the synthesize stage's llama.cpp server runs on the cpu pool",
    "ray": "engine: ray serves mine and evaluate, stages of the cpu pool (dev evaluation encodes in the trainer)",
}


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of every instruction, continuation lines joined, comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    logical = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in logical.splitlines() if line.strip()]


def _arg_defaults() -> dict[str, str]:
    return dict(args.split("=", 1) for kind, args in _instructions() if kind == "ARG" and "=" in args)


def _runs_with(fragment: str) -> list[str]:
    return [args for kind, args in _instructions() if kind == "RUN" and fragment in args]


def _extras_named_by_the_code() -> set[str]:
    """Every extra an error message of embed_core tells the user to install (pip install -e '.[x]')."""
    found = set()
    for path in (REPO / "embed_core").rglob("*.py"):
        found |= set(re.findall(r"""pip install -e ['"]\.\[([\w-]+)\]['"]""", path.read_text(encoding="utf-8")))
    return found


def _installed_extras() -> set[str]:
    (run,) = _runs_with('".[')
    return set(re.search(r'"\.\[([\w,-]+)\]"', run).group(1).split(","))


def test_every_extra_a_training_config_can_ask_for_is_installed_in_the_gpu_image():
    named = _extras_named_by_the_code()
    assert {"deepspeed", "llm-train", "tracking"} <= named  # the scan finds the hints it is meant to
    assert set(NOT_ON_THE_GPU_POOL) <= named, "an extra left out of the image is no longer named by the code"
    assert named - set(NOT_ON_THE_GPU_POOL) <= _installed_extras()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert _installed_extras() <= set(extras)


def test_the_gpu_image_installs_the_tested_torch_from_the_pytorch_cuda_index():
    version = _arg_defaults()["TORCH_VERSION"]
    makefile_pin = re.search(r"pip install -q [^\n]*?torch==([\d.]+)\s", (REPO / "Makefile").read_text()).group(1)
    assert version == makefile_pin
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [Requirement(r) for r in pyproject if Requirement(r).name == "torch"]
    assert torch.specifier.contains(version)

    (run,) = _runs_with('"torch==${TORCH_VERSION}"')
    url = re.search(r"--index-url (.+?) &&", run).group(1)  # a shell word: "...cu$(echo "$CUDA" | ...)"
    resolved = subprocess.run(["bash", "-c", f"echo {url}"], env={"CUDA": "12.8.1", "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, check=True).stdout.strip()
    assert resolved == "https://download.pytorch.org/whl/cu128"
    # the extras' install may not replace it: it runs under the constraint the torch step writes
    (constraint,) = re.findall(r"> (\S+torch-constraint\.txt)", run)
    assert f"-c {constraint}" in _runs_with('".[')[0]


def test_the_base_image_is_cuda_named_by_the_same_argument_as_the_wheel_index():
    (base,) = [args for kind, args in _instructions() if kind == "FROM"]
    assert base.startswith("nvidia/cuda:${CUDA}-") and "pytorch/pytorch" not in base
    assert re.fullmatch(r"\d+\.\d+\.\d+", _arg_defaults()["CUDA"])

"""What a command imports is what it needs: saving a model or asking the CLI for help loads
neither DeepSpeed nor MLflow (embed_core/model/compat.py), each checked in a fresh process."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers.repo import REPO

HEAVY = ("deepspeed", "mlflow")
TINY_BERT = ("from transformers import BertConfig, BertModel\n"
             "model = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,"
             " num_attention_heads=2, intermediate_size=32))\n")


def loaded_after(code: str) -> dict[str, bool]:
    """Run ``code`` in a fresh interpreter; which of HEAVY (and torch) it left in sys.modules."""
    report = f"\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {(*HEAVY, 'torch')!r}}}))\n"
    done = subprocess.run([sys.executable, "-c", code + report], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_saving_a_model_through_embedpipe_loads_neither_deepspeed_nor_mlflow(tmp_path):
    loaded = loaded_after(TINY_BERT + "from embed_core.model.embedder import save_merged\n"
                          f"save_merged(model, {str(tmp_path / 'model')!r})\n")
    assert (tmp_path / "model" / "model.safetensors").exists()
    assert loaded == {"deepspeed": False, "mlflow": False, "torch": True}


def test_the_cli_help_loads_neither_deepspeed_nor_mlflow_nor_torch():
    loaded = loaded_after("import sys\nfrom flows.cli import main\nsys.argv = ['embedpipe', '--help']\n"
                          "try:\n    main()\nexcept SystemExit:\n    pass\n")
    assert loaded == {"deepspeed": False, "mlflow": False, "torch": False}


@pytest.mark.slow  # imports DeepSpeed itself (7 CPU-s)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_a_plain_save_pretrained_loads_deepspeed_and_a_process_that_imported_it_still_unwraps_its_engines(tmp_path):
    """The control: transformers' own save imports DeepSpeed (what the test above would catch), and
    once DeepSpeed is imported, accelerate's unwrapping looks for its engines again."""
    loaded = loaded_after(TINY_BERT + f"model.save_pretrained({str(tmp_path / 'plain')!r})\n"
                          "from embed_core.model.compat import deepspeed_only_once_imported\n"
                          "from accelerate.utils import other\n"
                          "deepspeed_only_once_imported()\n"
                          "assert other.is_deepspeed_available(), 'DeepSpeed imported but its engines not unwrapped'\n")
    assert loaded["deepspeed"] is True

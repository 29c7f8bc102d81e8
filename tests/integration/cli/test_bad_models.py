"""Model directories that are not loadable models, through the real CLI (``embedpipe evaluate``):
exit 2 with one line naming the directory or file and what to do, instead of a transformers
traceback; the same check (``embed_core.model.files.check_model_dir``) guards every loader."""

import json
import shutil
import struct

import pytest
import torch

from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data

pytestmark = pytest.mark.prefect

STS_TASK = {"name": "LocalSTS", "type": "sts", "path": "sts.csv"}


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


def _copy(tiny_model, dest):
    shutil.copytree(tiny_model, dest)
    return dest


def _not_a_model(tiny_model, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes/README.md").write_text("my notes\n")
    return tmp_path / "notes", "not a model directory (no config.json)"


def _truncated(tiny_model, tmp_path):
    model = _copy(tiny_model, tmp_path / "cut")
    blob = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    return model, "model.safetensors: truncated or damaged safetensors file"


def _pickle_only(tiny_model, tmp_path):
    from safetensors.torch import load_file

    model = _copy(tiny_model, tmp_path / "pickled")
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    return model, "has only pickle weights (pytorch_model.bin)"


def _a_file(tiny_model, tmp_path):
    return tiny_model / "config.json", "is a file, not a model directory"


def _edited_config(tiny_model, tmp_path, name, edit):
    model = _copy(tiny_model, tmp_path / name)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(edit(config))
    return model


def _config_not_json(tiny_model, tmp_path):
    model = _edited_config(tiny_model, tmp_path, "notjson", lambda c: json.dumps(c)[:-20])
    return model, "config.json: not JSON ("


def _zero_heads(tiny_model, tmp_path):
    model = _edited_config(tiny_model, tmp_path, "noheads", lambda c: json.dumps({**c, "num_attention_heads": 0}))
    return model, "config.json: num_attention_heads: 0 is not a whole number from 1 to"


def _absurd_layers(tiny_model, tmp_path):
    model = _edited_config(tiny_model, tmp_path, "deep", lambda c: json.dumps({**c, "num_hidden_layers": 10 ** 15}))
    return model, "config.json: num_hidden_layers: 1000000000000000 is not a whole number from 0 to 10000"


def _header_without_shape(tiny_model, tmp_path):
    model = _copy(tiny_model, tmp_path / "noshape")
    blob = (model / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    del header[next(k for k in header if k != "__metadata__")]["shape"]
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))  # the same header length (safetensors pads with spaces): the data stays in place
    (model / "model.safetensors").write_bytes(blob[:8] + new + blob[8 + n:])
    return model, "model.safetensors: tensor '"


def _a_directory_as(name):
    """A model whose ``name`` is a directory where a loader expects a file."""
    def make(tiny_model, tmp_path):
        model = _copy(tiny_model, tmp_path / f"dir-{name}")
        (model / name).unlink()
        (model / name).mkdir()
        return model, f"{name}: is a directory, expected a file"
    return make


BAD_CONFIGS = [_config_not_json, _zero_heads, _absurd_layers, _header_without_shape,
               *map(_a_directory_as, ["config.json", "model.safetensors", "tokenizer.json"])]
BAD_CONFIG_IDS = ["config-not-json", "zero-heads", "1e15-layers", "header-without-shape", "config-json-a-directory",
                  "weights-a-directory", "tokenizer-json-a-directory"]


@pytest.mark.parametrize("make", [_not_a_model, _truncated, _pickle_only, _a_file, *BAD_CONFIGS],
                         ids=["not-a-model", "truncated-safetensors", "pickle-only", "a-file", *BAD_CONFIG_IDS])
def test_a_base_model_that_cannot_be_loaded_is_one_line_naming_it(tmp_path, capfd, tiny_model, make):
    write_sts_data(tmp_path)
    model, fragment = make(tiny_model, tmp_path)
    config = write_config(tmp_path, [STS_SOURCE], evaluate={"base_model": str(model), "tasks": [STS_TASK]})
    result = in_process(capfd, "evaluate", "--config", config)
    result.assert_one_line_error(str(model), fragment)
    assert not (tmp_path / "runs/r/evaluate").exists()


def test_an_evaluated_model_given_on_the_command_line_is_checked_the_same_way(tmp_path, capfd, tiny_model):
    write_sts_data(tmp_path)
    model, fragment = _not_a_model(tiny_model, tmp_path)
    config = write_config(tmp_path, [STS_SOURCE], evaluate={"base_model": str(tiny_model), "tasks": [STS_TASK]})
    in_process(capfd, "evaluate", "--config", config, "--model", model).assert_one_line_error(str(model), fragment)


@pytest.mark.parametrize("make", BAD_CONFIGS, ids=BAD_CONFIG_IDS)
def test_train_and_plan_refuse_a_base_model_with_a_bad_config_the_same_way(tmp_path, capfd, tiny_model, make):
    write_sts_data(tmp_path)
    model, fragment = make(tiny_model, tmp_path)
    stage = {"name": "s1", "steps": 1, "batch_size": {"sts": 2}, "warmup_steps": 0}
    config = write_config(tmp_path, [STS_SOURCE], train={"base_model": str(model), "stages": [stage]})
    in_process(capfd, "plan", "--config", config).assert_one_line_error(str(model), fragment)
    assert in_process(capfd, "prepare", "--config", config).rc == 0
    in_process(capfd, "train", "--config", config).assert_one_line_error(str(model), fragment)
    assert not (tmp_path / "runs/r/train-s1").exists()


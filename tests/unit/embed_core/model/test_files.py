"""check_model_dir: the one check every model loader runs before transformers sees a directory."""

import json
import shutil
import struct

import pytest

from embed_core.model.files import ModelFilesError, check_model_dir, check_safetensors


def test_a_saved_model_passes(tiny_model):
    check_model_dir(tiny_model)


def test_a_safetensors_file_whose_tensors_end_before_or_after_the_file_end_is_damaged(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    good = tmp_path / "good.safetensors"
    good.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    check_safetensors(good)
    for name, blob in [("short", good.read_bytes()[:-1]), ("long", good.read_bytes() + b"\0"),
                       ("tiny", b"\1\2"), ("huge-header", struct.pack("<Q", 1 << 40) + b"{}"),
                       ("not-json", struct.pack("<Q", 4) + b"{{{{")]:
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(blob)
        with pytest.raises(ModelFilesError, match=f"{name}.safetensors: truncated or damaged"):
            check_safetensors(path)


def test_a_shard_named_by_the_index_that_is_missing_is_named(tmp_path, tiny_model):
    model = shutil.copytree(tiny_model, tmp_path / "m")
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelFilesError, match="model-00002-of-00002.safetensors: weight shard named by"):
        check_model_dir(model)


def test_a_directory_with_a_gguf_file_is_left_to_the_gguf_loader(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    check_model_dir(tmp_path)
    check_model_dir(tmp_path / "m.gguf")


def test_a_config_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFilesError, match="no model weights"):
        check_model_dir(tmp_path)

"""check_model_dir: the one check every model loader runs before transformers sees a directory."""

import json
import shutil
import struct

import pytest

from embed_core.model.files import ModelFilesError, check_model_config, check_model_dir, check_safetensors


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


def _with_config(tiny_model, tmp_path, blob: bytes | None = None, **changes):
    """A copy of the tiny model whose config.json is ``blob``, or its own with ``changes``."""
    model = shutil.copytree(tiny_model, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_bytes(blob if blob is not None else json.dumps({**config, **changes}).encode())
    return model


@pytest.mark.parametrize("blob, fragment", [
    (b'{"model_type": "bert", "hidden_size": 32,', "not JSON (Expecting property name enclosed in double quotes"),
    (b"\xff\xfe{}", "not JSON ('utf-8' codec can't decode byte 0xff"),
    (b"[1, 2]", "not a model's config (a JSON list, not an object)"),
], ids=["cut-off", "not-utf8", "a-list"])
def test_a_config_json_that_is_not_a_json_object_is_one_line_naming_the_file(tiny_model, tmp_path, blob, fragment):
    model = _with_config(tiny_model, tmp_path, blob)
    with pytest.raises(ModelFilesError) as refused:
        check_model_dir(model)
    assert str(refused.value).startswith(f"{model / 'config.json'}: {fragment}")


@pytest.mark.parametrize("changes, fragment", [
    ({"num_attention_heads": 0}, "num_attention_heads: 0 is not a whole number from 1 to 1048576"),
    ({"num_hidden_layers": 10 ** 15}, "num_hidden_layers: 1000000000000000 is not a whole number from 0 to 10000"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers: 2.5 is not a whole number from 0 to 10000"),
    ({"hidden_size": True}, "hidden_size: True is not a whole number"),
    ({"num_attention_heads": 64}, "num_attention_heads: 64 attention heads share hidden_size 32: less than one "
     "dimension a head"),
    ({"head_dim": 1 << 20}, "num_attention_heads: 2 attention heads of head_dim 1048576 are 2097152 dimensions a "
     "token, more than 1048576"),
    ({"num_key_value_heads": 3}, "num_key_value_heads: 3 key-value heads do not divide num_attention_heads 2"),
    ({"num_hidden_layers": 10_000, "hidden_size": 1 << 18, "num_attention_heads": 1},
     "num_hidden_layers: 10000 layers of hidden_size 262144 make about 8.2e+15 parameters, more than 1e+13"),
    ({"text_config": {"num_attention_heads": 0}}, "text_config.num_attention_heads: 0 is not a whole number"),
], ids=["zero-heads", "1e15-layers", "fractional-layers", "boolean-width", "more-heads-than-width",
        "absurd-head-product", "kv-not-dividing", "absurd-parameters", "sub-config"])
def test_a_config_with_impossible_sizes_is_one_line_naming_the_file_and_the_field(tiny_model, tmp_path, changes,
                                                                                 fragment):
    model = _with_config(tiny_model, tmp_path, **changes)
    with pytest.raises(ModelFilesError) as refused:
        check_model_dir(model)
    assert str(refused.value).startswith(f"{model / 'config.json'}: {fragment}")
    assert str(refused.value).endswith("; the file is damaged or not a model's config")


def test_the_shapes_real_configs_take_pass_the_size_checks(tiny_model, tmp_path):
    # a head_dim that is not hidden / heads (Gemma), per-layer widths (Gemma-3n), layers per part (LXMERT),
    # GPT-2's null n_inner, a head_dim of 0 that means "derive it" (GLM)
    model = _with_config(tiny_model, tmp_path, num_attention_heads=3, head_dim=256, intermediate_size=[64, 128],
                         num_layers={"language": 9, "vision": 5}, n_inner=None,
                         text_config={"num_hidden_layers": 26, "num_key_value_heads": 1, "head_dim": 0})
    check_model_dir(model)


def test_the_default_config_of_every_transformers_architecture_passes_the_size_checks(tmp_path):
    from transformers import CONFIG_MAPPING

    refused = []
    for name, config_class in CONFIG_MAPPING.items():
        try:
            text = config_class().to_json_string()
        except Exception:  # noqa: BLE001 — a config class that needs arguments (or an extra package) has no default
            continue
        (tmp_path / "config.json").write_text(text)
        try:
            check_model_config(tmp_path / "config.json")
        except ModelFilesError as exc:
            refused.append(f"{name}: {exc}")
    assert not refused, refused


def test_a_safetensors_header_without_a_shape_is_one_line_naming_the_tensor(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "noshape.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ModelFilesError, match=r"noshape.safetensors: tensor 'w': shape None is not a list of sizes"):
        check_safetensors(path)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "vocab.txt", "weights.gguf", "1_Pooling/config.json"])
def test_a_directory_or_fifo_named_as_a_file_a_loader_reads_is_refused_naming_it(tmp_path, tiny_model, name):
    import os

    model = shutil.copytree(tiny_model, tmp_path / "m")
    (model / name).unlink(missing_ok=True)
    (model / name).mkdir(parents=True)
    with pytest.raises(ModelFilesError, match=f"{model / name}: is a directory, expected a file"):
        check_model_dir(model)
    (model / name).rmdir()
    os.mkfifo(model / name)  # a read would wait for a writer forever
    with pytest.raises(ModelFilesError, match=f"{model / name}: is not a regular file"):
        check_model_dir(model)

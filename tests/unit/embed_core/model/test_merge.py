"""Weight averaging (``embed_core.model.merge``): hand-computed values, dtypes kept, and models
that do not average refused with the file and the first weight that differs."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from embed_core.errors import EmbedpipeError
from embed_core.model.merge import WEIGHTS, weighted_average, write_average


def _model(path, **tensors):
    path.mkdir()
    save_file(tensors, str(path / WEIGHTS))
    return path


def test_the_weighted_average_is_the_hand_computed_one_in_the_first_models_dtypes(tmp_path):
    a = _model(tmp_path / "a", w=torch.tensor([1.0, 2.0]), h=torch.tensor([4.0], dtype=torch.bfloat16))
    b = _model(tmp_path / "b", w=torch.tensor([3.0, 6.0]), h=torch.tensor([8.0], dtype=torch.bfloat16))
    out = weighted_average([a, b], [0.75, 0.25])
    assert out["w"].tolist() == [1.5, 3.0]          # 0.75·1 + 0.25·3, 0.75·2 + 0.25·6
    assert out["h"].dtype == torch.bfloat16 and out["h"].tolist() == [5.0]


def test_write_average_replaces_the_weights_of_the_output_model(tmp_path):
    a = _model(tmp_path / "a", w=torch.tensor([0.0, 4.0]))
    b = _model(tmp_path / "b", w=torch.tensor([2.0, 0.0]))
    write_average([a, b], [0.5, 0.5], a)
    assert load_file(str(a / WEIGHTS))["w"].tolist() == [1.0, 2.0]


def test_models_whose_weights_differ_in_names_or_shapes_are_refused_naming_the_weight(tmp_path):
    a = _model(tmp_path / "a", w=torch.zeros(2), v=torch.zeros(1))
    b = _model(tmp_path / "b", w=torch.zeros(3), v=torch.zeros(1))
    c = _model(tmp_path / "c", w=torch.zeros(2), u=torch.zeros(1))
    with pytest.raises(EmbedpipeError, match=r"b/model.safetensors: cannot be averaged .* \(first: w\)"):
        weighted_average([a, b], [0.5, 0.5])
    with pytest.raises(EmbedpipeError, match=r"\(first: u\)"):
        weighted_average([a, c], [0.5, 0.5])


def _sharded(path, seed: int):
    """A tiny Qwen2 saved the way large checkpoints are: model-0000k-of-0000N.safetensors and an index."""
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(seed)
    model = Qwen2Model(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(path, max_shard_size="20KB")
    return path, model.state_dict()


def test_models_in_sharded_safetensors_average_tensor_by_tensor_and_keep_their_layout(tmp_path):
    from transformers import AutoModel

    from embed_core.model.merge import INDEX

    (a, sa), (b, sb) = _sharded(tmp_path / "a", 0), _sharded(tmp_path / "b", 1)
    shards = sorted(p.name for p in a.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (a / INDEX).is_file() and not (a / WEIGHTS).exists()
    write_average([a, b], [0.75, 0.25], a)  # into the first model, as a stage's merge does
    assert sorted(p.name for p in a.glob("*.safetensors")) == shards  # same shards, no stray model.safetensors
    merged = AutoModel.from_pretrained(a).state_dict()
    for name in sa:
        assert torch.allclose(merged[name], 0.75 * sa[name] + 0.25 * sb[name], atol=1e-6), name


def test_a_sharded_model_and_one_whose_weights_differ_are_refused_naming_the_index(tmp_path):
    (a, _), c = _sharded(tmp_path / "a", 0), _model(tmp_path / "c", w=torch.zeros(2))
    with pytest.raises(EmbedpipeError, match=r"c/model.safetensors: cannot be averaged with .*a/model.safetensors"
                                             r".index.json: the weights differ"):
        weighted_average([a, c], [0.5, 0.5])

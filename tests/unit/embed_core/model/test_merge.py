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

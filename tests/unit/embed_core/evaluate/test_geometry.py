"""Token-geometry measures (CoDiEmb §4) on matrices whose values are known."""

import math

import pytest
import torch

from embed_core.evaluate.geometry import matrix_geometry, model_geometry


def test_measures_of_known_matrices():
    # orthogonal rows of different norms: similarity 0, full rank, κ = 3/1, entropy of (9, 1)/10
    g = matrix_geometry(torch.tensor([[3.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    assert g["token_similarity"] == pytest.approx(0.0)
    assert g["rank"] == 2
    assert g["condition_number"] == pytest.approx(3.0)
    assert g["svd_entropy"] == pytest.approx(-(0.9 * math.log(0.9) + 0.1 * math.log(0.1)))
    # identical rows: similarity 100, rank 1, one singular value carries everything, κ infinite
    g = matrix_geometry(torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]))
    assert g["token_similarity"] == pytest.approx(100.0)
    assert g["rank"] == 1 and g["svd_entropy"] == pytest.approx(0.0, abs=1e-9)
    assert g["condition_number"] > 1e12
    # token similarity is the mean over ordered pairs i != j
    x = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    c = 1 / math.sqrt(2)
    assert matrix_geometry(x)["token_similarity"] == pytest.approx(100 * (2 * c + 0 + 2 * c) / 6)


def test_model_geometry_averages_over_texts(tmp_path):
    from tests.helpers.tiny_model import build_tiny_bert

    path = build_tiny_bert(tmp_path / "tiny")
    out = model_geometry(str(path), ["a man is playing a guitar", "two dogs run on the beach", "x"], max_length=16)
    assert out["texts"] == 2  # "x" has one token once [CLS]/[SEP] are left out
    assert 0 < out["rank"] <= 6 and out["svd_entropy"] > 0 and -100 <= out["token_similarity"] <= 100

"""The training precision reaches what a GPU run does besides the step: dev evaluation encodes under
the same bf16 autocast as training (not fp32 GEMMs), and ``train.tf32`` turns on TF32 matrix
products for fp32 compute on CUDA only."""

import numpy as np
import pytest
import torch

from embed_core.model.embedder import Embedder
from embed_core.model.encoder import use_tf32
from embed_core.model.settings import ModelSettings


@pytest.mark.parametrize("bf16", [True, False])
def test_dev_evaluation_encodes_under_the_training_precision(tiny_model, bf16):
    from embed_core.train.dev import LiveModel

    embedder = Embedder(str(tiny_model), pooling="mean").eval()
    seen = []
    embedder.model.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    out = LiveModel(embedder, ModelSettings(), batch_size=2, bf16=bf16)._encode_texts(["a b c", "d e", "f"])
    assert out.dtype == np.float32 and out.shape == (3, embedder.dim)
    assert seen == [bf16, bf16]


def test_tf32_is_turned_on_for_cuda_only_and_only_when_asked():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        use_tf32(True, "cpu")
        use_tf32(False, "cuda")
        assert torch.get_float32_matmul_precision() == "highest"
        use_tf32(True, "cuda")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)

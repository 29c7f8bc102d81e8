"""The FSDP checkpoint index (DCP's ``.metadata``, a pickle) is read with an unpickler that accepts
DCP's metadata classes and the torch values they hold, and refuses anything else, so a run directory
from someone else cannot run code on resume."""

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint

from embed_core.train.engine.sharding import _MetadataUnpickler, layer_class_names


def test_a_checkpoint_index_written_by_dcp_reads_back(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        dcp.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "s": torch.tensor(3)},
                 checkpoint_id=str(tmp_path))
    finally:
        torch.distributed.destroy_process_group()
    metadata = _MetadataUnpickler(io.BytesIO((tmp_path / ".metadata").read_bytes())).load()
    assert set(metadata.state_dict_metadata) == {"w", "s"}
    assert metadata.state_dict_metadata["w"].size == torch.Size([2, 3])


@pytest.mark.parametrize("payload", [os.system, eval, torch.load, Path.write_text,
                                     torch.distributed.checkpoint.FileSystemWriter])
def test_a_checkpoint_index_referencing_anything_else_is_refused(payload):
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(payload))).load()


def test_the_layers_sharded_one_by_one_are_the_models_own_no_split_modules(tmp_path):
    from tests.helpers.tiny_model import build_tiny_decoder
    from embed_core.model.embedder import Embedder

    m = Embedder(str(build_tiny_decoder(tmp_path / "q", "qwen3")))
    assert layer_class_names(m) == {"Qwen3DecoderLayer"}

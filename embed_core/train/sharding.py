"""``train.sharding: fsdp``: weights, gradients and optimizer state sharded over the processes with
torch FSDP2 (``torch.distributed.fsdp.fully_shard``), and the checkpoints that go with it
(``torch.distributed.checkpoint``, one shard per rank).

* one FSDP unit per transformer layer (the classes a Hugging Face model names in
  ``_no_split_modules``) and one for the root (embeddings, final norm, loss heads): a layer's full
  weights exist only while it computes;
* ``MixedPrecisionPolicy``: bf16 compute under bf16 precision, gradients reduced in fp32, the
  sharded weights and AdamW state fp32 (master weights);
* GradCache and gradient accumulation run several backward passes per optimizer step: by default
  each reduce-scatters its gradients (summed shards equal the shard of the sum), so no rank ever
  holds a whole gradient; ``train.fsdp_sync: step`` defers that to the step's last backward
  (``set_requires_gradient_sync``): fewer collectives, but until then every rank holds an unsharded
  fp32 gradient (FSDP2 accumulates in ``reduce_dtype``), 4 bytes per parameter;
* checkpoints hold tensors only: the optimizer's hyper-parameters travel as JSON, and the
  checkpoint's index (``.metadata``, a pickle in DCP's format) is read with an unpickler that
  accepts DCP's own metadata classes and nothing else (run directories travel between people);
* the committed model is consolidated once: ``full_state_dict`` gathers it to rank 0's CPU.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn


def layer_class_names(model: nn.Module) -> set[str]:
    """Transformer-layer classes of every Hugging Face model inside ``model`` (``_no_split_modules``)."""
    names: set[str] = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or ())
    return names


def shard(model: nn.Module, *, bf16: bool) -> nn.Module:
    """``fully_shard`` every transformer layer, then the root, on the default process group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    names = layer_class_names(model)
    layers = [m for m in model.modules() if type(m).__name__ in names]
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gradient_sync(model: nn.Module, on: bool) -> None:
    """Reduce-scatter gradients in the coming backward passes (``on``) or keep accumulating them
    unsharded (a step's earlier backward passes)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(on)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU (every rank must call it; the others get ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[dict[str, Any]]:
    """Every rank writes its shard of the model (and optimizer state) under ``path``; returns the
    optimizer's parameter groups (plain data, for the caller's JSON)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(path))
        return []
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state["state"]}, checkpoint_id=str(path))
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in optim_state["param_groups"]]


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         param_groups: list[dict[str, Any]] | None = None) -> None:
    """Read what ``save`` wrote back into ``model`` (and ``optimizer``), each rank its own shard."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    reader = SafeReader(str(path))
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, storage_reader=reader)
        set_model_state_dict(model, state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state["state"]}
    dcp.load(state, storage_reader=reader)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in param_groups or []]
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"], "param_groups": groups})


# What a DCP index may reference: DCP's metadata classes (classes only: no function of those modules
# is callable from the file) and the torch / stdlib values they hold.
_CLASS_MODULES = ("torch.distributed.checkpoint.metadata",)  # plain data classes
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _CLASS_MODULES or module in {m for m, _ in _ALLOWED} or module == "torch":
            found = super().find_class(module, name)  # looking a name up runs nothing
            if (module, name) in _ALLOWED or (module in _CLASS_MODULES and isinstance(found, type)) or \
                    (module == "torch" and isinstance(found, (torch.dtype, torch.memory_format, torch.layout))):
                return found
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        """DCP's file reader, its index read with ``_MetadataUnpickler``."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader


def SafeReader(path: str):  # noqa: N802 (a class built on first use: DCP is imported lazily)
    return _reader_class()(path)

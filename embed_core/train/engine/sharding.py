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
* the committed model is consolidated once: ``full_state_dict`` gathers it to rank 0's CPU;
* loading (``load_sharded``, as torchtune's and NeMo AutoModel's FSDP2 recipes do): rank 0 alone
  reads the checkpoint (on its CPU, in the checkpoint's dtype); every other rank builds the model on
  the meta device. Every rank shards the meta model, allocates only its own shards on its device
  (``to_empty``), and rank 0 broadcasts the weights tensor by tensor, each rank keeping its slice
  (``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``); the non-persistent
  buffers (rotary ``inv_freq``, which no state dict holds) are rank 0's, broadcast too. No rank ever
  holds the whole model on its device, and only one reads it from disk;
* the mesh: 1-D over every rank (``flat``), or across nodes ``hybrid`` (HSDP): a ``(nodes, local
  ranks)`` mesh, weights sharded over a node's ranks and replicated across nodes, so the per-pass
  all-gathers stay on the node's NVLink and only the gradient all-reduce crosses nodes
  (``train.fsdp_mesh``, ``TrainConfig.fsdp_mesh_shape``);
* DCP writes with several threads per rank (``SAVE_THREADS``).
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


SAVE_THREADS = 4  # DCP's writer threads per rank (FileSystemWriter(thread_count=...))


def mixed_precision(bf16: bool):
    """FSDP2's policy: bf16 compute under bf16 precision (fp32 otherwise), gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)


def shard(model: nn.Module, *, bf16: bool, mesh=None) -> nn.Module:
    """``fully_shard`` every transformer layer, then the root, on ``mesh`` (a ``DeviceMesh``: 1-D,
    or 2-D ``("replicate", "shard")`` for HSDP), by default the whole default process group."""
    from torch.distributed.fsdp import fully_shard

    options = {"mp_policy": mixed_precision(bf16), **({"mesh": mesh} if mesh is not None else {})}
    names = layer_class_names(model)
    layers = [m for m in model.modules() if type(m).__name__ in names]
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def device_mesh(shape: tuple[int, ...], device_type: str):
    """The mesh ``fully_shard`` shards over: None for a 1-D mesh (FSDP2's default, the whole world),
    else ``init_device_mesh(device_type, (replicas, shards), ("replicate", "shard"))``."""
    if len(shape) == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def mesh_for(train, world: int, device_type: str):
    """The mesh ``train.fsdp_mesh`` asks for over ``world`` ranks, this node's ranks from the
    launcher (``world.local_world_size``): None (flat) or a 2-D replicate × shard ``DeviceMesh``."""
    from embed_core.dist.world import local_world_size

    return device_mesh(train.fsdp_mesh_shape(world, local_world_size(world)), device_type)


def load_sharded(model: nn.Module, *, device: torch.device, bf16: bool, mesh=None, rank: int,
                 stored=None) -> nn.Module:
    """``model`` sharded onto ``device`` without any rank holding all of it there (the module
    docstring): on rank 0 ``model`` holds the checkpoint's weights (on the CPU), on the other ranks
    it was built on the meta device. ``stored``: sets the parameters' dtypes (on meta, free) before
    sharding (the trainer's fp32 master weights); the broadcast copies rank 0's tensors into them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    persistent = set(model.state_dict())
    full = {k: v.detach() for k, v in model.state_dict().items()} if rank == 0 else {}
    buffers = {n: b.detach() for n, b in model.named_buffers() if n not in persistent}
    model.to("meta")  # rank 0's weights now live only in `full` (its CPU, the checkpoint's dtype)
    if stored is not None:
        stored(model)
    shard(model, bf16=bf16, mesh=mesh)
    model.to_empty(device=device)  # this rank's shards (and the buffers), uninitialised
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    with torch.no_grad():
        for name, value in buffers.items():  # rotary inv_freq & co.: rank 0 computed them at build
            buffer = model.get_buffer(name)
            if rank == 0:
                buffer.copy_(value)
            torch.distributed.broadcast(buffer, src=0)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gradient_sync(model: nn.Module, on: bool) -> None:
    """Reduce-scatter gradients in the coming backward passes (``on``) or keep accumulating them
    unsharded (a step's earlier backward passes)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(on)


def full_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU (every rank must call it; the others get ``{}``),
    gathered one tensor at a time and its floating tensors cast to ``dtype`` as they arrive, so rank
    0's host holds the model once, in ``dtype`` (bf16: half the fp32 bytes)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    rank = torch.distributed.get_rank()
    out: dict[str, torch.Tensor] = {}
    for name, value in get_model_state_dict(model).items():  # this rank's shards: nothing gathered yet
        whole = value.full_tensor() if isinstance(value, DTensor) else value  # a collective: every rank
        if rank == 0:
            cast = dtype if dtype is not None and whole.is_floating_point() else whole.dtype
            out[name] = whole.detach().to(device="cpu", dtype=cast)
        del whole
    return out


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[dict[str, Any]]:
    """Every rank writes its shard of the model (and optimizer state) under ``path``; returns the
    optimizer's parameter groups (plain data, for the caller's JSON)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    writer = dcp.FileSystemWriter(str(path), thread_count=SAVE_THREADS)
    if optimizer is None:
        dcp.save({"model": get_model_state_dict(model)}, storage_writer=writer)
        return []
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state["state"]}, storage_writer=writer)
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

"""``embedpipe plan``: the memory each train stage needs per GPU, worked out from the config and
the model's shapes alone (its ``config.json`` and the safetensors headers: no weights are loaded),
before any GPU is rented.

Bytes per rank (N ranks, P parameters, P_t of them trained, P_f frozen):

* weights: trained ones fp32 (master copy), frozen ones (a LoRA base) fp32 or bf16
  (``weights_dtype``): ``4·P_t + (4|2)·P_f``; ``sharding: fsdp`` keeps 1/N of every tensor (dim 0
  padded to a multiple of N, as DTensor shards it), N the shard degree: every rank on a flat mesh,
  a node's ranks on a hybrid one (``train.fsdp_mesh``: HSDP replicates across nodes; the
  gradients and AdamW state divide by the same N);
* gradients: ``4·P_t`` (fp32); fsdp: 1/N (``fsdp_sync: step`` adds a whole unsharded ``4·P_t``);
  DeepSpeed ZeRO-2: 1/N;
* AdamW: two fp32 moments, ``8·P_t``; fsdp and ZeRO-1/2: 1/N. Parameters the loss never reaches
  (BERT's pooler) get neither;
* activations of one pass (``B`` texts of ``s`` tokens, every text at its group's max length:
  packing and length buckets save only padding, which this worst case has none of), with ``e`` the
  compute bytes (4 fp32, 2 under bf16 autocast), ``m`` a dropout mask's bytes (1: CUDA's dropout and
  the trainer's CPU dropout, ``embed_core.model.bulk_dropout``, keep a byte an element; eager
  attention's on the CPU ``e``),
  q = heads·head_dim, kv = kv heads·head_dim, h hidden, i intermediate, per layer and token::

      norms           n_norm · h · (8 RMSNorm: input and normalised, fp32 | 4 LayerNorm: input)
      linear inputs   2h·e (attention's and the MLP's input) | under autocast with fp32 weights each
                      linear casts its own copy: (n_attn_in + n_mlp_in)·h·2 (q,k,v = 3; gate,up = 2)
      q/k norms       (q + kv)·(4 + e)                  (Qwen3, Gemma-3)
      attention       4q·e   (q, k and v repeated to every query head, output)
      MLP             4i·e gated (act input, act output, up, down input) | 2i·e plain
      dropout         2h·m   when hidden dropout > 0 (BERT)

  plus per layer and sequence ``heads·s²`` elements: eager attention ``e`` (its softmax) and with
  attention dropout ``m + e`` more; SDPA nothing (flash / memory-efficient kernels), except on a
  CPU with attention dropout (the trainer's bulk-dropout attention: the fp32 probabilities and
  the mask, ``4 + m``; its q, k and v in fp32, ``12q + q·e`` in place of ``4q·e`` above). Outside
  the layers ``8 + 16h`` bytes per token (ids, embedding output, final norm, last hidden state)
  and a ``B·s²·e`` attention mask per pass. Gradient checkpointing keeps only each layer's input,
  ``4h`` per token per layer, and recomputes one layer at a time. Under autocast every graph also
  holds bf16 copies of the fp32 linear weights, ``2·P_linear``;
* transients: the backward pass's working buffers, one layer's weight gradients plus
  ``s·B·(i·e + 4h)``; a dense embedding backward makes a whole table's gradient
  (``4·vocab·h``) before adding it into the one already there; the loss's similarity matrices
  (logits, log-softmax, gradient: ``3·4·rows·cols``; retrieval gathers every rank's queries and
  documents); GradCache's cached embeddings and their gradients; under fsdp the gathered layers
  in compute dtype (the root unit, embeddings included, stays gathered through forward and
  backward; two layers at a time with prefetch) and one layer's unsharded gradient.

The peak is the most that is alive at once, not the sum: weights and AdamW throughout; gradients
appear in the backward pass while the activations are freed, group by group (the last embedded
group is backpropagated first), so without GradCache the peak is
``W + O + max_k(Σ_{j≥k} A_j + [k>1]·G + X, Σ_{j>k} A_j + G + [k>1]·E)`` over the text groups in
backward order; with GradCache every chunk after the first runs with all gradients allocated,
``W + O + G + A_chunk + X + E``; the optimizer step holds ``W + G + O``; under fsdp loading holds
a rank's shards and the one whole tensor being broadcast from rank 0 (the model is sharded on the
meta device; rank 0 reads the checkpoint into its host memory, not onto the GPU).

Disk: a resumable checkpoint (all ranks' files) is every weight in its stored dtype plus AdamW's
two fp32 moments per trained one; the committed model is every weight in ``train.save_dtype``. ``tests/unit/embed_core/train/test_plan.py``
checks the plan against the allocator's measured peak on CPU (within 25 %); docs/experiments.md
has the figures.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from embed_core.errors import ConfigError
from embed_core.train.config import TrainConfig, TrainStageConfig
from embed_core.train.modes import mode_of

GiB = 2 ** 30
# Kept free on a GPU of --gpu-memory GiB: the CUDA context, cuBLAS/NCCL workspaces and the caching
# allocator's fragmentation, none of which torch.cuda.max_memory_allocated counts.
HEADROOM = 0.10
MAX_GPU_GIB = 1 << 20  # 1 PiB: --gpu-memory above it is a typo (and past ~1e299 GiB its bytes overflow a float)
BIG = 1 << 20  # the largest batch size searched for
POST_HEADS = ("lm_head.", "cls.", "score.", "classifier.", "qa_outputs.")  # heads AutoModel does not load
LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")


class DoesNotFit(ConfigError):
    """A train stage needs more memory per GPU than ``--gpu-memory`` gives."""


# -- the model's shapes -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its config's sizes and every parameter's shape (AutoModel's
    parameters: a causal LM's head is left out, as ``Embedder`` loads the bare model)."""

    name: str
    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_dropout: float
    attention_dropout: float
    attention: str  # sdpa | eager | flash_attention_2 ...
    params: dict[str, tuple[int, ...]] = field(repr=False)

    def _layer0(self) -> list[str]:
        return [n for n in self.params if (m := LAYER_INDEX.search(n)) and m.group(1) == "0"]

    @property
    def layer_norm(self) -> bool:
        """LayerNorm (has biases) rather than RMSNorm."""
        return any("norm" in n.lower() and n.endswith(".bias") for n in self._layer0())

    @property
    def norms(self) -> int:
        """Norms per layer (their weights, q/k norms left out)."""
        return sum(1 for n in self._layer0() if "norm" in n.lower() and n.endswith(".weight")
                   and not re.search(r"[qk]_norm", n))

    @property
    def qk_norm(self) -> bool:
        return any(re.search(r"[qk]_norm", n) for n in self._layer0())

    @property
    def gated(self) -> bool:
        return any("gate" in n for n in self._layer0())

    @property
    def fused_qkv(self) -> bool:
        return any(re.search(r"qkv|query_key_value|c_attn", n) for n in self._layer0())

    def numel(self, names: list[str] | None = None) -> int:
        return sum(math.prod(self.params[n]) for n in (self.params if names is None else names))

    @property
    def embeddings(self) -> list[str]:
        return [n for n, s in self.params.items() if len(s) == 2 and "embed" in n.lower()]

    @property
    def linears(self) -> list[str]:
        """2-D weights outside the embeddings: the linear layers (LoRA's all-linear targets)."""
        return [n for n, s in self.params.items() if len(s) == 2 and n.endswith(".weight") and "embed" not in n.lower()]

    def layer_numels(self) -> list[int]:
        sizes: dict[str, int] = {}
        for n, s in self.params.items():
            if m := LAYER_INDEX.search(n):
                sizes[m.group(1)] = sizes.get(m.group(1), 0) + math.prod(s)
        return list(sizes.values()) or [0]

    def no_gradient(self) -> list[str]:
        """Parameters the embedding never depends on (BERT's pooler): no gradient, no AdamW state."""
        return [n for n in self.params if n.startswith("pooler.")]


def safetensors_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers of the files the model loads (a file's
    first 8 bytes give its JSON header's length): exact, and nothing but the headers is read
    (``resolve_model_path`` has checked that the files are whole)."""
    from embed_core.model.files import safetensors_files

    shapes: dict[str, tuple[int, ...]] = {}
    for path in safetensors_files(directory):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def model_shape(base_model: str, gguf_file: str | None = None) -> ModelShape:
    """The model's sizes (``AutoConfig``) and parameter shapes (safetensors headers), without its weights."""
    from transformers import AutoConfig

    from embed_core.model.encoder import resolve_model_path

    path = Path(resolve_model_path(base_model))
    config = AutoConfig.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
    shapes = {k: v for k, v in safetensors_shapes(path).items() if not k.startswith(POST_HEADS)}
    layered = [k for k in shapes if LAYER_INDEX.search(k)]
    prefix = next((p for p in ("model.", "bert.", "roberta.", "transformer.")
                   if layered and all(k.startswith(p) for k in layered)), "")
    if prefix:  # a task model's checkpoint: AutoModel keeps the base model's weights, named without it
        shapes = {k.removeprefix(prefix): v for k, v in shapes.items() if k.startswith(prefix)}
    return shape_of(str(base_model), config, shapes)


def shape_of(name: str, config: Any, shapes: dict[str, tuple[int, ...]]) -> ModelShape:
    """A ``ModelShape`` from a model's config and its parameters' shapes (a checkpoint's headers, or
    ``named_parameters()`` of a model built on the meta device)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return ModelShape(
        name=name, model_type=str(text.model_type), layers=int(text.num_hidden_layers),
        hidden=int(text.hidden_size), intermediate=int(getattr(text, "intermediate_size", 4 * text.hidden_size)),
        heads=heads, kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
        hidden_dropout=float(getattr(text, "hidden_dropout_prob", 0.0) or 0.0),
        attention_dropout=float(getattr(text, "attention_probs_dropout_prob", None)
                                or getattr(text, "attention_dropout", 0.0) or 0.0),
        attention=str(getattr(text, "_attn_implementation", None) or "sdpa"), params=shapes)


# -- activations ------------------------------------------------------------------------------------
# ``m``: a dropout mask's bytes per element. CUDA's dropout and the trainer's CPU dropout
# (embed_core.model.bulk_dropout) keep one byte an element; only transformers' eager attention on the
# CPU, which the trainer leaves as it is, keeps torch's float mask
MASK_BYTES = 1


@dataclass(frozen=True)
class Compute:
    """How a pass computes: bytes per activation element, and whether autocast casts each
    linear's input (and holds bf16 copies of fp32 weights)."""

    e: int
    casts: bool
    checkpointing: bool
    device: str
    frozen: bool = False  # a frozen base (LoRA)
    adapters: int = 0  # LoRA: the adapted layers' inputs (with dropout a copy and mask each), bytes per token·layer


def layer_bytes_per_token(shape: ModelShape, c: Compute) -> int:
    """Saved-for-backward bytes per token of one transformer layer (the module docstring's table).
    A frozen base (LoRA) saves no input only its weights' gradients would need: a norm keeps its
    input alone, a linear layer's input is kept by its adapter (``Compute.adapters``)."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = shape.norms * h * (4 if shape.layer_norm or c.frozen else 8)
    if c.frozen:
        inputs = c.adapters
    elif c.casts:
        inputs = ((1 if shape.fused_qkv else 3) + (2 if shape.gated else 1)) * h * 2
    else:
        inputs = 2 * h * c.e
    qk = (q + kv) * (4 + (0 if c.frozen else c.e)) if shape.qk_norm else 0
    mlp = ((4 if shape.gated else 2) - (1 if c.frozen else 0)) * i * c.e
    dropout = 2 * h * MASK_BYTES if shape.hidden_dropout > 0 else 0
    attention = 3 * q * 4 + q * c.e if bulk_attention(shape, c) else 4 * q * c.e  # (its q, k, v in fp32)
    return norms + inputs + qk + attention + mlp + dropout


def bulk_attention(shape: ModelShape, c: Compute) -> bool:
    """Whether the trainer computes this model's attention with ``embed_core.model.bulk_dropout.attention``
    (training on the CPU with attention dropout, SDPA loaded, as many key/value heads as query heads)."""
    return c.device == "cpu" and shape.attention_dropout > 0 and shape.attention == "sdpa" \
        and shape.kv_heads == shape.heads


def scores_bytes_per_layer(shape: ModelShape, c: Compute, s: int) -> int:
    """Bytes per sequence and layer that grow with s² (attention scores kept for backward)."""
    if shape.attention == "eager":  # transformers' eager attention keeps torch's dropout: a float mask on the CPU
        torch_mask = MASK_BYTES if c.device == "cuda" else c.e
        per = c.e + (torch_mask + c.e if shape.attention_dropout > 0 else 0)
    elif bulk_attention(shape, c):  # its fp32 probabilities and the mask
        per = 4 + MASK_BYTES
    else:
        per = 0
    return shape.heads * s * s * per


def pass_bytes(shape: ModelShape, c: Compute, texts: int, s: int) -> tuple[int, int]:
    """(activations kept for backward, the backward pass's activation-gradient buffers) of one pass
    over ``texts`` texts of ``s`` tokens (weight gradients are the caller's: ``States.layer_grad``)."""
    tokens = texts * s
    layer = tokens * layer_bytes_per_token(shape, c) + texts * scores_bytes_per_layer(shape, c, s)
    outside = tokens * (8 + 16 * shape.hidden) + texts * s * s * c.e
    working = tokens * (shape.intermediate * c.e + 4 * shape.hidden)
    if c.checkpointing:
        return shape.layers * tokens * 4 * shape.hidden + outside, working + layer
    return shape.layers * layer + outside, working


# -- a stage's batches --------------------------------------------------------------------------------
def task_groups(stage: TrainStageConfig, task: str, batch: int) -> list[tuple[str, int, int]]:
    """(group, texts, max length) one rank embeds for a batch of ``task``, in embedding order: the
    batch layout ``build_batch`` fills (``embed_core.train.engine.batches.batch_layout``), worst case."""
    from embed_core.train.engine.batches import batch_layout

    layout, positives = _layout(task, json.dumps(stage.losses.get(task), sort_keys=True))
    shape = batch_layout(task, layout, num_negatives=stage.num_hard_negatives, num_positives=positives,
                         query_max_length=stage.query_max_length, passage_max_length=stage.passage_max_length)
    return [(name, batch * g.per_record, g.max_length) for name, g in shape.items()]


@functools.lru_cache(maxsize=None)
def _layout(task: str, spec: str) -> tuple[str, int]:
    """(batch layout, positives per query) of the loss a stage trains ``task`` with."""
    from embed_core.losses import loss_for

    loss = loss_for(task, json.loads(spec))
    return loss.layout, int(loss.batch_options().get("num_positives", 1))


def chunk_texts(stage: TrainStageConfig, texts: int, s: int) -> int:
    """Texts in GradCache's largest chunk of a group of ``texts`` texts of ``s`` tokens
    (``Passes.chunks``, through the stage's ``chunk_capacity``)."""
    return min(texts, stage.chunk_capacity(s))


def loss_bytes(task: str, groups: list[tuple[str, int, int]], world: int, dim: int, cached: bool) -> int:
    """The loss's similarity matrices (logits, log-softmax, gradient; fp32) and GradCache's cached
    embeddings with their gradients. Retrieval gathers every rank's texts; other tasks stay local."""
    ranks = world if task == "retrieval" else 1
    rows = groups[0][1] * ranks
    cols = sum(n for _, n, _ in groups) * ranks  # documents plus the query–query term
    return 3 * 4 * rows * cols + (2 * 4 * dim * sum(n for _, n, _ in groups) if cached else 0)


# -- weights, gradients, optimizer state ------------------------------------------------------------
@dataclass(frozen=True)
class States:
    """Bytes per rank of what lives through a step, and the step's state-related transients."""

    weights: int
    gradients: int
    optimizer: int
    embedding_grad: int  # E: a table's (or, under fsdp, the root unit's) gradient made by one backward
    layer_grad: int  # one layer's weight gradients as the backward pass makes them
    gathered: int  # fsdp: gathered (unsharded) parameters during forward and backward
    load: int  # right after loading, before sharding
    trained: int  # trained parameters (count)
    linear_copies: int  # bf16 copies of fp32 linear weights under autocast (per graph)


def _shard(shapes: list[tuple[int, ...]], nbytes: int, world: int) -> int:
    """Bytes of one rank's shards: dim 0 padded to a multiple of ``world`` (FSDP2's DTensor)."""
    return sum(math.ceil(s[0] / world) * math.prod(s[1:]) * nbytes for s in shapes if s)


def lora_targets(shape: ModelShape, targets: list[str] | str) -> list[str]:
    """The linear weights peft puts adapters on: all-linear, a list of module-name suffixes, or a regex."""
    modules = {n.removesuffix(".weight"): n for n in shape.linears}
    if targets == "all-linear":
        return list(modules.values())
    if isinstance(targets, str):
        return [w for m, w in modules.items() if re.fullmatch(targets, m)]
    return [w for m, w in modules.items() if any(m == t or m.endswith("." + t) for t in targets)]


def shard_degree(train: TrainConfig, world: int, local: int | None = None) -> int:
    """Ranks each tensor is sharded over: 1 without fsdp; under fsdp the last dimension of the mesh
    (``TrainConfig.fsdp_mesh_shape``): every rank (flat), a node's ``local`` ranks (hybrid)."""
    if train.backend_name() != "fsdp" or world < 2:
        return 1
    return train.fsdp_mesh_shape(world, local or world)[-1]


def states(shape: ModelShape, train: TrainConfig, world: int, bf16: bool, local: int | None = None) -> States:
    """The module docstring's weights, gradients and AdamW bytes under LoRA, fsdp and DeepSpeed
    (``local``: ranks per node, for a hybrid fsdp mesh; default one node)."""
    n = shard_degree(train, world, local)
    fsdp = n > 1
    frozen_bytes = 2 if train.weights_dtype == "bf16" and train.lora else 4
    if train.lora:
        r = train.lora.r
        trained = [s for w in lora_targets(shape, train.lora.target_modules)
                   for s in ((r, shape.params[w][1]), (shape.params[w][0], r))]
        frozen = list(shape.params.values())
        with_grad = trained
    else:
        trained, frozen = list(shape.params.values()), []
        with_grad = [s for k, s in shape.params.items() if k not in shape.no_gradient()]
    weights = _shard(trained, 4, n) + _shard(frozen, frozen_bytes, n)
    grads, adamw = _shard(with_grad, 4, n), _shard(with_grad, 8, n)
    if train.backend_name() == "deepspeed" and world > 1:
        stage = train._zero_stage() or 0
        adamw = adamw // world if stage >= 1 else adamw
        grads = grads // world if stage >= 2 else grads
    if fsdp and train.fsdp_sync == "step":
        grads += _shard(with_grad, 4, 1)
    layer = max(shape.layer_numels())
    table = 0 if train.lora else 4 * sum(shape.numel([t]) for t in shape.embeddings)
    compute = 2 if bf16 else 4
    gathered, layer_grad = 0, layer * 4 if not train.lora else 0
    if fsdp:  # the root unit stays gathered through forward and backward; two layers with prefetch
        root = shape.numel() - sum(shape.layer_numels())
        gathered = (root + 2 * layer) * (compute if not train.lora else frozen_bytes)
        layer_grad = 0 if train.lora else layer * (compute + 4)  # in compute dtype, then fp32 to reduce
        table = 0 if train.lora else root * (compute + 4)
    largest = max((math.prod(s) for s in trained + frozen), default=0) * 4  # broadcast whole, then sliced
    casts = bf16 and not fsdp and frozen_bytes == 4
    return States(weights=weights, gradients=grads, optimizer=adamw, embedding_grad=table, layer_grad=layer_grad,
                  gathered=gathered, load=weights + largest if fsdp else weights,
                  trained=sum(math.prod(s) for s in trained),
                  linear_copies=2 * shape.numel(shape.linears) if casts else 0)


def checkpoint_bytes(shape: ModelShape, train: TrainConfig) -> int:
    """Bytes of one resumable checkpoint, all ranks' files together (the same whatever the mesh):
    every weight in its stored dtype and AdamW's two fp32 moments per trained weight
    (``embed_core.train.engine.trainer.checkpoint_bytes`` counts the same on the live model)."""
    st = states(shape, train, 1, False)
    return st.weights + st.optimizer


def committed_bytes(shape: ModelShape, train: TrainConfig) -> int:
    """Bytes of the committed model's weights: every weight in ``train.save_dtype`` (auto: bf16 for a
    decoder LM; a LoRA model's merged weights fp32)."""
    from embed_core.model.files import is_decoder_type

    bf16 = not train.lora and (train.save_dtype == "bf16" or (train.save_dtype == "auto"
                                                              and is_decoder_type(shape.model_type)))
    return shape.numel() * (2 if bf16 else 4)


# -- one task's batch, one stage, the config -------------------------------------------------------
@dataclass
class TaskPlan:
    """Bytes per rank for a batch of one task; ``at_peak``: what is alive at the peak (sums to it)."""

    task: str
    batch: int  # records per rank
    texts: int  # texts per rank and batch
    chunk: list[int] | None  # GradCache's largest chunk: [texts, tokens per text]
    weights: int
    gradients: int
    optimizer: int
    activations: int  # kept for backward at once: every group's, or GradCache's largest chunk's
    peak: int
    phase: str  # what the peak is: backward, loss, optimizer step, loading
    at_peak: dict[str, int]


def _compute(shape: ModelShape, train: TrainConfig, stage: TrainStageConfig, bf16: bool, device: str,
             fsdp: bool) -> Compute:
    e = 2 if bf16 else 4
    adapters = 0
    if train.lora:
        layer0 = [w for w in lora_targets(shape, train.lora.target_modules) if (m := LAYER_INDEX.search(w))
                  and m.group(1) == "0"]
        if train.lora.dropout > 0:  # each adapter's dropout makes its own copy (and mask) of the input
            adapters = sum(shape.params[w][1] for w in layer0) * (e + MASK_BYTES)
        else:  # adapters of one block on inputs of one width share them (q, k, v; gate, up)
            block = {("attn" if re.search(r"attn|attention", w) else "mlp", shape.params[w][1]) for w in layer0}
            adapters = sum(width for _, width in block) * e
    frozen_bf16 = bool(train.lora) and train.weights_dtype == "bf16"
    return Compute(e=e, casts=bf16 and not fsdp and not frozen_bf16,
                   checkpointing=stage.gradient_checkpointing, device=device, frozen=bool(train.lora),
                   adapters=adapters)


def _backward_peak(passes: list[tuple[int, int]], st: States, grads_before: bool, loss: int) -> dict[str, int]:
    """The most alive during one backward over graphs held at once (``passes``: (activations,
    working set) in embedding order; the last is backpropagated first), weights and AdamW aside."""
    order = list(reversed(passes))
    best: dict[str, int] = {}
    for k, (a, x) in enumerate(order):
        rest = sum(p[0] for p in order[k:])
        had = k > 0 or grads_before
        start = {"gradients": st.gradients if had else 0, "activations": rest,
                 "other": x + st.layer_grad + (loss if k == 0 else 0)}
        end = {"gradients": st.gradients, "activations": rest - a, "other": st.embedding_grad if had else 0}
        best = max(best, start, end, key=lambda d: sum(d.values()))
    return best


def plan_task(shape: ModelShape, train: TrainConfig, stage: TrainStageConfig, task: str, *, world: int = 1,
              device: str = "cuda", local: int | None = None) -> TaskPlan:
    """Peak bytes per rank for a batch of ``task`` in ``stage`` (the module docstring's model;
    ``local``: ranks per node, default one node)."""
    from embed_core.model.encoder import uses_bf16

    bf16 = uses_bf16(train.precision, device)
    fsdp = shard_degree(train, world, local) > 1
    st = states(shape, train, world, bf16, local)
    c = _compute(shape, train, stage, bf16, device, fsdp)
    batch = stage.batch_of(task)
    groups = task_groups(stage, task, batch)
    cached = stage.grad_cache_chunk is not None or stage.grad_cache_max_tokens is not None
    loss = loss_bytes(task, groups, world, shape.hidden, cached)
    steady = {"weights": st.weights, "optimizer": st.optimizer, **({"gathered": st.gathered} if fsdp else {})}
    chunk = None
    if cached:  # every chunk after the first runs with all gradients allocated
        shapes = [(chunk_texts(stage, n, s), s) for _, n, s in groups]
        (a, x), chunk = max(((pass_bytes(shape, c, n, s), (n, s)) for n, s in shapes), key=lambda t: sum(t[0]))
        activations = a + st.linear_copies
        phases = {"backward": _backward_peak([(activations, x)], st, True, 0), "loss": {"other": loss}}
    else:
        passes = [pass_bytes(shape, c, n, s) for _, n, s in groups]
        passes = [(a + st.linear_copies, x) for a, x in passes]
        activations = sum(a for a, _ in passes)
        phases = {"backward": _backward_peak(passes, st, stage.grad_accum > 1, loss)}
    phases = {name: {**steady, **parts} for name, parts in phases.items()}
    phases["optimizer step"] = {"weights": st.weights, "gradients": st.gradients, "optimizer": st.optimizer}
    phases["loading"] = {"weights": st.load}
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    return TaskPlan(task=task, batch=batch, texts=sum(n for _, n, _ in groups), chunk=list(chunk) if chunk else None,
                    weights=st.weights, gradients=st.gradients, optimizer=st.optimizer, activations=activations,
                    peak=sum(phases[phase].values()), phase=phase, at_peak=phases[phase])


@dataclass
class StagePlan:
    """A train stage's plan: its tasks' batches, the one with the highest peak, and against a GPU
    size whether it fits and the largest GradCache chunk and batch sizes that do."""

    stage: str
    sharding: str
    precision: str  # the compute: fp32 | bf16
    grad_cache: str | None  # "<n> texts" / "<n> tokens" / None
    tasks: list[TaskPlan] = field(default_factory=list)
    skipped: str | None = None
    fits: bool | None = None
    largest_chunk: int | None = None  # texts per GradCache chunk (0: none fits)
    whole_groups: bool = False  # largest_chunk is a whole text group: chunking is not needed
    largest_batch: dict[str, int] = field(default_factory=dict)  # task -> records per rank (BIG: any)
    fsdp_gpus: int | None = None  # when no chunk fits: the fewest GPUs sharding: fsdp fits it on

    @property
    def worst(self) -> TaskPlan | None:
        return max(self.tasks, key=lambda t: t.peak) if self.tasks else None


@dataclass
class Plan:
    model: dict[str, Any]
    gpus: int
    gpu_memory_gib: float | None
    usable: int | None  # bytes a stage may peak at: --gpu-memory less HEADROOM
    device: str
    stages: list[StagePlan]
    gpus_per_node: int | None = None  # None: one node
    checkpoint_bytes: int = 0  # one resumable checkpoint, all ranks' files
    checkpoint_disk_bytes: int = 0  # keep_checkpoints (the most of any stage) and the one being written
    committed_bytes: int = 0  # the committed model's weights (train.save_dtype)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def stage_tasks(stage: TrainStageConfig) -> list[str]:
    """The tasks a stage may draw batches of: its ``tasks``, else every trainable task it sizes."""
    from embed_core.schema import TRAINABLE_TASKS

    return [t for t in (stage.tasks or list(stage.batch_size)) if t in TRAINABLE_TASKS]


def _stage_peak(shape: ModelShape, train: TrainConfig, stage: TrainStageConfig, world: int, device: str,
                local: int | None = None) -> int:
    return max(plan_task(shape, train, stage, t, world=world, device=device, local=local).peak
               for t in stage_tasks(stage))


def _largest(fits: Any, high: int) -> int:
    """The largest n in [1, high] with ``fits(n)`` (monotone), 0 when even 1 does not fit."""
    if not fits(1):
        return 0
    low = 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _searches(sp: StagePlan, shape: ModelShape, train: TrainConfig, stage: TrainStageConfig, world: int,
              device: str, usable: int, local: int | None = None) -> None:
    """Fill in ``fits``, the largest GradCache chunk (texts at the stage's longest length) and the
    largest batch per task (with the stage's own chunking) that peak within ``usable`` bytes."""
    sp.fits = sp.worst.peak <= usable
    most = max(n for t in stage_tasks(stage) for _, n, _ in task_groups(stage, t, stage.batch_of(t)))

    def chunk_fits(n: int) -> bool:
        chunked = stage.model_copy(update={"grad_cache_chunk": n, "grad_cache_max_tokens": None})
        return _stage_peak(shape, train, chunked, world, device, local) <= usable

    sp.largest_chunk = _largest(chunk_fits, most)
    sp.whole_groups = sp.largest_chunk == most
    if not sp.largest_chunk:
        sp.fsdp_gpus = _fsdp_gpus(shape, train, stage, usable, device)
    for task in stage_tasks(stage):
        def batch_fits(b: int, task: str = task) -> bool:
            sized = stage.model_copy(update={"batch_size": {**stage.batch_size, task: b}})
            return plan_task(shape, train, sized, task, world=world, device=device, local=local).peak <= usable
        sp.largest_batch[task] = _largest(batch_fits, BIG)


def plan_stage(shape: ModelShape, train: TrainConfig, stage: TrainStageConfig, *, gpus: int = 1,
               device: str = "cuda", usable: int | None = None, local: int | None = None) -> StagePlan:
    from embed_core.model.encoder import uses_bf16

    cache = (f"{stage.grad_cache_chunk} texts" if stage.grad_cache_chunk else "") + \
        (" / " if stage.grad_cache_chunk and stage.grad_cache_max_tokens else "") + \
        (f"{stage.grad_cache_max_tokens} tokens" if stage.grad_cache_max_tokens else "")
    sp = StagePlan(stage=stage.name, sharding=_sharding(train, gpus, local),
                   precision="bf16" if uses_bf16(train.precision, device) else "fp32", grad_cache=cache or None)
    if not mode_of(stage).planned:
        sp.skipped = f"mode {stage.mode}: AutoRegEmbed (an encoder and a frozen decoder) is not modelled"
        return sp
    if not stage_tasks(stage):
        sp.skipped = "no trainable task"
        return sp
    sp.tasks = [plan_task(shape, train, stage, t, world=gpus, device=device, local=local) for t in stage_tasks(stage)]
    if usable is not None:
        _searches(sp, shape, train, stage, gpus, device, usable, local)
    return sp


def plan_config(train: TrainConfig, *, gpus: int = 1, gpu_memory_gib: float | None = None,
                device: str = "cuda", shape: ModelShape | None = None, gpus_per_node: int | None = None) -> Plan:
    """The plan of every train stage of ``train`` on ``gpus`` ranks (of ``gpu_memory_gib`` GiB each),
    ``gpus_per_node`` of them per node (default: all on one)."""
    if gpus < 1:
        raise ConfigError(f"--gpus must be at least 1 (got {gpus})")
    if gpus_per_node is not None and not 1 <= gpus_per_node <= gpus:
        raise ConfigError(f"--gpus-per-node must be from 1 to --gpus ({gpus}) (got {gpus_per_node})")
    train.fsdp_mesh_shape(gpus, gpus_per_node or gpus)  # one line when hybrid cannot split the ranks
    if gpu_memory_gib is not None and not (0 < gpu_memory_gib <= MAX_GPU_GIB):  # nan compares false
        raise ConfigError(f"--gpu-memory must be a number of GiB above 0 and at most {MAX_GPU_GIB} "
                          f"(got {gpu_memory_gib:g})")
    shape = shape or model_shape(train.base_model, train.gguf_file)
    usable = int(gpu_memory_gib * GiB * (1 - HEADROOM)) if gpu_memory_gib else None
    model = {"name": shape.name, "model_type": shape.model_type, "parameters": shape.numel(), "layers": shape.layers,
             "hidden": shape.hidden, "intermediate": shape.intermediate, "heads": shape.heads,
             "kv_heads": shape.kv_heads, "attention": shape.attention}
    stages = [plan_stage(shape, train, s, gpus=gpus, device=device, usable=usable, local=gpus_per_node)
              for s in train.stages]
    each = checkpoint_bytes(shape, train)
    keep = max(s.keep_checkpoints for s in train.stages)
    return Plan(model=model, gpus=gpus, gpu_memory_gib=gpu_memory_gib, usable=usable, device=device, stages=stages,
                gpus_per_node=gpus_per_node, checkpoint_bytes=each, checkpoint_disk_bytes=each * (keep + 1),
                committed_bytes=committed_bytes(shape, train))


# -- output and the fit check ---------------------------------------------------------------------
def _unit(plan: Plan) -> tuple[str, int]:
    """GiB, or MiB for a plan whose peaks all stay under 1 GiB."""
    return ("GiB", GiB) if max((t.peak for s in plan.stages for t in s.tasks), default=0) >= GiB else ("MiB", 2 ** 20)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """Columns of numbers to the right, the others to the left."""
    cells = [[str(c) for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    right = [all(re.fullmatch(r"[\d.≥]*", r[i]) for r in cells[1:]) for i in range(len(header))]
    return ["  ".join(c.rjust(w) if ri else c.ljust(w) for c, w, ri in zip(r, widths, right)).rstrip() for r in cells]


def format_plan(plan: Plan) -> str:
    """A table, one row per (stage, task), of the bytes per rank, and the notes that go with it."""
    name, size = _unit(plan)
    m = plan.model
    head = [f"model: {m['name']} ({m['model_type']}: {m['layers']} layers, hidden {m['hidden']}, intermediate "
            f"{m['intermediate']}, {m['heads']} heads / {m['kv_heads']} kv, {m['attention']}; "
            f"{m['parameters'] / 1e6:.2f} M parameters)"]
    gpus = f"{plan.gpus} GPU{'s' if plan.gpus > 1 else ''}"
    if plan.usable is None:
        head.append(f"{gpus}, {name} per rank (give --gpu-memory GiB to check the fit)")
    else:
        head.append(f"{gpus} of {plan.gpu_memory_gib:g} GiB: a stage may peak at {plan.usable / GiB:.2f} GiB per "
                    f"rank ({HEADROOM * 100:.0f} % kept for the CUDA context, workspaces and fragmentation); "
                    f"{name} per rank")
    cols = ["stage", "task", "batch", "texts", "grad cache", "compute", "sharding", "weights", "grads", "AdamW",
            "activations", "peak", "at"] + ([] if plan.usable is None else ["fits", "largest chunk", "largest batch"])
    rows = []
    for sp in plan.stages:
        for j, t in enumerate(sp.tasks):
            f = lambda b: f"{b / size:.2f}" if name == "GiB" else f"{b / size:.1f}"  # noqa: E731
            chunk = f"{sp.grad_cache} ({t.chunk[0]}×{t.chunk[1]})" if sp.grad_cache and t.chunk else "off"
            row = [sp.stage, t.task, t.batch, t.texts, chunk, sp.precision, sp.sharding, f(t.weights),
                   f(t.gradients), f(t.optimizer), f(t.activations), f(t.peak), t.phase]
            if plan.usable is not None:
                largest = "" if j else (f"{sp.largest_chunk} (whole groups)" if sp.whole_groups else
                                        str(sp.largest_chunk or "none"))
                batch = sp.largest_batch.get(t.task, 0)
                row += ["yes" if t.peak <= plan.usable else "NO", largest,
                        f"≥{BIG}" if batch >= BIG else str(batch or "none")]
            rows.append(row)
    head.append(f"disk: a resumable checkpoint is {plan.checkpoint_bytes / GiB:.2f} GiB (weights and AdamW state, "
                f"all ranks' files), {plan.checkpoint_disk_bytes / GiB:.2f} GiB with keep_checkpoints and the one "
                f"being written; the committed model's weights {plan.committed_bytes / GiB:.2f} GiB")
    lines = head + [""] + _table(cols, rows)
    lines += [f"stage {sp.stage}: not planned ({sp.skipped})" for sp in plan.stages if sp.skipped]
    lines += ["", "peak: the most alive at once on a rank; every text at its max length. Weights and AdamW stay "
              "throughout; gradients appear as the backward pass frees activations (so the peak can be less than "
              "the sum); it adds the transients: the embedding table's gradient, backward buffers, the loss's "
              "similarity matrices, under fsdp the gathered layers (embed_core/train/plan.py)."]
    if plan.usable is not None:
        lines.append("largest chunk: texts per GradCache chunk (grad_cache_chunk) at which the stage still fits; "
                     "largest batch: records per rank (batch_size) with the stage's own chunking.")
    return "\n".join(lines)


def _sharding(train: TrainConfig, gpus: int, local: int | None) -> str:
    """The back end and its mesh: none, deepspeed, fsdp/16 (flat), hsdp/2x8 (replicate × shard)."""
    backend = train.backend_name()
    if backend != "fsdp" or gpus < 2:
        return backend
    mesh = train.fsdp_mesh_shape(gpus, local or gpus)
    return f"fsdp/{gpus}" if len(mesh) == 1 else f"hsdp/{mesh[0]}x{mesh[1]}"


def _fsdp_gpus(shape: ModelShape, train: TrainConfig, stage: TrainStageConfig, usable: int, device: str) -> int | None:
    """The fewest GPUs (a power of two up to 1024) over which ``sharding: fsdp`` fits the stage
    with one text per GradCache chunk; None if none does."""
    sharded = train.model_copy(update={"sharding": "fsdp", "deepspeed": None})
    smallest = stage.model_copy(update={"grad_cache_chunk": 1, "grad_cache_max_tokens": None})
    for gpus in (2 ** k for k in range(1, 11)):
        if _stage_peak(shape, sharded, smallest, gpus, device) <= usable:
            return gpus
    return None


def check_fits(plan: Plan) -> None:
    """``DoesNotFit``, one line, when a stage peaks above the usable memory: the stage, its peak and
    what it is made of, and what would fit (a GradCache chunk, a batch size, fsdp over more GPUs)."""
    if plan.usable is None:
        return
    bad = [sp for sp in plan.stages if sp.fits is False]
    if not bad:
        return
    sp, name, size = bad[0], *_unit(plan)
    t = sp.worst
    g = lambda b: f"{b / size:.2f}" if name == "GiB" else f"{b / size:.1f}"  # noqa: E731
    what = (f"train stage '{sp.stage}' does not fit {plan.gpus} GPU{'s' if plan.gpus > 1 else ''} of "
            f"{plan.gpu_memory_gib:g} GiB: its {t.task} batches peak at {g(t.peak)} {name} per rank (weights "
            f"{g(t.weights)}, gradients {g(t.gradients)}, AdamW {g(t.optimizer)}, activations {g(t.activations)}) "
            f"where {plan.usable / GiB:.2f} GiB may be used")
    if sp.largest_chunk:
        batch = sp.largest_batch.get(t.task, 0)
        fix = f"grad_cache_chunk: {sp.largest_chunk} fits" + (f" (or batch_size {t.task}: {batch})" if batch else "")
    else:
        gpus = sp.fsdp_gpus
        fix = (f"not even one text per GradCache chunk fits: sharding: fsdp over {gpus} GPUs would" if gpus else
               "not even one text per GradCache chunk fits, nor fsdp over 1024 GPUs: use LoRA or a smaller model")
    others = f" (also too big: {', '.join(repr(s.stage) for s in bad[1:])})" if len(bad) > 1 else ""
    raise DoesNotFit(f"{what}; {fix}{others}")

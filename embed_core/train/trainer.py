"""The trainer: task-routed steps over dataset-grouped batches, with exact resume.

One optimizer step = ``grad_accum`` micro-batches, each drawn by the grouped sampler from one
dataset; the batch's task picks its loss (``embed_core.losses``: QZhou's InfoNCE, CLS InfoNCE or
CoSENT unless the stage names another per task). AdamW with weight decay
(not on biases / LayerNorm), linear warm-up then cosine / linear decay, gradient clipping, bf16
autocast on CUDA and on CPUs with native bf16, optional gradient checkpointing and GradCache.

GradCache (Gao et al. 2021): embed all texts of a batch without a graph in chunks, compute the
loss on the detached embeddings, backpropagate it to the embeddings only, then re-run each chunk
with a graph and push the cached embedding gradients through it. Memory then depends on the chunk
size, not the contrastive batch size; dropout masks match because each chunk's RNG state is
replayed.

Under ``torch.distributed`` every rank draws the same dataset at a step and takes its own slice;
each loss all-gathers (with gradients, ``torch.distributed.nn.all_gather``) what it wants shared:
retrieval losses gather queries and documents so every rank's queries see all ranks' documents;
CLS and CoSENT batches stay local.

Checkpoints (``<run_dir>/checkpoints/<stage>/step-N/``) hold model, optimizer, scheduler, sampler
and RNG states plus the metrics so far; ``resume`` continues from the newest complete one and
reproduces the uninterrupted run's losses and weights exactly. The records each step consumed
(``consumed``, the stage's lineage) are not in a checkpoint: a resume draws them again from a fresh
sampler (``embed_core.train.lineage.replay``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor

from embed_core.train.config import TrainConfig, TrainStageConfig
from embed_core.errors import CheckpointError, ConfigError, printable
from embed_core.losses import Loss, LossContext, loss_for
from embed_core.model.embedder import Embedder
from embed_core.model.encoder import uses_bf16
from embed_core.model.packing import resolve_attention
from embed_core.progress import Progress
from embed_core.train.batches import INFONCE_TASKS, DatasetRecords, TaskBatch, TextGroup, build_batch
from embed_core.train import sharding
from embed_core.train.distributed import (
    GradientAverage,
    barrier,
    broadcast_from_main,
    init_process_group,
    mean_over_ranks,
    wait_for_main,
)
from embed_core.train.lineage import Consumed, consumed_positions, replay
from embed_core.train.prefetch import BatchSource
from embed_core.train.sampling import Batch, GroupedBatchSampler
from embed_core.train.telemetry import FlopModel, device_peak_tflops, peak_memory_mb, total_norm

CHECKPOINT_PREFIX = "step-"


def lr_lambda(stage: TrainStageConfig) -> Callable[[int], float]:
    def f(step: int) -> float:
        if stage.warmup_steps and step < stage.warmup_steps:
            return (step + 1) / stage.warmup_steps
        if stage.scheduler == "constant":
            return 1.0
        progress = (step - stage.warmup_steps) / max(1, stage.steps - stage.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        return 0.5 * (1 + math.cos(math.pi * progress)) if stage.scheduler == "cosine" else 1.0 - progress
    return f


def length_buckets(lengths: list[int], most: int, pass_cost: int = 0) -> list[tuple[int, int]]:
    """Split texts sorted by decreasing length into at most ``most`` contiguous passes so that the
    padded positions (sum over passes of size × its longest length) plus ``pass_cost`` per pass
    are fewest (a pass has a fixed cost too: an extra one must save that many positions). Exact dynamic
    programme over the runs of equal length (a cut inside a run never helps), so it is cheap for
    any batch size. Returns ``[(start, end), ...]`` into ``lengths``."""
    n = len(lengths)
    starts = [i for i in range(n) if i == 0 or lengths[i] != lengths[i - 1]] + [n]  # run boundaries
    m = len(starts) - 1
    most = min(most, m)
    if most <= 1:
        return [(0, n)]
    inf = float("inf")
    # cost[k][r]: fewest padded positions for the first r runs in k passes; a pass over runs j..r-1
    # costs (starts[r] - starts[j]) * lengths[starts[j]] (its first text is its longest)
    cost = [[inf] * (m + 1) for _ in range(most + 1)]
    cut = [[0] * (m + 1) for _ in range(most + 1)]
    cost[0][0] = 0
    for k in range(1, most + 1):
        for r in range(k, m + 1):
            for j in range(k - 1, r):
                c = cost[k - 1][j] + (starts[r] - starts[j]) * lengths[starts[j]]
                if c < cost[k][r]:
                    cost[k][r], cut[k][r] = c, j
    k = min(range(1, most + 1), key=lambda kk: (cost[kk][m] + pass_cost * kk, kk))
    bounds, r = [], m
    while k > 0:
        j = cut[k][r]
        bounds.append((starts[j], starts[r]))
        r, k = j, k - 1
    return bounds[::-1]


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@contextmanager
def _checkpoint_write(tmp: Path, complete: list[Path]) -> Iterator[None]:
    """A checkpoint write that fails (torch reports a full disk as a RuntimeError with no errno) is
    one line naming the checkpoint, the free space left and the last complete checkpoint, which is
    kept (a checkpoint becomes visible only once whole)."""
    try:
        yield
    except (RuntimeError, OSError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            stat = os.statvfs(tmp.parent)
            free = f"{stat.f_bavail * stat.f_frsize / 2 ** 20:.0f} MiB free there"
        except OSError:
            free = "free space unknown"
        last = complete[-1].name if complete else "none yet"
        raise CheckpointError(f"{tmp}: writing the checkpoint failed ({printable(exc, 120)}; {free}: a full disk?); "
                              f"the last complete checkpoint ({last}) is kept and a rerun resumes from it") from exc


def _rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain data, so ``torch.load(weights_only=True)`` reads it
    back (a checkpoint from a copied run directory is never unpickled)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _load_plain(path: Path, **kwargs: Any) -> Any:
    """A checkpoint state file with ``weights_only=True``: tensors and plain data only. A file that
    holds any other pickled object is refused instead of run (run directories travel between people)."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        found = re.search(r"unsupported GLOBAL (\S+)|Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"it references {found.group(1) or found.group(2)}" if found else "it is not tensors and plain data"
        raise CheckpointError(f"{path}: refusing to load: {what}, and loading it could run code; "
                              "pass --no-resume to train from the stage's start, or delete the checkpoint") from None


class Trainer:
    def __init__(self, train: TrainConfig, stage: TrainStageConfig, datasets: dict[str, DatasetRecords], *,
                 init_model: str, checkpoint_dir: Path, seed: int = 42, log: Callable[[str], None] = print):
        self._init_run(train, stage, seed, log)
        self.datasets = datasets
        model = Embedder(init_model, pooling=train.pooling, max_length=train.max_length,
                              instruction_template=train.instruction_template,
                              exclude_instruction_from_pooling=train.exclude_instruction_from_pooling,
                              bidirectional=train.bidirectional, gguf_file=train.gguf_file if init_model == train.base_model else None,
                              gradient_checkpointing=stage.gradient_checkpointing,
                              lora=train.lora.model_dump() if train.lora else None, append_eos=train.append_eos,
                              # a LoRA base is frozen: loaded straight into its storage dtype
                              torch_dtype=torch.bfloat16 if train.weights_dtype == "bf16" and train.lora else None,
                              attn_implementation=resolve_attention(train.attention, self.device.type))
        # the loss each task trains with (stage.losses overrides QZhou's); tasks with the same loss
        # and parameters share one instance (and so one HMCL pair-type head)
        self.losses: dict[str, Loss] = {}
        shared: dict[str, Loss] = {}
        for task in sorted({d.task for d in datasets.values()}):
            loss = loss_for(task, stage.losses.get(task))
            key = json.dumps([loss.name, loss.params.model_dump(mode="json")], sort_keys=True)
            self.losses[task] = shared.setdefault(key, loss)
        heads = {f"{i}-{loss.name}": m for i, loss in enumerate(shared.values())
                 if (m := loss.trainable_module()) is not None}
        if heads:
            # e.g. HMCL's pair-type head: a submodule, so the optimizer, checkpoints and DeepSpeed
            # carry it; Embedder.save writes only the encoder, so the saved model does not
            model.loss_heads = torch.nn.ModuleDict(heads)
        ret = {n for n, d in datasets.items() if d.task in INFONCE_TASKS}
        sampler = GroupedBatchSampler(
            {n: d.size for n, d in datasets.items()},
            {n: stage.batch_size.get(d.task, 32) * self.world for n, d in datasets.items()},
            alpha=stage.alpha, retrieval=ret, eta=stage.eta, seed=seed, alternate=stage.alternate_tasks,
            multipliers=stage.dataset_weight)
        self._init_optimization(model, sampler, checkpoint_dir)
        self.lineage = True  # records consumed per step (embed_core.train.lineage): records, not derived examples

    # -- set-up shared with the AutoRegEmbed trainer ---------------------------------------------
    def _init_run(self, train: TrainConfig, stage: TrainStageConfig, seed: int, log: Callable[[str], None]) -> None:
        """Seeds, process group position, device and precision (before any model is built)."""
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.train_cfg, self.stage, self.seed, self.log = train, stage, seed, log
        # a launched job's process group (gloo / nccl); FSDP needs one even for a single process
        self.rank, self.world = init_process_group(single=train.sharding == "fsdp", timeout_s=train.dist_timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        # auto: bf16 autocast on CUDA and on CPUs with native bf16 (AMX / AVX512-BF16: 2.8x the fp32
        # encoder throughput measured on a 2-core Xeon with AMX); fp32 elsewhere, and where a test
        # needs bit-exact resumes it pins precision: fp32
        self.bf16 = uses_bf16(train.precision, self.device.type)
        self.bucket_pass_cost = stage.bucket_pass_cost if stage.bucket_pass_cost is not None else 8192 * self.bf16
        if train.weights_dtype == "bf16" and not self.bf16:
            raise ConfigError(f"train.weights_dtype: bf16 needs bf16 compute, and precision {train.precision!r} is fp32 "
                              f"on this device ({self.device.type}); use weights_dtype: fp32 here")

    def _init_optimization(self, model: torch.nn.Module, sampler: GroupedBatchSampler, checkpoint_dir: Path) -> None:
        """The trained model on its device, AdamW, the schedule, DeepSpeed when configured, the
        sampler and the step counters."""
        self.model = _stored(model, self.train_cfg.weights_dtype).to(self.device)
        self.model.train()
        self.sharded = self.train_cfg.sharding == "fsdp"
        # reduce-scatter after every backward (sharded memory) or only a step's last (fewer collectives)
        self.sync_every = self.train_cfg.fsdp_sync == "every_backward"
        if self.sharded:  # before the optimizer: it must hold the sharded parameters
            sharding.shard(self.model, bf16=self.bf16)
        # fused AdamW: one kernel per parameter group instead of per tensor (CPU and CUDA)
        self.optimizer = torch.optim.AdamW(_param_groups(self.model, self.stage.weight_decay), lr=self.stage.lr,
                                           fused=self.device.type in ("cpu", "cuda"))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.stage))
        self.engine = None
        if self.train_cfg.deepspeed is not None:
            self.engine = self._deepspeed(self.train_cfg.deepspeed, self.stage)
        self.sampler = sampler
        self.batches = BatchSource(sampler, self._build, prefetch=self.train_cfg.prefetch)
        # plain multi-process: gradients averaged in buckets during the step's last backward (DeepSpeed
        # and FSDP reduce in their own hooks)
        self.averager = GradientAverage(self.model) if self.world > 1 and not self.sharded and self.engine is None else None
        self.checkpoint_dir = Path(checkpoint_dir)
        self.step = 0
        self._tokens = self._texts = 0
        self._grad_norm: float | None = None
        self.flops = FlopModel(self.model, getattr(getattr(self.model, "model", None), "config", None))
        self.peak_tflops = device_peak_tflops(self.device, self.bf16, self.train_cfg.peak_tflops)
        self.metrics: list[dict[str, Any]] = []
        self.lineage = False
        self.consumed: list[Consumed] = []  # (step, dataset, positions) per micro-batch trained
        self.dev_evaluator = None  # embed_core.train.dev.DevEvaluator, set by the stage when it has dev tasks
        self.dev_rows: list[dict[str, Any]] = []  # one row per (evaluation step, dev task)
        self.best: dict[str, Any] | None = None  # {"step", "score"} of the best dev selection score so far

    def _deepspeed(self, ds_config: dict[str, Any], stage: TrainStageConfig):
        """Wrap model, optimizer and scheduler in a DeepSpeed engine (ZeRO per ``ds_config``).
        Single-process runs get local rendezvous defaults; multi-GPU runs come from the
        ``deepspeed``/``torchrun`` launcher's environment. On CPU (``DS_ACCELERATOR=cpu``) gloo is used."""
        try:
            import deepspeed
        except ImportError:
            raise ConfigError("train.deepspeed is set but deepspeed is not installed: pip install -e '.[deepspeed]'") from None
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", "29511")):
            os.environ.setdefault(key, value)
        if self.device.type == "cpu":
            _skip_deepspeed_cpu_inference_kernel()
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": stage.grad_accum,
                  **({"gradient_clipping": stage.max_grad_norm} if stage.max_grad_norm else {}), **ds_config}
        engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.model, optimizer=self.optimizer, lr_scheduler=self.scheduler, config=config)
        return engine

    # -- embedding -----------------------------------------------------------------------------
    def _packs(self) -> bool:
        """``train.packing``: on, off, or auto = where the model's attention is a FlashAttention
        kernel (variable-length, no mask)."""
        mode = self.train_cfg.packing
        return mode == "on" or (mode == "auto" and self.model.varlen_attention)

    def _embed(self, group: TextGroup) -> Tensor:
        """Embeddings of a text group in input order: one packed pass (``train.packing``,
        ``Embedder.pack``), or length-sorted and encoded in up to ``length_buckets`` passes, each cut
        to its own longest text (right padding: the cut removes only padding), so short texts are
        not padded to the group's longest."""
        features = _features(self.model, group)
        lengths = features["attention_mask"].sum(dim=1)
        if torch.is_grad_enabled():  # counted once per text (GradCache's no-graph pass is not)
            self._tokens += int(lengths.sum())
            self._texts += len(group.texts)
        model = self.engine or self.model
        packed = self.model.pack(features) if self._packs() else None
        if packed is not None:  # in input order already
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                return model({k: v.to(self.device) for k, v in packed.items()})
        features = {k: v.to(self.device) for k, v in features.items()}
        order = torch.argsort(lengths, descending=True, stable=True)
        bounds = length_buckets(lengths[order].tolist(), self.stage.length_buckets, self.bucket_pass_cost)
        # one autocast region for all passes: autocast keeps the bf16 copies of the weights until its
        # outermost region exits, so per-pass regions would cast every weight once per pass
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            if len(bounds) == 1:
                return model(features)
            parts = []
            for start, end in bounds:
                idx = order[start:end].to(self.device)
                width = int(lengths[order[start]])
                parts.append(model({k: v.index_select(0, idx)[:, :width] for k, v in features.items()}))
        out = torch.cat(parts)
        return out.index_select(0, torch.argsort(order).to(self.device))

    def _gather(self, x: Tensor) -> Tensor:
        """Rows of every rank, in rank order, with gradients back to each rank's own rows. Ranks may
        hold different numbers of rows (e.g. records with fewer hard negatives than asked for), so
        the sizes are exchanged first and each slice is padded to the largest for the collective."""
        if self.world == 1:
            return x
        import torch.distributed.nn  # its functions' default group is the one current at import: pass it

        n = torch.tensor([x.size(0)], device=x.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        torch.distributed.all_gather(sizes, n)
        sizes = [int(s) for s in sizes]
        most = max(sizes)
        if most == 0:
            return x
        if x.size(0) < most:
            x = torch.cat([x, x.new_zeros(most - x.size(0), *x.shape[1:])])
        parts = torch.distributed.nn.all_gather(x, group=torch.distributed.group.WORLD)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)], dim=0)

    def _loss(self, batch: TaskBatch, emb: dict[str, Tensor]) -> Tensor:
        ctx = LossContext(step=self.step, warmup_steps=self.stage.warmup_steps, gather=self._gather)
        return self.losses[batch.task](emb, batch, ctx)

    def _forward_backward(self, batch: TaskBatch, scale: float, last: bool = True) -> float:
        """Loss and gradients of one micro-batch; ``last``: the step's last one, whose (last)
        backward pass reduces the gradients over the ranks under FSDP."""
        # non-padding tokens and texts put through the encoder with a graph (throughput, MFU)
        self._tokens = self._texts = 0
        if self.stage.grad_cache_chunk is None and self.stage.grad_cache_max_tokens is None:
            emb = {name: self._embed(g) for name, g in batch.groups.items()}
            loss = self._loss(batch, emb)
            self._sync(last)
            self._backward(loss * scale)
            return float(loss.detach())
        # GradCache: 1) embed without a graph, remembering each chunk's RNG states (CPU and the
        # device's: dropout on CUDA draws from the CUDA generator)
        pieces: list[tuple[str, TextGroup, Tensor, Any]] = []
        reps: dict[str, list[Tensor]] = {}
        for name, g in batch.groups.items():
            for idx in self._chunks(g):
                sub = _subgroup(self.model, g, idx)
                state = _rng_state()
                with torch.no_grad():
                    reps.setdefault(name, []).append(self._embed(sub))
                pieces.append((name, sub, torch.tensor(idx, device=self.device), state))
        # back in the group's order (chunks of a token budget are length-sorted)
        order = {name: torch.cat([p[2] for p in pieces if p[0] == name]) for name in reps}
        cached = {name: torch.cat(parts).index_select(0, torch.argsort(order[name])).detach().requires_grad_()
                  for name, parts in reps.items()}
        # 2) loss on the cached embeddings, gradients to the embeddings only (leaf tensors: no
        # parameter sees this backward, so it stays outside DeepSpeed's engine)
        loss = self._loss(batch, cached)
        (loss * scale).backward()
        grads = {name: t.grad for name, t in cached.items()}
        # 3) replay each chunk with a graph (same RNG states: same dropout masks) and push its cached
        # gradient through the encoder; sum(out * g) has exactly that gradient, and as a scalar it
        # can go through the engine's backward (loss scaling, gradient hooks)
        after = _rng_state()
        for i, (name, sub, idx, state) in enumerate(pieces):
            _set_rng_state(state)
            self._sync(last and i == len(pieces) - 1)
            out = self._embed(sub)
            g = grads[name].index_select(0, idx)
            self._backward((out.float() * g.float()).sum())
        _set_rng_state(after)
        return float(loss.detach())

    def _sync(self, last: bool) -> None:
        """Before a backward pass: whether its gradients are the step's final ones, to be reduced over
        the ranks as they are made (FSDP's reduce-scatter, or the bucketed average)."""
        sharding.gradient_sync(self.model, last or self.sync_every)
        if self.averager is not None:
            self.averager.arm(last)

    def _chunks(self, group: TextGroup) -> list[list[int]]:
        """GradCache's chunks of a text group, as indices: runs of ``grad_cache_chunk`` texts in
        order, or, with ``grad_cache_max_tokens``, texts by decreasing length packed while the chunk's
        padded size (texts × its longest) stays within the budget (and ``grad_cache_chunk`` texts,
        when set too): memory then follows tokens, not texts. A text over the budget is a chunk alone."""
        most, budget = self.stage.grad_cache_chunk or len(group.texts), self.stage.grad_cache_max_tokens
        if budget is None:
            return [list(range(start, min(start + most, len(group.texts)))) for start in range(0, len(group.texts), most)]
        lengths = _features(self.model, group)["attention_mask"].sum(dim=1)
        chunks: list[list[int]] = []
        for i in torch.argsort(lengths, descending=True, stable=True).tolist():
            if chunks and len(chunks[-1]) < most and (len(chunks[-1]) + 1) * int(lengths[chunks[-1][0]]) <= budget:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks

    def _backward(self, loss: Tensor) -> None:
        """Through DeepSpeed's engine when there is one (it divides by its gradient accumulation
        steps and applies loss scaling; the plain path's ``scale`` did the division already)."""
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            loss.backward()

    def _slice(self, indices: list[int]) -> list[int]:
        if self.world == 1:
            return indices
        per = len(indices) // self.world
        return indices[self.rank * per:(self.rank + 1) * per]

    def _build(self, drawn: Batch, index: int) -> TaskBatch:
        """Micro-batch ``index`` of the drawn records, every text group tokenized (``BatchSource``
        runs this one micro-batch ahead, on its thread)."""
        s = self.stage
        records = self.datasets[drawn.dataset]
        loss = self.losses[records.task]
        batch = build_batch(records, self._slice(drawn.indices), step=index, seed=self.seed,
                            num_negatives=s.num_hard_negatives, query_max_length=s.query_max_length,
                            passage_max_length=s.passage_max_length, use_instructions=self.train_cfg.use_instructions,
                            layout=loss.layout, **loss.batch_options())
        for group in batch.groups.values():
            group.features = self.model.tokenize(group.texts, group.instructions, group.max_length)
        batch.positions = consumed_positions(drawn.indices, self.world)
        return batch

    def train_step(self) -> list[dict[str, Any]]:
        s = self.stage
        t0 = time.perf_counter()
        rows = []
        for micro in range(s.grad_accum):
            batch = self.batches.get(self.step * s.grad_accum + micro)
            self.consumed.append((self.step + 1, batch.dataset, batch.positions))
            # DeepSpeed scales by its gradient_accumulation_steps itself and steps at the boundary
            value = mean_over_ranks(self._forward_backward(batch, 1.0 if self.engine is not None else 1.0 / s.grad_accum,
                                                           last=micro == s.grad_accum - 1))
            rows.append({"dataset": batch.dataset, "task": batch.task, "loss": value, "examples": batch.size,
                         "tokens": self._tokens, "texts": self._texts})
            if self.engine is not None:
                self.engine.step()
                norm = self.engine.get_global_grad_norm()
                self._grad_norm = None if norm is None else total_norm(norm)
        if self.engine is None:
            self._optimizer_step()
        return self._record_step(rows, t0)

    def _optimizer_step(self) -> None:
        if self.averager is not None:
            self.averager.finish()
        if self.stage.max_grad_norm:  # the norm before clipping, as every trainer logs it
            self._grad_norm = total_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                        self.stage.max_grad_norm))
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            self._grad_norm = total_norm(torch.nn.utils.get_total_norm(grads)) if grads else None
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _record_step(self, rows: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
        """Count the finished optimizer step and turn its micro-batch rows into metric rows."""
        s = self.stage
        seconds = time.perf_counter() - t0
        self.step += 1
        lr = self.scheduler.get_last_lr()[0]
        tokens = sum(r["tokens"] for r in rows)
        examples = sum(r["examples"] for r in rows)
        telemetry = {"grad_norm": self._grad_norm, "peak_memory_mb": peak_memory_mb(self.device),
                     "mfu": self.flops.mfu(tokens, sum(r.get("texts", 0) for r in rows), seconds, self.peak_tflops)}
        out = [{"stage": s.name, "step": self.step, **r, "lr": lr, "seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds else 0.0,
                "examples_per_s": examples / seconds if seconds else 0.0, **telemetry} for r in rows]
        self.metrics += out
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Every rank calls this at the same step: DeepSpeed saves its (partitioned) state from every
        rank, every rank saves its own RNG states (its dropout stream), and rank 0 writes the rest and
        makes the checkpoint visible once it is complete."""
        final = self.checkpoint_dir / f"{CHECKPOINT_PREFIX}{self.step:07d}"
        tmp = self.checkpoint_dir / f".tmp-{CHECKPOINT_PREFIX}{self.step:07d}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        param_groups = None
        with _checkpoint_write(tmp, self.checkpoints()):
            if self.engine is not None:  # ZeRO partitions optimizer state: DeepSpeed saves its own layout
                self.engine.save_checkpoint(str(tmp / "deepspeed"), tag="ds")
            if self.sharded:  # each rank its shard of weights and optimizer state
                param_groups = sharding.save(tmp / "sharded", self.model, self.optimizer)
            torch.save(_rng_state(), tmp / f"rng-{self.rank}.pt")
        barrier()
        if self.rank == 0:
            if self.engine is None:
                state = {"scheduler": self.scheduler.state_dict()} if self.sharded else {
                    "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict()}
                with _checkpoint_write(tmp, self.checkpoints()):
                    torch.save(state, tmp / "state.pt")
            (tmp / "trainer_state.json").write_text(json.dumps({
                "step": self.step, "stage": self.stage.model_dump(mode="json"), "seed": self.seed, "world": self.world,
                "sampler": self.batches.sampler_state(), "metrics": self.metrics, "dev": self.dev_rows,
                "best": self.best, "param_groups": param_groups}, default=_json_default))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # a checkpoint is visible only once complete
            for old in self.checkpoints()[:-self.stage.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def consolidated_state(self) -> dict[str, Tensor] | None:
        """Under FSDP, the encoder's whole weights gathered once to rank 0's CPU for the committed
        model (every rank calls it; the others get ``{}``), keyed like ``Embedder.model.state_dict()``;
        None unsharded (the model saves its own weights)."""
        if not self.sharded:
            return None
        state = sharding.full_state_dict(self.model)
        return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}

    def checkpoints(self) -> list[Path]:
        if not self.checkpoint_dir.exists():
            return []
        return sorted(p for p in self.checkpoint_dir.glob(f"{CHECKPOINT_PREFIX}*") if (p / "trainer_state.json").exists())

    def load_checkpoint(self, path: Path) -> None:
        """Restore every state from ``path``; a damaged checkpoint (cut-off, edited or missing state
        files) is a ``CheckpointError`` naming it and ``--no-resume``."""
        try:
            self._load_checkpoint(path)
        except (OSError, ValueError, KeyError, IndexError, TypeError, RuntimeError, EOFError) as exc:
            detail = " ".join(str(exc).split())[:160] or type(exc).__name__
            raise CheckpointError(f"{path}: damaged checkpoint, cannot resume from it ({type(exc).__name__}: {detail}); "
                                  "pass --no-resume to train from the stage's start, or delete the checkpoint") from exc

    def _load_checkpoint(self, path: Path) -> None:
        meta = json.loads((path / "trainer_state.json").read_text())
        if meta.get("world", 1) != self.world:
            raise ConfigError(f"{path}: saved by {meta.get('world', 1)} processes, resumed by {self.world}; resume "
                              "with the same number of processes (or pass --no-resume)")
        if self.engine is not None:
            self.engine.load_checkpoint(str(path / "deepspeed"), tag="ds")
        else:
            state = _load_plain(path / "state.pt", map_location=self.device)
            if self.sharded:
                sharding.load(path / "sharded", self.model, self.optimizer, meta["param_groups"])
            else:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        self.batches.reset()  # the micro-batch drawn ahead belongs to the run before the resume
        self.sampler.load_state_dict(meta["sampler"])  # PCG64 state is plain ints: JSON round-trips it
        _set_rng_state(_load_plain(path / f"rng-{self.rank}.pt"))
        self.step = meta["step"]
        if self.lineage:  # the steps before the checkpoint, drawn again (the sampler is deterministic)
            self.consumed = replay(self.sampler, self.step, self.stage.grad_accum, self.world)
        self.metrics = meta["metrics"]
        self.dev_rows = meta.get("dev", [])
        self.best = meta.get("best")

    def fit(self, *, resume: bool = False) -> list[dict[str, Any]]:
        if resume and self.checkpoints():
            latest = self.checkpoints()[-1]
            self.load_checkpoint(latest)
            self.log(f"resumed from {latest} (step {self.step})")
        progress = Progress(f"train {self.stage.name}", total=self.stage.steps - self.step, unit="steps",
                            logger=logging.getLogger("embedpipe.train"))
        while self.step < self.stage.steps:
            rows = self.train_step()
            progress.update(loss=f"{rows[-1]['loss']:.4f}" if rows else "-",
                            **({"tok/s": f"{rows[-1]['tokens_per_s']:.0f}"} if rows else {}))
            # the last step's figures are in the progress line that closes the loop: not said twice
            if self.step % self.stage.log_every == 0 and self.step != self.stage.steps:
                r = rows[-1]
                self.log(f"{self.stage.name} step {self.step}/{self.stage.steps} {r['dataset']} ({r['task']}) "
                         f"loss {r['loss']:.4f} lr {r['lr']:.2e} {r['tokens_per_s']:.0f} tok/s" + _telemetry_line(r))
            if self.dev_evaluator is not None and (self.step % self.stage.dev.eval_every == 0
                                                   or self.step == self.stage.steps):
                self.evaluate_dev()
            if self.step % self.stage.checkpoint_every == 0:
                self.save_checkpoint()
        progress.close()
        self.batches.close()
        if self.dev_evaluator is not None and self.stage.dev.select == "best" and self.best is not None \
                and self.best["step"] != self.step and (self.rank == 0 or self.sharded):
            if self.sharded:  # every rank its shard
                sharding.load(self._best_path(self.best["step"]).with_suffix(""), self.model)
            else:
                self.model.load_state_dict(_load_plain(self._best_path(self.best["step"]), map_location=self.device))
            self.log(f"{self.stage.name}: keeping the weights of step {self.best['step']} (best dev score "
                     f"{self.best['score']:.4f}), not the last step's")
        return self.metrics

    # -- dev evaluation ------------------------------------------------------------------------
    def _best_path(self, step: int) -> Path:
        return self.checkpoint_dir / "best" / f"step-{step:07d}.pt"

    def evaluate_dev(self) -> None:
        """Score the dev tasks (rank 0; the others go on to the next step's collective and wait there;
        under FSDP every rank encodes, since each forward gathers the layers from all ranks, and rank
        0's scores count), log them, and keep the weights when the selection score is the best so far."""
        if self.rank != 0 and not self.sharded:
            wait_for_main()  # not in the next step's collective, which would time out on a long evaluation
            return
        rng = _rng_state()  # mteb seeds the global RNGs: training must not depend on whether it evaluates
        try:
            scores = self.dev_evaluator.score(self.model)
        finally:
            _set_rng_state(rng)
        if not self.sharded:
            wait_for_main()
        scores = broadcast_from_main(scores) if self.sharded else scores
        selection = self.dev_evaluator.selection_score(scores)
        if math.isnan(selection):
            selection = float("-inf")  # a diverged or constant model never becomes the best
        for task, value in scores.items():
            self.dev_rows.append({"stage": self.stage.name, "step": self.step, "task": task, "score": value,
                                  "selection": selection})
        (self.log if self.rank == 0 else log_debug)(f"{self.stage.name} step {self.step} dev: " + ", ".join(f"{t} {v:.4f}" for t, v in scores.items())
                 + f" (selection {selection:.4f}" + (f", best {self.best['score']:.4f} at step {self.best['step']})"
                                                     if self.best else ")"))
        if self.best is None or selection > self.best["score"]:
            self.best = {"step": self.step, "score": selection}
            if self.stage.dev.select == "best":
                # one file per step, named in `best`: a resume restores the `best` of its checkpoint
                # together with the file it names, whatever was written after that checkpoint
                path = self._best_path(self.step)
                path.parent.mkdir(parents=True, exist_ok=True)
                if self.sharded:  # a directory of shards, one per rank
                    sharding.save(path.with_suffix(""), self.model)
                else:
                    torch.save(self.model.state_dict(), path.with_suffix(".tmp"))
                    os.replace(path.with_suffix(".tmp"), path)


def _telemetry_line(row: dict[str, Any]) -> str:
    """`` grad norm 0.84, peak 1234 MB, MFU 31.2 %`` (what a step row has of them)."""
    parts = []
    if row.get("grad_norm") is not None:
        parts.append(f"grad norm {row['grad_norm']:.3g}")
    parts.append(f"peak {row['peak_memory_mb']:.0f} MB")
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f} %")
    return ", " + ", ".join(parts)


def log_debug(message: str) -> None:
    logging.getLogger("embedpipe.train").debug(message)


def _skip_deepspeed_cpu_inference_kernel() -> None:
    """DeepSpeed's CPU communication backend JIT-compiles a shared-memory all-reduce kernel
    (``deepspeed_shm_comm``: about a minute of C++ on 2 cores, again whenever its build flags change)
    as it starts. Only tensor-parallel inference calls it (``inference_all_reduce``); every collective
    of training goes through torch.distributed (gloo). Marked as not buildable, the backend starts
    without it, as it does on a platform that cannot build it."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def _features(model: torch.nn.Module, group: TextGroup) -> dict[str, Tensor]:
    """The group's tokenized features (made by the batch source, or here when it made none)."""
    if group.features is None:
        group.features = model.tokenize(group.texts, group.instructions, group.max_length)
    return group.features


def _subgroup(model: torch.nn.Module, group: TextGroup, idx: list[int]) -> TextGroup:
    """The texts ``idx`` of ``group`` (a GradCache chunk) with their rows of the group's features, cut
    to the chunk's longest text: right padding, so exactly what tokenizing the chunk alone gives."""
    features = _features(model, group)
    rows = torch.tensor(idx)
    picked = {k: v.index_select(0, rows) for k, v in features.items()}
    width = int(picked["attention_mask"].sum(dim=1).max())
    return TextGroup([group.texts[i] for i in idx], [group.instructions[i] for i in idx], group.max_length,
                     features={k: v[:, :width] for k, v in picked.items()})


def _stored(model: torch.nn.Module, weights_dtype: str) -> torch.nn.Module:
    """Trained weights in fp32 (the master copy AdamW updates, whatever dtype the checkpoint had);
    frozen ones (a LoRA base) in ``weights_dtype``."""
    frozen = torch.bfloat16 if weights_dtype == "bf16" else torch.float32
    for p in model.parameters():
        want = torch.float32 if p.requires_grad else frozen
        if p.is_floating_point() and p.dtype != want:
            p.data = p.data.to(want)
    return model


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    raise TypeError(f"not JSON serialisable: {type(obj)}")

"""A micro-batch's encoder passes, and the one agreement that keeps the ranks' collectives paired.

A *pass* is one call of the encoder on some texts of one group (queries, positives, negatives...):

* without GradCache a group's texts are sorted by length and encoded in up to ``length_buckets``
  passes, each cut to its own longest text (right padding: the cut removes only padding), or in
  one packed pass (``train.packing``, ``Embedder.pack``; with ``auto``, under FlashAttention always,
  elsewhere where packing saves a quarter of the padded rows or more);
* with GradCache (Gao et al. 2021) the group is first cut into chunks (``grad_cache_chunk`` texts,
  or texts by decreasing length within ``grad_cache_max_tokens`` padded tokens), and each chunk's
  passes are made the same way. Every pass is embedded without a graph (its RNG state kept), the
  loss is computed on the detached embeddings and backpropagated to them, then every pass is
  replayed with a graph (same RNG state: same dropout masks) and its cached gradient pushed through
  the encoder. Memory then follows the pass, not the contrastive batch.

**Ranks.** Where a forward is itself a collective (FSDP all-gathers each layer's weights in every
forward and reduce-scatters in every backward), every rank must make the same number of passes in
the same order, whatever its own texts hold: how many texts, how long, whether a group (hard
negatives) is there at all, whether packing applied. Each rank plans its passes from its own data,
then the ranks agree on the largest count in one all-reduce (``max_over_ranks``), and a rank with
fewer passes makes the difference up with *padding passes*: the encoder on one short text, whose
output enters the loss times zero (so its backward runs, with zero gradients). That is the only
data-dependent decision in a step; everything else (group names, the loss's gathers) is the same
on every rank by construction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from embed_core.losses.batch import TaskBatch, TextGroup
from embed_core.train.engine.checkpoint import rng_state, set_rng_state
from embed_core.model.packing import packing_pays
from embed_core.dist.distributed import max_over_ranks


@dataclass
class Pass:
    """One encoder call: ``rows`` of group ``group`` (None for a padding pass) and its inputs."""

    group: str | None
    rows: Tensor | None
    inputs: dict[str, Tensor]
    tokens: int = 0


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


# An extra pass under a collective forward (FSDP) moves the whole model once more: the bf16 weights
# all-gathered in each forward (GradCache's no-grad pass and its replay) and in the backward, and the
# fp32 gradients reduce-scattered, about 10 bytes per parameter; its compute is about 8 FLOPs per
# parameter per token (forward 2, replay 2, backward 4). So an extra pass is worth the padded
# positions whose compute takes as long as that traffic: positions = (10 / bandwidth) / (8 / FLOP/s),
# whatever the model's size. On paper (not yet measured), an H100 at 40 % of its bf16 peak: about
# 1,300 positions within a node (NVLink, ~370 GB/s per GPU), about 10,000 across nodes (~50 GB/s).
COLLECTIVE_BYTES_PER_PARAM = 10
PASS_FLOPS_PER_PARAM_TOKEN = 8
ACHIEVED_SHARE = 0.4
BANDWIDTH = {"node": 370e9, "network": 50e9}  # bytes/s per GPU
CPU_BF16_PASS_COST = 8192  # a 2-core AMX CPU's small bf16 matmuls (config: bucket_pass_cost)


def default_pass_cost(bf16: bool, collective: bool, peak_tflops: float | None, across_nodes: bool) -> int:
    """``bucket_pass_cost: auto``: under a collective forward with a known peak, the positions whose
    compute an extra pass's traffic costs; else 8192 under bf16 (overhead-bound small matmuls), 0 in fp32."""
    if collective and peak_tflops:
        seconds_per_position = PASS_FLOPS_PER_PARAM_TOKEN / (peak_tflops * 1e12 * ACHIEVED_SHARE)
        seconds_of_traffic = COLLECTIVE_BYTES_PER_PARAM / BANDWIDTH["network" if across_nodes else "node"]
        return round(seconds_of_traffic / seconds_per_position)
    return CPU_BF16_PASS_COST * bf16


def features(model: Any, group: TextGroup) -> dict[str, Tensor]:
    """The group's tokenized features (made by the batch source, or here when it made none)."""
    if group.features is None:
        group.features = model.tokenize(group.texts, group.instructions, group.max_length)
    return group.features


class Passes:
    """Plans and runs a micro-batch's passes for the trainer: ``forward`` is what encodes (the model,
    or the back end's wrapper), ``collective`` whether its forwards must pair up across ranks."""

    def __init__(self, model: Any, forward: Callable[[dict[str, Tensor]], Tensor], *, device: torch.device,
                 bf16: bool, stage: Any, packing: str, collective: bool, pass_cost: int | None = None):
        self.model, self.forward, self.device, self.bf16 = model, forward, device, bf16
        self.stage, self.packing, self.collective = stage, packing, collective
        auto = pass_cost if pass_cost is not None else default_pass_cost(bf16, collective, None, False)
        self.bucket_pass_cost = stage.bucket_pass_cost if stage.bucket_pass_cost is not None else auto
        self._padding_inputs: dict[str, Tensor] | None = None
        self.tokens = self.texts = 0  # non-padding tokens and texts encoded with a graph (throughput, MFU)

    @property
    def packs(self) -> bool:
        """``train.packing``: on, off, or auto = where the model's attention is a FlashAttention
        kernel (variable-length, no mask)."""
        return self.packing == "on" or (self.packing == "auto" and self.model.varlen_attention)

    def _packs(self, lengths: Tensor) -> bool:
        """Whether a group of texts of ``lengths`` goes as one packed pass: always where ``packs``;
        with ``packing: auto`` under a masked attention (SDPA, eager), where packing needs at most
        3/4 of the padded rows (``embed_core.model.packing.packing_pays``: short, length-skewed
        texts such as STS-B's; not 256-token passages, one to a row either way)."""
        return self.packs or (self.packing == "auto" and packing_pays(lengths.tolist()))

    @property
    def cached(self) -> bool:
        return self.stage.grad_cache_chunk is not None or self.stage.grad_cache_max_tokens is not None

    # -- planning ------------------------------------------------------------------------------
    def chunks(self, group: TextGroup) -> list[list[int]]:
        """GradCache's chunks of a text group, as indices: runs of ``grad_cache_chunk`` texts in
        order, or, with ``grad_cache_max_tokens``, texts by decreasing length packed while the chunk's
        padded size (texts × its longest) stays within the budget (and ``grad_cache_chunk`` texts,
        when set too): memory then follows tokens, not texts. A text over the budget is a chunk alone."""
        n = len(group.texts)
        if self.stage.grad_cache_max_tokens is None:
            most = min(n, self.stage.chunk_capacity(0))
            return [list(range(start, min(start + most, n))) for start in range(0, n, most)]
        lengths = features(self.model, group)["attention_mask"].sum(dim=1)
        chunks: list[list[int]] = []
        for i in torch.argsort(lengths, descending=True, stable=True).tolist():
            if chunks and len(chunks[-1]) < self.stage.chunk_capacity(int(lengths[chunks[-1][0]])):
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks

    def _split(self, name: str, feats: dict[str, Tensor], rows: Tensor) -> list[Pass]:
        """The passes of texts ``rows`` of a group: one packed pass, or length buckets."""
        picked = {k: v.index_select(0, rows) for k, v in feats.items()}
        lengths = picked["attention_mask"].sum(dim=1)
        packed = self.model.pack(picked) if self._packs(lengths) else None
        if packed is not None:
            return [Pass(name, rows, packed, int(lengths.sum()))]
        order = torch.argsort(lengths, descending=True, stable=True)
        bounds = length_buckets(lengths[order].tolist(), self.stage.length_buckets, self.bucket_pass_cost)
        out = []
        for start, end in bounds:
            idx = order[start:end]
            width = int(lengths[idx[0]])
            out.append(Pass(name, rows.index_select(0, idx),
                            {k: v.index_select(0, idx)[:, :width] for k, v in picked.items()}, int(lengths[idx].sum())))
        return out

    def local_plan(self, batch: TaskBatch) -> list[Pass]:
        """This rank's passes of the micro-batch, from its own texts alone (no collective, so the
        batch source's thread makes them while the step before trains); their tensors pinned on a
        CUDA run, so the step's copies to the device do not wait."""
        passes: list[Pass] = []
        for name, group in batch.groups.items():
            feats = features(self.model, group)
            for chunk in (self.chunks(group) if self.cached else [list(range(len(group.texts)))]):
                passes += self._split(name, feats, torch.tensor(chunk))
        if self.device.type == "cuda":
            for p in passes:
                p.inputs = {k: v.pin_memory() if isinstance(v, Tensor) else v for k, v in p.inputs.items()}
        return passes

    def plan(self, batch: TaskBatch) -> list[Pass]:
        """Every pass of the micro-batch (planned ahead or now), padded to the ranks' agreed count
        where forwards are collective (the one agreement: on the step's thread, in step order)."""
        passes = list(batch.passes) if batch.passes is not None else self.local_plan(batch)
        if self.collective:
            passes += [self._padding() for _ in range(max_over_ranks(len(passes)) - len(passes))]
        return passes

    def _padding(self) -> Pass:
        """A padding pass: the encoder on one short text (its inputs made once)."""
        if self._padding_inputs is None:
            feats = self.model.tokenize(["."], [None], 8)
            packed = self.model.pack(feats) if self.packs else None
            self._padding_inputs = packed if packed is not None else feats
        return Pass(None, None, self._padding_inputs)

    # -- running -------------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def _run(self, p: Pass) -> Tensor:
        # non_blocking: the batch source pins its tensors on a CUDA run (no copy waits for the GPU);
        # a packed pass's max_seqlen is a Python int (reading it back from the GPU would sync)
        inputs = {k: v.to(self.device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in p.inputs.items()}
        if p.group is None:
            # a padding pass leaves the random streams as it found them: its dropout masks must not
            # shift the real passes' masks of this and later steps, or a rank that needed padding (its
            # groups split into fewer passes than another rank's) would train unlike an unsharded run
            state = rng_state(self.device)
            try:
                return self.forward(inputs)
            finally:
                set_rng_state(state, self.device)
        if torch.is_grad_enabled():
            self.tokens += p.tokens
            self.texts += len(p.rows)
        return self.forward(inputs)

    @staticmethod
    def _assemble(passes: list[Pass], outs: list[Tensor]) -> dict[str, Tensor]:
        """Each group's embeddings in its input order, from its passes' outputs."""
        by_group: dict[str, tuple[list[Tensor], list[Tensor]]] = {}
        for p, out in zip(passes, outs):
            if p.group is not None:
                rows, parts = by_group.setdefault(p.group, ([], []))
                rows.append(p.rows)
                parts.append(out)
        return {name: torch.cat(parts).index_select(0, torch.argsort(torch.cat(rows)).to(parts[0].device))
                for name, (rows, parts) in by_group.items()}

    def embed(self, group: TextGroup) -> Tensor:
        """One group's embeddings in input order (its passes alone: no agreement, for callers
        outside a training step)."""
        passes = self._split("g", features(self.model, group), torch.arange(len(group.texts)))
        with self._autocast():
            return self._assemble(passes, [self._run(p) for p in passes])["g"]

    def forward_backward(self, batch: TaskBatch, loss_of: Callable[[dict[str, Tensor]], Tensor], scale: float,
                         backward: Callable[[Tensor, bool], None]) -> float:
        """Loss and gradients of one micro-batch; ``backward(loss, last)`` runs a backward pass
        (``last``: the micro-batch's last one, whose gradients the back end may reduce)."""
        self.tokens = self.texts = 0
        passes = self.plan(batch)
        if not self.cached:
            # one autocast region for all passes: autocast keeps the bf16 copies of the weights until
            # its outermost region exits, so per-pass regions would cast every weight once per pass
            with self._autocast():
                outs = [self._run(p) for p in passes]
            loss = loss_of(self._assemble(passes, outs))
            padding = [out for p, out in zip(passes, outs) if p.group is None]
            backward((loss + sum(0.0 * out.sum() for out in padding)) * scale, True)
            return float(loss.detach())
        return self._cached(passes, loss_of, scale, backward)

    def _cached(self, passes: list[Pass], loss_of: Callable[[dict[str, Tensor]], Tensor], scale: float,
                backward: Callable[[Tensor, bool], None]) -> float:
        # 1) every pass without a graph, remembering its RNG states (CPU and the device's: dropout on
        # CUDA draws from the CUDA generator of the device it runs on, the only one kept, as
        # sentence-transformers' RandContext keeps only its inputs' devices)
        states, outs = [], []
        with torch.no_grad(), self._autocast():
            for p in passes:
                states.append(rng_state(self.device))
                outs.append(self._run(p))
        cached = {name: t.detach().requires_grad_() for name, t in self._assemble(passes, outs).items()}
        # 2) the loss on the cached embeddings, gradients to the embeddings only (leaf tensors: no
        # parameter sees this backward, so it stays outside any back end's gradient hooks)
        loss = loss_of(cached)
        (loss * scale).backward()
        grads = {name: t.grad for name, t in cached.items()}
        # 3) replay each pass with a graph (same RNG states: same dropout masks) and push its cached
        # gradient through the encoder: sum(out * g) has exactly that gradient; a padding pass's
        # gradient is zero
        after = rng_state(self.device)
        for i, (p, state) in enumerate(zip(passes, states)):
            set_rng_state(state, self.device)
            with self._autocast():
                out = self._run(p)
            g = grads[p.group].index_select(0, p.rows.to(self.device)).float() if p.group is not None else 0.0
            backward((out.float() * g).sum(), i == len(passes) - 1)
        set_rng_state(after, self.device)
        return float(loss.detach())

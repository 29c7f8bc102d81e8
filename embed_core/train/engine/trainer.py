"""The trainer: task-routed steps over dataset-grouped batches, with exact resume.

One optimizer step = ``grad_accum`` micro-batches, each drawn by the grouped sampler from one
dataset; the batch's task picks its loss (``embed_core.losses``: QZhou's InfoNCE, CLS InfoNCE or
CoSENT unless the stage names another per task; with ``train.matryoshka`` it is summed over the
embedding's prefix dimensions, ``embed_core.losses.matryoshka``). AdamW with weight decay (not on biases /
LayerNorm), linear warm-up then cosine / linear decay, gradient clipping, bf16 autocast on CUDA and
on CPUs with native bf16, optional gradient checkpointing and GradCache.

What is not the loop lives beside it, one concern a module:
* ``embed_core.train.engine.passes``: a micro-batch's encoder passes (length buckets, packing, GradCache),
  and the agreement that keeps every rank's passes paired where forwards are collective;
* ``embed_core.train.engine.backends``: plain, FSDP and DeepSpeed, one small interface (wrap, backward,
  step, state); the loop below has no branch on the back end;
* ``embed_core.train.engine.checkpoint``: ``<run_dir>/checkpoints/<stage>/step-N/``, exact resume.

Under ``torch.distributed`` every rank draws the same dataset at a step and takes its own slice;
each loss all-gathers (with gradients, ``torch.distributed.nn.all_gather``) what it wants shared:
retrieval losses gather queries and documents so every rank's queries see all ranks' documents;
CLS and CoSENT batches stay local. The records each step consumed (``consumed``, the stage's
lineage) are not in a checkpoint: a resume draws them again (``embed_core.train.engine.lineage.replay``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from embed_core import numbers
from embed_core.errors import ConfigError
from embed_core.losses import Loss, LossContext, loss_for
from embed_core.losses.matryoshka import Matryoshka
from embed_core.model.bulk_dropout import use_bulk_dropout
from embed_core.model.embedder import Embedder
from embed_core.model.encoder import use_tf32, uses_bf16
from embed_core.model.packing import resolve_attention
from embed_core.progress import Progress
from embed_core.train.engine import checkpoint
from embed_core.train.engine.backends import backend_for
from embed_core.schema import INFONCE_TASKS
from embed_core.losses.batch import TaskBatch
from embed_core.train.engine.batches import DatasetRecords, build_batch
from embed_core.train.config import TrainConfig, TrainStageConfig
from embed_core.dist.distributed import broadcast_from_main, init_process_group, mean_over_ranks, wait_for_main
from embed_core.train.engine.lineage import Consumed, consumed_positions, replay
from embed_core.train.engine.outcome import FitOutcome
from embed_core.train.engine.passes import Passes, default_pass_cost
from embed_core.train.engine.prefetch import BatchSource
from embed_core.train.engine.sampling import Batch, GroupedBatchSampler, origin_factors
from embed_core.train.engine.telemetry import FlopModel, device_peak_tflops, peak_memory
from embed_core.dist.world import spans_nodes

CHECKPOINT_PREFIX = checkpoint.PREFIX


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


def _multipliers(stage: TrainStageConfig, datasets: dict[str, DatasetRecords]) -> dict[str, float]:
    """The sampler's dataset multipliers: ``dataset_weight`` times, with ``origin_weight`` set, the
    mean origin weight of the dataset's records (``sampling.origin_factors``)."""
    if not stage.origin_weight:
        return stage.dataset_weight
    import pyarrow.compute as pc

    origins = {n: {v["values"]: v["counts"] for v in pc.value_counts(d.cols["origin"]._array).to_pylist()}
               for n, d in datasets.items()}
    factors = origin_factors(origins, stage.origin_weight)
    return {n: stage.dataset_weight.get(n, 1.0) * factors[n] for n in datasets}


def encoder_settings(train: TrainConfig, init_model: str) -> dict[str, Any]:
    """The ``Embedder`` settings a stage's model is loaded with (pooling, lengths, template,
    attention direction, EOS), whether it then trains or is kept untrained (``embed_core.train.start_model``)."""
    return {"pooling": train.pooling, "max_length": train.max_length, "instruction_template": train.instruction_template,
            "exclude_instruction_from_pooling": train.exclude_instruction_from_pooling,
            "bidirectional": train.bidirectional,
            "gguf_file": train.gguf_file if init_model == train.base_model else None, "append_eos": train.append_eos}


class Trainer:
    def __init__(self, train: TrainConfig, stage: TrainStageConfig, datasets: dict[str, DatasetRecords], *,
                 init_model: str, checkpoint_dir: Path, seed: int = 42, log: Callable[[str], None] = print):
        self._init_run(train, stage, seed, log)
        self.datasets = datasets
        t = time.perf_counter()
        # under sharding only rank 0 reads the checkpoint; the others build the model on the meta
        # device and get their shards from rank 0 (Backend.place)
        model = Embedder(init_model, **encoder_settings(train, init_model),
                         gradient_checkpointing=stage.gradient_checkpointing,
                         lora=train.lora.model_dump() if train.lora else None,
                         # a LoRA base is frozen: loaded straight into its storage dtype
                         torch_dtype=torch.bfloat16 if train.weights_dtype == "bf16" and train.lora else None,
                         attn_implementation=resolve_attention(train.attention, self.device.type),
                         meta=not backend_for(train).reads_weights(self.rank))
        self.log(f"{stage.name}: loaded {init_model} (tokenizer and weights) in {time.perf_counter() - t:.1f} s")
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
        self.matryoshka = matryoshka_settings(train, stage, model.dim)
        ret = {n for n, d in datasets.items() if d.task in INFONCE_TASKS}
        sampler = GroupedBatchSampler(
            {n: d.size for n, d in datasets.items()},
            {n: stage.batch_of(d.task) * self.world for n, d in datasets.items()},
            alpha=stage.alpha, retrieval=ret, eta=stage.eta, seed=seed, alternate=stage.alternate_tasks,
            multipliers=_multipliers(stage, datasets))
        self._init_optimization(model, sampler, checkpoint_dir)
        if self.device.type != "cpu" and not self.backend.collective_forward:
            # again where it trains: the kernel chosen there (FlashAttention, SDPA's) must honour
            # is_causal=False too (a collective back end's ranks rely on the check made at load)
            self.model.check_bidirectional(bf16=self.bf16)
        self.lineage = True  # records consumed per step (embed_core.train.engine.lineage): records, not derived examples

    # -- set-up shared with the AutoRegEmbed trainer ---------------------------------------------
    def _init_run(self, train: TrainConfig, stage: TrainStageConfig, seed: int, log: Callable[[str], None]) -> None:
        """Seeds, process group position, device and precision (before any model is built)."""
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.train_cfg, self.stage, self.seed, self.log = train, stage, seed, log
        # a launched job's process group (gloo / nccl); FSDP needs one even for a single process
        self.rank, self.world = init_process_group(single=train.backend_name() == "fsdp", timeout_s=train.dist_timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        # auto: bf16 autocast on CUDA and on CPUs with native bf16 (AMX / AVX512-BF16: 2.8x the fp32
        # encoder throughput measured on a 2-core Xeon with AMX); fp32 elsewhere, and where a test
        # needs bit-exact resumes it pins precision: fp32
        self.bf16 = uses_bf16(train.precision, self.device.type)
        use_tf32(train.tf32, self.device.type)
        if train.weights_dtype == "bf16" and not self.bf16:
            raise ConfigError(f"train.weights_dtype: bf16 needs bf16 compute, and precision {train.precision!r} is fp32 "
                              f"on this device ({self.device.type}); use weights_dtype: fp32 here")

    def _init_optimization(self, model: torch.nn.Module, sampler: GroupedBatchSampler, checkpoint_dir: Path) -> None:
        """The trained model on its device inside its back end (which builds AdamW and the
        schedule), the encoder passes, the sampler and the step counters."""
        t = time.perf_counter()
        model.train()
        if self.device.type == "cpu":
            # torch's CPU dropout draws its masks one element at a time (18 % of a step on
            # 256-token passages on a small CPU; embed_core.model.bulk_dropout)
            use_bulk_dropout(model)
        self.backend = backend_for(self.train_cfg)(model, self.stage, self.train_cfg, device=self.device,
                                                   bf16=self.bf16, rank=self.rank, world=self.world)
        self.model = self.backend.place()  # on its device (sharded first where the back end shards)
        self.backend.wrap(lr_lambda(self.stage))
        self.rank, self.world = self.backend.rank, self.backend.world
        self.optimizer, self.scheduler = self.backend.optimizer, self.backend.scheduler
        self.log(f"{self.stage.name}: model placed on {self.device.type} and wrapped by the "
                 f"{self.train_cfg.backend_name()} back end (with its optimizer) in {time.perf_counter() - t:.1f} s")
        self.peak_tflops = device_peak_tflops(self.device, self.bf16, self.train_cfg.peak_tflops)
        collective = self.backend.collective_forward
        self.passes = Passes(self.model, self.backend.forward, device=self.device, bf16=self.bf16, stage=self.stage,
                             packing=self.train_cfg.packing, collective=collective,
                             pass_cost=default_pass_cost(self.bf16, collective, self.device.type == "cuda"
                                                         and self.peak_tflops, spans_nodes()))
        self.sampler = sampler
        self.batches = BatchSource(sampler, self._build, prefetch=self.train_cfg.prefetch)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.stage = self.stage.model_copy(update={"keep_checkpoints": kept_checkpoints(
            self.stage, checkpoint_bytes(self.model), self.checkpoint_dir, self.log)})
        self.step = 0
        self.batch_wait = 0.0  # of the last step: seconds it waited for its micro-batches
        self.flops = FlopModel(self.model, getattr(getattr(self.model, "model", None), "config", None))
        self.metrics: list[dict[str, Any]] = []
        self.lineage = False
        self.consumed: list[Consumed] = []  # (step, dataset, positions) per micro-batch trained
        self.dev_evaluator = None  # embed_core.train.dev.DevEvaluator, set by the stage when it has dev tasks
        self.dev_rows: list[dict[str, Any]] = []  # one row per (evaluation step, dev task)
        self.best: dict[str, Any] | None = None  # {"step", "score"} of the best dev selection score so far

    # -- a micro-batch -------------------------------------------------------------------------
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
        self.loss_counts = ctx.counts  # what the loss counted (false negatives masked): the step's row
        loss = self.losses[batch.task]
        return (Matryoshka(loss, *self.matryoshka) if self.matryoshka else loss)(emb, batch, ctx)

    def _forward_backward(self, batch: TaskBatch, scale: float, last: bool = True) -> float:
        """Loss and gradients of one micro-batch (``embed_core.train.engine.passes``); ``last``: the step's
        last micro-batch, whose last backward pass completes the step's gradients."""
        return self.passes.forward_backward(batch, lambda emb: self._loss(batch, emb), scale,
                                            lambda loss, final: self.backend.backward(loss, last and final))

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
        batch.passes = self.passes.local_plan(batch)
        batch.positions = consumed_positions(drawn.indices, self.world)
        if s.origin_weight:
            batch.weights = [s.origin_weight.get(records.cols["origin"][i], 1.0) for i in self._slice(drawn.indices)]
        return batch

    # -- a step --------------------------------------------------------------------------------
    def train_step(self) -> list[dict[str, Any]]:
        s = self.stage
        t0 = time.perf_counter()
        rows = []
        self.batch_wait = 0.0  # seconds this step waited for its micro-batches (built ahead when prefetching)
        for micro in range(s.grad_accum):
            t = time.perf_counter()
            batch = self.batches.get(self.step * s.grad_accum + micro)
            self.batch_wait += time.perf_counter() - t
            self.consumed.append((self.step + 1, batch.dataset, batch.positions))
            self.loss_counts: dict[str, int] = {}
            value = mean_over_ranks(self._forward_backward(batch, self.backend.loss_scale(),
                                                           last=micro == s.grad_accum - 1))
            rows.append({"dataset": batch.dataset, "task": batch.task, "loss": value, "examples": batch.size,
                         "tokens": self.passes.tokens, "texts": self.passes.texts, **self.loss_counts})
            self.backend.micro_batch_done()
        self._optimizer_step()
        return self._record_step(rows, t0)

    def _optimizer_step(self) -> None:
        self.backend.step()

    def _record_step(self, rows: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
        """Count the finished optimizer step and turn its micro-batch rows into metric rows."""
        s = self.stage
        seconds = time.perf_counter() - t0
        self.step += 1
        lr = self.scheduler.get_last_lr()[0]
        tokens = sum(r["tokens"] for r in rows)
        examples = sum(r["examples"] for r in rows)
        telemetry = {"grad_norm": self.backend.grad_norm, **peak_memory(self.device),
                     "mfu": self.flops.mfu(tokens, sum(r.get("texts", 0) for r in rows), seconds, self.peak_tflops)}
        out = [{"stage": s.name, "step": self.step, **r, "lr": lr, "seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds else 0.0,
                "examples_per_s": examples / seconds if seconds else 0.0, **telemetry} for r in rows]
        self.metrics += out
        return out

    # -- checkpoints (embed_core.train.engine.checkpoint) ----------------------------------------------
    def save_checkpoint(self) -> Path:
        return checkpoint.save(self)

    def checkpoints(self) -> list[Path]:
        return checkpoint.complete(self.checkpoint_dir)

    def load_checkpoint(self, path: Path) -> None:
        meta = checkpoint.load(self, path)
        self.batches.reset()  # the micro-batch drawn ahead belongs to the run before the resume
        self.sampler.load_state_dict(meta["sampler"])  # PCG64 state is plain ints: JSON round-trips it
        self.step = meta["step"]
        if self.lineage:  # the steps before the checkpoint, drawn again (the sampler is deterministic)
            self.consumed = replay(self.sampler, self.step, self.stage.grad_accum, self.world)
        self.metrics = meta["metrics"]
        self.dev_rows = meta.get("dev", [])
        self.best = meta.get("best")

    def consolidated_state(self) -> dict[str, Tensor] | None:
        """The encoder's whole weights for the committed model in ``train.save_dtype`` where the back
        end holds them in parts or they are saved in another dtype than trained (every rank calls it;
        rank 0 gets them); None: the model saves its own."""
        dtype = save_dtype(self.train_cfg, self.model)
        state = self.backend.consolidated_state(dtype)
        if state is None and dtype != torch.float32 and self.rank == 0 and isinstance(self.model, Embedder):
            state = {k: v.detach().to(device="cpu", dtype=dtype) if v.is_floating_point() else v
                     for k, v in self.model.model.state_dict().items()}
        return state

    # -- the loop ------------------------------------------------------------------------------
    def fit(self, *, resume: bool = False) -> FitOutcome:
        """Train to ``stage.steps`` (from the newest checkpoint with ``resume``); every rank calls it."""
        if resume and self.checkpoints():
            latest = self.checkpoints()[-1]
            self.load_checkpoint(latest)
            self.log(f"resumed from {latest} (step {self.step})")
        progress = Progress(f"train {self.stage.name}", total=self.stage.steps - self.step, unit="steps",
                            logger=logging.getLogger("embedpipe.train"))
        first = self.step
        while self.step < self.stage.steps:
            t = time.perf_counter()
            rows = self.train_step()
            if self.step == first + 1:  # its micro-batches were built and tokenized while it waited
                self.log(f"{self.stage.name}: first step in {time.perf_counter() - t:.1f} s, "
                         f"{self.batch_wait:.1f} s of it building and tokenizing its batch")
            progress.update(loss=numbers.loss(rows[-1]['loss']) if rows else "-",
                            **({"tok/s": f"{rows[-1]['tokens_per_s']:.0f}"} if rows else {}))
            # the last step's figures are in the progress line that closes the loop: not said twice
            if self.step % self.stage.log_every == 0 and self.step != self.stage.steps:
                r = rows[-1]
                self.log(f"{self.stage.name} step {self.step}/{self.stage.steps} {r['dataset']} ({r['task']}) "
                         f"loss {numbers.loss(r['loss'])} lr {r['lr']:.2e} {r['tokens_per_s']:.0f} tok/s" + _telemetry_line(r))
            if self.dev_evaluator is not None and (self.step % self.stage.dev.eval_every == 0
                                                   or self.step == self.stage.steps):
                self.evaluate_dev()
            if self.step % self.stage.checkpoint_every == 0:
                self.save_checkpoint()
        progress.close()
        self.batches.close()
        self._keep_best()
        return self.outcome()

    def outcome(self) -> FitOutcome:
        """What the run trained, for the commit: every rank calls it (FSDP gathers the whole weights)."""
        select_best = self.best is not None and self.stage.dev is not None and self.stage.dev.select == "best"
        return FitOutcome(steps=self.step, metrics=self.metrics, dev_rows=self.dev_rows, best=self.best,
                          selected_step=self.best["step"] if select_best else self.step,
                          consumed=self.consumed if self.lineage else None, world=self.world, device=self.device,
                          bf16=self.bf16, model=self.model, state=self.consolidated_state())

    # -- dev evaluation ------------------------------------------------------------------------
    @property
    def _evaluates(self) -> bool:
        """This rank scores dev tasks: rank 0, or every rank where forwards are collective."""
        return self.rank == 0 or self.backend.collective_forward

    def _best_path(self, step: int) -> Path:
        return self.checkpoint_dir / "best" / f"step-{step:07d}.pt"

    def _keep_best(self) -> None:
        if self.dev_evaluator is not None and self.stage.dev.select == "best" and self.best is not None \
                and self.best["step"] != self.step and self._evaluates:
            self.backend.load_weights(self._best_path(self.best["step"]))
            self.log(f"{self.stage.name}: keeping the weights of step {self.best['step']} (best dev score "
                     f"{numbers.score(self.best['score'])}), not the last step's")

    def evaluate_dev(self) -> None:
        """Score the dev tasks (rank 0; the others wait at the patient barrier, not in the next
        step's collective, which would time out on a long evaluation; where forwards are collective
        every rank encodes and rank 0's scores count), log them, and keep the weights when the
        selection score is the best so far."""
        collective = self.backend.collective_forward
        if not self._evaluates:
            wait_for_main()
            return
        rng = checkpoint.rng_state()  # mteb seeds the global RNGs: training must not depend on whether it evaluates
        try:
            scores = self.dev_evaluator.score(self.model, bf16=self.bf16)
        finally:
            checkpoint.set_rng_state(rng)
        scores = broadcast_from_main(scores) if collective else scores
        if not collective:
            wait_for_main()
        selection = self.dev_evaluator.selection_score(scores)
        if math.isnan(selection):
            selection = float("-inf")  # a diverged or constant model never becomes the best
        for task, value in scores.items():
            self.dev_rows.append({"stage": self.stage.name, "step": self.step, "task": task, "score": value,
                                  "selection": selection})
        (self.log if self.rank == 0 else log_debug)(
            f"{self.stage.name} step {self.step} dev: " + ", ".join(f"{t} {numbers.score(v)}" for t, v in scores.items())
            + f" (selection {numbers.score(selection)}" + (f", best {numbers.score(self.best['score'])} at step {self.best['step']})"
                                                if self.best else ")"))
        if self.best is None or selection > self.best["score"]:
            self.best = {"step": self.step, "score": selection}
            if self.stage.dev.select == "best":
                # one file per step, named in `best`: a resume restores the `best` of its checkpoint
                # together with the file it names, whatever was written after that checkpoint
                path = self._best_path(self.step)
                path.parent.mkdir(parents=True, exist_ok=True)
                self.backend.save_weights(path)


def matryoshka_settings(train: TrainConfig, stage: TrainStageConfig, hidden: int) -> tuple[list[int], list[float]] | None:
    """(dims, weights) of the stage's Matryoshka loss, or None; a dimension above the model's
    embedding size is refused here, where the size is known."""
    mrl = train.matryoshka_of(stage)
    if mrl is None:
        return None
    where = "stages[" + stage.name + "].matryoshka" if stage.matryoshka is not None else "matryoshka"
    too_big = [d for d in mrl.dims if d > hidden]
    if too_big:
        raise ConfigError(f"train.{where}.dims: {too_big} above the model's embedding size {hidden} "
                          f"(dims must be at most {hidden})")
    return list(mrl.dims), list(mrl.weights)


def _telemetry_line(row: dict[str, Any]) -> str:
    """`` grad norm 0.84, peak 1234 MB, MFU 31.2 %`` (what a step row has of them)."""
    parts = []
    if row.get("grad_norm") is not None:
        parts.append(f"grad norm {row['grad_norm']:.3g}")
    parts.append(f"peak {row['peak_memory_mb']:.0f} MB")
    if row.get("peak_reserved_mb") is not None:
        parts[-1] += f" ({row['peak_reserved_mb']:.0f} MB reserved)"
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f} %")
    return ", " + ", ".join(parts)


def log_debug(message: str) -> None:
    logging.getLogger("embedpipe.train").debug(message)


def save_dtype(train: TrainConfig, model: torch.nn.Module) -> torch.dtype:
    """The committed model's weight dtype (``train.save_dtype``; auto: bf16 for a decoder LM, fp32
    otherwise). A LoRA model's merged weights stay fp32 (``merged_lora_state_dict``)."""
    from embed_core.model.files import is_decoder_type

    if train.lora:
        return torch.float32
    if train.save_dtype != "auto":
        return torch.bfloat16 if train.save_dtype == "bf16" else torch.float32
    config = getattr(getattr(model, "model", None), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return torch.bfloat16 if is_decoder_type(getattr(text, "model_type", "")) else torch.float32


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """Bytes of one resumable checkpoint of ``model`` (all ranks' files together): every weight in
    its stored dtype, and AdamW's two fp32 moments per trained one (``embed_core.train.plan``
    computes the same from the model's shape)."""
    return sum(p.numel() * p.element_size() + (8 * p.numel() if p.requires_grad else 0) for p in model.parameters())


def kept_checkpoints(stage: TrainStageConfig, each: int, directory: Path, log: Callable[[str], None]) -> int:
    """``stage.keep_checkpoints``, sized to the checkpoint directory's free space (rank 0's view,
    the same on every rank): while one is written, ``keep`` complete ones still exist, so ``keep +
    1`` checkpoints (or as many as the stage writes) must fit; else 1 is kept, with a warning line.
    Where not even that fits, a warning line says so before any step; the stage still starts (free
    space changes while a run goes on, and a checkpoint that does not fit ends the run with one line,
    the last complete checkpoint kept: ``checkpoint.checkpoint_write``)."""
    import shutil

    keep, written = stage.keep_checkpoints, stage.steps // stage.checkpoint_every
    if written == 0:
        return keep
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = broadcast_from_main(shutil.disk_usage(probe).free)
    gib = 2 ** 30
    if each * min(keep + 1, written) <= free:
        return keep
    if each * min(2, written) > free:
        log(f"warning: {stage.name}: a checkpoint of this model takes {each / gib:.2f} GiB and {free / gib:.2f} GiB are "
            f"free under {directory}, not enough for {'one and the one being written' if written > 1 else 'one'}: "
            f"the stage stops at step {stage.checkpoint_every} unless space is freed or the run directory moved")
        return 1
    log(f"warning: {stage.name}: keeping 1 checkpoint, not {keep}: {keep + 1} of {each / gib:.2f} GiB "
        f"do not fit the {free / gib:.2f} GiB free under {directory}")
    return 1

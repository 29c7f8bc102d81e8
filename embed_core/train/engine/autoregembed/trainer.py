"""The AutoRegEmbed trainer: the pipeline's :class:`~embed_core.train.engine.trainer.Trainer` (AdamW,
warm-up + decay, clipping, checkpoints with exact resume, seeded sampling) with the compression
encoder as its model, a frozen decoder beside it and the two stage losses.

* ``autoregembed_ic``: L_IC on (context, I_self) → context, one forward through encoder and decoder.
* ``autoregembed_cda``: per example three kinds of encoder→decoder passes (the authors' code):
  log p(d⁺ | e_{q,I_next}), log p(d⁺ | e_{d⁺,I_self}) and log p(d⁻ᵢ | e_{q,I_next}) for each negative;
  L_CDA against reference scores precomputed with the stage's initial (stage-1) encoder.

The frozen decoder is not a submodule of the model, so it is neither optimised nor checkpointed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from embed_core.train.config import TrainConfig, TrainStageConfig
from embed_core.errors import ConfigError
from embed_core.losses.autoregembed import cda_loss, ic_loss
from embed_core.train.engine.autoregembed.data import CDAExample, ICExample
from embed_core.train.engine.autoregembed.model import CompressionEncoder, FrozenDecoder
from embed_core.train.engine.sampling import GroupedBatchSampler
from embed_core.train.engine.trainer import Trainer

DATASET = "autoregembed"


class AutoRegEmbedTrainer(Trainer):
    def __init__(self, train: TrainConfig, stage: TrainStageConfig, examples: list[ICExample] | list[CDAExample], *,
                 init_model: str, decoder_model: str, checkpoint_dir: Path, seed: int = 42,
                 log: Callable[[str], None] = print, reference: tuple[Tensor, Tensor] | None = None,
                 objective: str | None = None):
        """``objective``: ``ic`` or ``cda`` (``OBJECTIVES``; the mode table names it, by default the
        stage mode's suffix)."""
        if train.backend_name() == "deepspeed":
            raise ConfigError(f"train stage {stage.name}: AutoRegEmbed modes run without DeepSpeed (unset train.deepspeed)")
        self._init_run(train, stage, seed, log)
        self.cfg = train.autoregembed
        self.examples = examples
        self.reference = reference
        self.objective = OBJECTIVES[objective or stage.mode.removeprefix("autoregembed_")]
        model = CompressionEncoder(init_model, compress_tokens=self.cfg.compress_tokens,
                                        max_length=self.cfg.context_max_length,
                                        instruction_template=self.cfg.instruction_template,
                                        lora=train.lora.model_dump() if train.lora else None,
                                        gradient_checkpointing=stage.gradient_checkpointing)
        self.decoder = FrozenDecoder(decoder_model, target_max_length=self.cfg.target_max_length).to(self.device)
        batch = stage.batch_of("autoregembed")
        sampler = GroupedBatchSampler({DATASET: len(examples)}, {DATASET: batch * self.world}, seed=seed)
        self._init_optimization(model, sampler, checkpoint_dir)

    # -- passes --------------------------------------------------------------------------------
    def _compress(self, texts: list[str], instructions: list[str]) -> Tensor:
        features = {k: v.to(self.device) for k, v in self.model.tokenize(texts, instructions).items()}
        if torch.is_grad_enabled():
            self._tokens += int(features["attention_mask"].sum())
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return self.model.compress(features)

    def _logprob(self, prefix: Tensor, targets: list[str]) -> Tensor:
        ids, mask = self.decoder.targets(targets)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return self.decoder.sequence_logprob(prefix, ids.to(self.device), mask.to(self.device))

    def ic_loss(self, batch: list[ICExample]) -> Tensor:
        prefix = self._compress([e.context for e in batch], [e.instruction for e in batch])
        ids, mask = self.decoder.targets([e.target for e in batch])
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            token_lp = self.decoder.token_logprobs(prefix, ids, mask)
        return ic_loss(token_lp, mask)

    def cda_logprobs(self, batch: list[CDAExample]) -> tuple[Tensor, Tensor, Tensor]:
        """(log p(d⁺|e_q) [B], log p(d⁺|e_d⁺) [B], log p(d⁻ᵢ|e_q) [B, K]) under the current encoder."""
        e_q = self._compress([e.query for e in batch], [e.query_instruction for e in batch])
        e_d = self._compress([e.positive for e in batch], [e.positive_instruction for e in batch])
        positives = [e.positive for e in batch]
        lp_q_pos = self._logprob(e_q, positives)
        lp_self = self._logprob(e_d, positives)
        k = len(batch[0].negatives)
        negatives = [n for e in batch for n in e.negatives]  # row-major [B, K]
        lp_q_neg = self._logprob(e_q.repeat_interleave(k, dim=0), negatives).view(len(batch), k)
        return lp_q_pos, lp_self, lp_q_neg

    @torch.no_grad()
    def reference_scores(self, batch_size: int = 16) -> tuple[Tensor, Tensor]:
        """log p_ref(d⁺|e_q) [N] and log p_ref(d⁻ᵢ|e_q) [N, K] with the encoder as it is now (call
        before training: the stage's initial, stage-1 model is the reference)."""
        was_training = self.model.training
        self.model.eval()
        pos, neg = [], []
        for start in range(0, len(self.examples), batch_size):
            batch = self.examples[start:start + batch_size]
            e_q = self._compress([e.query for e in batch], [e.query_instruction for e in batch])
            pos.append(self._logprob(e_q, [e.positive for e in batch]).float().cpu())
            k = len(batch[0].negatives)
            neg.append(self._logprob(e_q.repeat_interleave(k, dim=0), [n for e in batch for n in e.negatives])
                       .float().view(len(batch), k).cpu())
        self.model.train(was_training)
        return torch.cat(pos), torch.cat(neg)

    def batch_loss(self, indices: list[int]) -> Tensor:
        """The stage's objective (``OBJECTIVES``: L_IC or L_CDA) on the examples at ``indices``."""
        return self.objective(self, [self.examples[i] for i in indices], indices)

    def _ic_batch(self, batch: list[ICExample], indices: list[int]) -> Tensor:
        return self.ic_loss(batch)

    def _cda_batch(self, batch: list[CDAExample], indices: list[int]) -> Tensor:
        if self.reference is None:
            raise ConfigError("autoregembed_cda: reference scores were not computed (call reference_scores first)")
        lp_q_pos, lp_self, lp_q_neg = self.cda_logprobs(batch)
        rows = torch.tensor(indices)
        ref_pos, ref_neg = (r[rows].to(self.device) for r in self.reference)
        return cda_loss(lp_q_pos.float(), lp_self.float(), lp_q_neg.float(), ref_pos, ref_neg, beta=self.cfg.beta,
                        tau=self.cfg.tau, squash=self.cfg.squash, reference_sign=self.cfg.reference_sign)

    def train_step(self) -> list[dict[str, Any]]:
        s = self.stage
        t0 = time.perf_counter()
        rows = []
        for _ in range(s.grad_accum):
            self._tokens = 0
            drawn = self.sampler.next_batch()
            indices = self._slice(drawn.indices)
            loss = self.batch_loss(indices)
            (loss / s.grad_accum).backward()
            rows.append({"dataset": DATASET, "task": s.mode, "loss": float(loss.detach()), "examples": len(indices),
                         "tokens": self._tokens})
        self._optimizer_step()
        return self._record_step(rows, t0)


# the method's two losses: L_IC (stage 1) and L_CDA (stage 2); embed_core.train.modes picks one per mode
OBJECTIVES: dict[str, Callable[..., Tensor]] = {"ic": AutoRegEmbedTrainer._ic_batch,
                                                "cda": AutoRegEmbedTrainer._cda_batch}

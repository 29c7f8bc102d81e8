"""The train stage's config section: the base model, LoRA, AutoRegEmbed, and the training stages
with their losses, sampling and dev evaluation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from embed_core.config_base import StrictModel
from embed_core.datavalue.config import DataValueConfig
from embed_core.errors import ConfigError
from embed_core.scoring.config import EvalTaskSpec
from embed_core.mine.config import check_remine_keys
from embed_core.synthesize.config import TargetedConfig
from embed_core.train.modes import mode_of

# A task without a batch_size entry (e.g. one a stage's `tasks` adds, or autoregembed): the
# paper's batch of 32 (AutoRegEmbed §4.1).
UNLISTED_BATCH = 32
UNBOUNDED = 1 << 62


class LoraSettings(StrictModel):
    """LoRA adapters (peft) on the base model's linear layers; the saved model has them merged, so it
    loads with plain ``transformers``."""

    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling α (the update is scaled by α / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA path.")
    target_modules: list[str] | str = Field("all-linear", description="peft target_modules ('all-linear' = every "
                                            "linear layer except the output head).")


class AutoRegEmbedConfig(StrictModel):
    """AutoRegEmbed (autoregembed.txt §3; methods notes part B): k compression tokens appended after
    text + instruction, their last hidden states the embedding and a frozen decoder's prefix.
    Defaults are the paper's (k 5, τ 0.05, β 0.1, sigmoid, one negative, the Table 5 instructions)."""

    compress_tokens: int = Field(5, ge=1, description="k compression tokens (EMBED0 .. EMBED{k-1}, each in angle brackets).")
    context_max_length: int = Field(128, ge=8, description="Encoder input tokens (text + instruction + k).")
    target_max_length: int = Field(64, ge=4, description="Decoder target tokens (plus EOS).")
    decoder: str | None = Field(None, description="Frozen decoder (a causal LM path); None = the base model.")
    beta: float = Field(0.1, gt=0, description="CDA β (DPO-style scale).")
    tau: float = Field(0.05, gt=0, description="CDA temperature τ (the public run script uses 0.1).")
    squash: Literal["sigmoid", "tanh", "logsigmoid"] = Field(
        "sigmoid", description="CDA bounding function (paper: sigmoid; Appendix B/C: tanh, log-sigmoid).")
    reference_sign: Literal["paper", "repo"] = Field(
        "paper", description="CDA S₂'s reference term: 'paper' subtracts β(log p_ref(d⁺) − log p_ref(d⁻)) (DPO), "
        "'repo' adds it, as the authors' code does.")
    num_negatives: int = Field(1, ge=1, description="CDA negatives per example (paper's NLI runs: 1).")
    positive_level: float = Field(0.8, gt=0, le=1, description="CDA: a scored pair is a positive when its score is "
                                  "at least this share of the dataset's highest score.")
    sts_instruction: str = Field("This sentence means in one word: \u201c", description="I_next = I_self for "
                                 "symmetric tasks (Table 5).")
    query_instruction: str = Field("Use one word to represent the query in a retrieval task. The word is: \u201c",
                                   description="Retrieval I_next (queries).")
    passage_instruction: str = Field("Use one word to represent the passage in a retrieval task. The word is: "
                                     "\u201c", description="Retrieval I_self (passages).")
    instruction_template: str = Field("{text}\n{instruction}\n", description="Encoder text before the k tokens "
                                      "(the authors' layout: text, newline, instruction, newline).")


TrainMode = Literal["contrastive", "autoregembed_ic", "autoregembed_cda"]


# Flat loss fields of configs before the loss registry: old key -> (task, loss, parameter), for
# the error that says what to write instead.
MOVED_LOSS_FIELDS: dict[str, tuple[str, str, str]] = {
    "tau": ("retrieval", "infonce", "tau"), "query_negatives": ("retrieval", "infonce", "query_negatives"),
    "cosent_tau": ("sts", "cosent", "tau"), "bce_scale": ("retrieval", "pair_bce", "scale"),
    "bce_bias": ("retrieval", "pair_bce", "bias"), "bce_bias_warmup_from": ("retrieval", "pair_bce", "bias_warmup_from"),
    "bce_cutoff": ("retrieval", "pair_bce", "cutoff"), "hmcl_tau": ("retrieval", "hmcl", "tau"),
    "hmcl_weights": ("retrieval", "hmcl", "mu_c/mu_l/mu_e/mu_ed"), "hmcl_levels": ("sts", "hmcl", "levels"),
    "num_positives": ("retrieval", "codiemb_ir", "num_positives"), "codiemb_sts_tau": ("sts", "codiemb_sts", "tau"),
    "codiemb_sts_weights": ("sts", "codiemb_sts", "pearson_weight/rank_kl_weight/pro_weight")}


class DevTaskSpec(EvalTaskSpec):
    """A dev task: declared like an evaluation task (a local file or BEIR directory in ``path``), or
    ``dataset: {name}`` for the dev records prepare set aside for that dataset (sts, nli and
    pair_classification records become an sts task, retrieval records a retrieval task over their
    positives and negatives, classification records a classification task: their texts evaluated,
    the classifier fitted on the labelled positives and negatives they carry)."""

    path: str | list[str] = Field("", description="Task data as for evaluate tasks (unused with dataset).")
    dataset: str | None = Field(None, description="Use prepare's dev records of this dataset (prepare/dev/{name}.parquet).")
    weight: float = Field(1.0, ge=0, description="Weight of this task's main score in the selection score.")

    @model_validator(mode="after")
    def _data(self) -> DevTaskSpec:
        if not self.dataset and not self.path:
            raise ValueError(f"dev task {self.name!r}: give path (a task file) or dataset (prepare's dev records)")
        return self


class DevConfig(StrictModel):
    """Evaluation on dev tasks while a stage trains (never on evaluate's test sets), and which
    weights the stage keeps."""

    tasks: list[DevTaskSpec] = Field(min_length=1, description="Dev tasks, scored every eval_every steps.")
    eval_every: int = Field(100, ge=1, description="Score the dev tasks every this many steps (and at the last step).")
    max_rows: int | None = Field(500, ge=1, description="Rows (pairs, queries, texts) per dev task unless the task "
                                 "sets max_rows; None = all.")
    select: Literal["best", "last"] = Field("best", description="best: the stage's model is the weights with the "
                                            "highest weighted dev score; last: the final step's.")


class MergeSpec(StrictModel):
    """Average the stage's trained weights with an earlier stage's (WiSE-FT, Wortsman et al. 2022):
    the saved model is (1 − weight) × this stage's weights + weight × that stage's."""

    stage: str = Field(description="The earlier training stage whose model's weights are averaged in.")
    weight: float = Field(0.5, gt=0, lt=1, description="Its share of the average (0.5: the plain mean).")


class MatryoshkaConfig(StrictModel):
    """Matryoshka representation learning (Kusupati et al. 2022; sentence-transformers'
    ``MatryoshkaLoss``): every task's loss is applied to the embeddings cut to each of ``dims``
    (their first d coordinates, L2-normalised again) and the weighted sum is trained, so a prefix
    of the embedding is an embedding itself. The encoder passes run once (the loss is on
    embeddings): GradCache and FSDP work unchanged. Like sentence-transformers, only the listed
    dimensions are trained: list the model's full size to keep training it."""

    dims: list[int] = Field(min_length=1, description="Prefix dimensions the loss is applied at (e.g. [384, 256, "
                            "128, 64]); each positive, at most the model's hidden size (checked when the model is "
                            "loaded), no repeats; kept in descending order.")
    weights: list[float] | None = Field(None, description="Weight of each dimension's loss, in the order of dims as "
                                        "written (each ≥ 0, finite, at least one > 0); None = 1 for every dimension.")

    @model_validator(mode="after")
    def _dims_and_weights(self) -> "MatryoshkaConfig":
        if any(d <= 0 for d in self.dims):
            raise ValueError(f"matryoshka.dims must be positive (got {self.dims})")
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"matryoshka.dims has a repeated dimension (got {self.dims})")
        weights = self.weights if self.weights is not None else [1.0] * len(self.dims)
        if len(weights) != len(self.dims):
            raise ValueError(f"matryoshka.weights needs one weight per dimension ({len(self.dims)} dims, "
                             f"{len(weights)} weights)")
        if any(w < 0 for w in weights):
            raise ValueError(f"matryoshka.weights must be >= 0 (got {weights})")
        if not sum(weights) > 0:
            raise ValueError(f"matryoshka.weights are all 0, so nothing would train (got {weights}): give one a "
                             "positive weight")
        pairs = sorted(zip(self.dims, weights), key=lambda p: -p[0])  # descending, each weight with its dim
        object.__setattr__(self, "dims", [d for d, _ in pairs])
        object.__setattr__(self, "weights", [w for _, w in pairs])
        return self


class TrainStageConfig(StrictModel):
    """One training stage. Defaults are QZhou §6.3's where it states them (τ 0.02, 4 hard negatives,
    weight decay 0.01, warm-up 300, lr 3e-5 / 2e-5, batch 256 for InfoNCE data and 768 for CoSENT
    data, η 0.72 in stage 2); α = 0.5 is gte's (QZhou cites gte and does not give α)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="Stage name: output goes to {run_dir}/train-{name}/.")
    tasks: list[str] | None = Field(None,
                                    description="Only datasets of these tasks (stage 1: [retrieval]); None = all.")
    datasets: list[str] | None = Field(None, description="Only these datasets, by their prepare.sources name "
                                       "(default: all with a trainable task).")
    init_from: str | None = Field(None, description="Start from this earlier stage's model, or 'base' for the base "
                                  "model (default: the previous stage).")
    mode: TrainMode = Field("contrastive", description="contrastive: the task losses below on pooled embeddings; "
                            "autoregembed_ic / autoregembed_cda: AutoRegEmbed's information compression / "
                            "conditional distribution alignment (train.autoregembed).")
    remine: dict[str, Any] | None = Field(None, description=(
        "Mine hard negatives again before this stage with the model it starts from (ANCE, NV-Retriever, "
        "QZhou's stage 2): the records the mine stage reads, mined with the run's mine settings and these "
        "keys over them ({} for none; model and pooling come from the stage), written to "
        "{run_dir}/mine-{name}/ and trained on instead of the mine stage's. None = train on the mine "
        "stage's negatives."))
    targeted_synthesis: TargetedConfig | None = Field(None, description=(
        "Error-driven synthesis before this stage (after remine): the dev records the model it starts from "
        "gets most wrong select the nearest training records, and the synthesize section's server writes "
        "paraphrases and hard negatives for those; written to {run_dir}/synth-{name}/, which this stage "
        "trains on. Needs a synthesize section and dev records of the named datasets."))
    steps: int = Field(32000, ge=1, description="Optimizer steps (QZhou: 32k stage 1, 8k stage 2).")
    lr: float = Field(3e-5, gt=0, description="Peak learning rate (QZhou: 3e-5 stage 1, 2e-5 stage 2).")
    warmup_steps: int = Field(300, ge=0, description="Linear warm-up steps.")
    scheduler: Literal["cosine", "linear", "constant"] = Field("cosine",
                                                               description="Learning-rate decay after warm-up.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (not on biases and norms).")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; None = off.")
    batch_size: dict[str, Annotated[int, Field(gt=0)]] = Field(
        default_factory=lambda: {"retrieval": 256, "classification": 256, "sts": 768, "nli": 768,
                                 "pair_classification": 768},
        description="Batch size per task (per device), each at least 1.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    grad_cache_chunk: int | None = Field(None, ge=1, description="GradCache: embed in chunks of this many texts "
                                         "with cached gradients (memory independent of batch size); None = off.")
    grad_cache_max_tokens: int | None = Field(None, ge=8, description="GradCache with chunks of at most this many "
                                              "padded tokens (texts × the chunk's longest, texts taken longest "
                                              "first) instead of a text count, so a chunk of long passages and one "
                                              "of short queries use the same memory; with grad_cache_chunk set too, "
                                              "a chunk obeys both. None = chunks by grad_cache_chunk only.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass (less memory, more time).")
    length_buckets: int = Field(4, ge=1, description="Each text group of a batch is length-sorted and encoded in at "
                                "most this many forward passes, each padded to its own longest text (the split "
                                "that wastes the fewest padded positions); the loss still sees the whole batch. "
                                "1 = one pass padded to the group's longest text.")
    bucket_pass_cost: int | None = Field(None, ge=0, description="Padded positions an extra length-bucket pass "
                                         "must save to be made; None = auto: under a collective back end (FSDP) on a GPU of known peak, the "
                                         "positions whose compute the pass's weight traffic costs (on paper, an H100: about 1,300 "
                                         "within a node, 10,000 across nodes; embed_core.train.engine.passes.default_pass_cost); "
                                         "else 0 in fp32, 8192 under bf16 autocast, "
                                         "where small matmuls are overhead-bound (a 2-core AMX CPU: STS-B batches "
                                         "0.51 s/step in one pass, 0.67 in four; fp32 0.85 and 0.68).")
    alpha: float = Field(0.5, ge=0, description="Dataset sampling exponent (Eq. 4).")
    eta: float | None = Field(None, ge=0, le=1,
                              description="Global retrieval ratio η (stage 2: 0.72); None = Eq. 4 only.")
    dataset_weight: dict[str, float] = Field(default_factory=dict, description="Dataset -> multiplier of its "
                                             "size^α sampling weight (default 1; 0 leaves it out), applied before "
                                             "η splits retrieval from the rest, e.g. {stsb: 3.0}.")
    origin_weight: dict[str, float] = Field(default_factory=dict, description="Record origin -> weight (default 1), "
                                            "e.g. {synthetic: 0.5} to down-weight LLM-generated pairs against human "
                                            "ones: each example's InfoNCE loss is multiplied by its origin's weight, "
                                            "and a dataset's sampling weight by its records' mean origin weight. "
                                            "Recorded in the stage's lineage.")
    num_hard_negatives: int = Field(4, ge=0, description="Hard negatives per query (QZhou: 4).")
    query_max_length: int = Field(256, ge=8, description="Tokens per query (and per text of a scored pair).")
    passage_max_length: int = Field(512, ge=8, description="QZhou uses 1536 for a 7B decoder.")
    checkpoint_every: int = Field(500, ge=1, description="Save a resumable checkpoint every this many steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept (the newest). Sized to the disk at the "
                                  "stage's start: where this many checkpoints and the one being written would not "
                                  "fit the checkpoint directory's free space (a checkpoint's bytes: "
                                  "`embedpipe plan`), 1 is kept with a warning line; where even one and the one "
                                  "being written do not fit, the stage is refused with one line.")
    log_every: int = Field(10, ge=1, description="Log a progress line every this many steps.")
    losses: dict[str, Any] = Field(default_factory=dict, description=(
        "Loss per task instead of QZhou's (retrieval infonce, classification cls_infonce, sts/nli/"
        "pair_classification cosent): {task: {name: LOSS, PARAMETER: VALUE, ...}} or {task: LOSS}; "
        "the losses and their parameters are listed in docs/configuration.md."))
    alternate_tasks: bool = Field(False, description="Alternate retrieval and non-retrieval batches step by step "
                                  "(CoDiEmb); off = draw by the sampling weights.")
    merge: MergeSpec | None = Field(None, description="Save the average of this stage's weights and an earlier "
                                    "stage's (after dev selection): keeps what that stage learnt, e.g. retrieval "
                                    "through a last STS stage. None = this stage's weights.")
    dev: DevConfig | None = Field(None, description="Dev evaluation during training and best-model selection; "
                                  "None = train to the last step.")
    matryoshka: MatryoshkaConfig | None = Field(None, description="Matryoshka training of this stage (every task's "
                                                "loss at each prefix dimension); None = train.matryoshka (all stages).")
    data_value: DataValueConfig | None = Field(None, description=(
        "The data-value gate before this stage (after remine and targeted_synthesis): short proxy trainings "
        "of this stage's recipe measure each data source and synthetic strategy on its dev tasks, and each is "
        "kept, down-weighted or dropped; written to {run_dir}/value-{name}/, whose records this stage trains "
        "on (docs/stages.md, 'Data value'). Needs a dev section. None = no gate."))

    @model_validator(mode="after")
    def _gate_needs_dev(self) -> "TrainStageConfig":
        if self.data_value is not None and self.dev is None:
            raise ValueError(f"stage {self.name}: data_value scores its proxies on the stage's dev tasks: give the "
                             "stage a dev section")
        if self.data_value is not None and not mode_of(self).merges:
            raise ValueError(f"stage {self.name}: data_value is for contrastive stages, not {self.mode}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _moved_loss_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, (task, loss, param) in MOVED_LOSS_FIELDS.items():
                if key in data:
                    raise ValueError(f"'{key}' moved into the loss's parameters: write "
                                     f"losses: {{{task}: {{name: {loss}, {param}: {data[key]!r}}}}} instead")
        return data

    @field_validator("remine")
    @classmethod
    def _mine_keys(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else check_remine_keys(v)

    @field_validator("dataset_weight")
    @classmethod
    def _non_negative_weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in v.items() if w < 0}
        if bad:
            raise ValueError(f"dataset_weight must be >= 0 (got {bad})")
        return v

    @field_validator("origin_weight")
    @classmethod
    def _known_origins(cls, v: dict[str, float]) -> dict[str, float]:
        from embed_core.schema import ORIGINS

        unknown = sorted(set(v) - set(ORIGINS))
        if unknown:
            raise ValueError(f"origin_weight: unknown origin(s) {unknown} (expected {', '.join(ORIGINS)})")
        bad = {k: w for k, w in v.items() if w < 0}
        if bad:
            raise ValueError(f"origin_weight must be >= 0 (got {bad})")
        return v

    @field_validator("losses")
    @classmethod
    def _known_losses(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            return v
        from embed_core.losses import validate_loss_spec  # torch-heavy: only when a stage names a loss

        return {task: validate_loss_spec(task, spec) for task, spec in v.items()}

    def batch_of(self, task: str) -> int:
        """The batch size (per device) of ``task``: its ``batch_size`` entry, else ``UNLISTED_BATCH``."""
        return self.batch_size.get(task, UNLISTED_BATCH)

    def chunk_capacity(self, longest: int) -> int:
        """Texts one GradCache chunk holds at most when its longest text has ``longest`` tokens:
        ``grad_cache_chunk`` texts and, with ``grad_cache_max_tokens``, at most that many padded tokens
        (a text over the budget is a chunk alone). Unbounded (a huge number) without GradCache."""
        most = self.grad_cache_chunk or UNBOUNDED
        budget = self.grad_cache_max_tokens
        return most if budget is None else min(most, max(1, budget // max(1, longest)))


def init_chain(stages: list[TrainStageConfig], index: int) -> list[str]:
    """The stages whose models stage ``index`` starts from, in turn: its ``init_from`` (by default the
    previous stage), that stage's, and so on, ending in 'base' or at the first stage seen again."""
    names = [s.name for s in stages]
    chain = [names[index]]
    while True:
        stage = stages[index]
        target = stage.init_from if stage.init_from is not None else (names[index - 1] if index > 0 else "base")
        if target == "base" or target not in names:
            return [*chain, target]
        chain.append(target)
        if chain.count(target) > 1:
            return chain
        index = names.index(target)


MAX_PROCESSES = 1024  # train.processes: local ranks on one machine (8 GPUs is the common most)


class TrainConfig(StrictModel):
    base_model: str = Field("default", description="Local path or 'default' (packaged all-MiniLM-L6-v2).")
    gguf_file: str | None = Field(None, description="GGUF weights file inside base_model (decoder LMs).")
    pooling: Literal["mean", "cls", "last_token"] = Field("mean",
                                                          description="Pooling of the token states into one embedding.")
    append_eos: Literal["auto", "always", "never"] = Field("auto", description="End every text with the tokenizer's "
                                                           "EOS token (Qwen3-Embedding, Tevatron): auto = for "
                                                           "last_token pooling, always = for every pooling, never = "
                                                           "as the tokenizer has it; never twice. Saved in the "
                                                           "model's tokenizer.json, so every loader appends it too.")
    bidirectional: bool = Field(False, description="Make a decoder's causal attention bidirectional (QZhou §3.1).")
    max_length: int = Field(256, ge=8, description="Max tokens recorded in the saved model (inference).")
    use_instructions: bool = Field(True, description="Prepend each dataset's instruction (query side for "
                                   "retrieval, both sides for symmetric tasks).")
    instruction_template: str = Field("Instruct: {instruction}\nQuery: {text}",
                                      description="How an instruction is put before a text ({instruction}, {text}).")
    exclude_instruction_from_pooling: bool = Field(False, description="Pool over the text's tokens only, not the instruction's.")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="Training compute: auto = bf16 autocast "
                                                        "on CUDA and on CPUs with native bf16 (AMX / AVX512-BF16), "
                                                        "fp32 elsewhere; fp32 for bit-exact resumes.")
    tf32: bool = Field(False, description="fp32 compute on CUDA (precision fp32, or auto's fp32 parts) runs its "
                       "matrix products on TF32 tensor cores (torch.set_float32_matmul_precision('high')): several "
                       "times faster, with a 10-bit mantissa, so not bit-exact with fp32; no effect on the CPU.")
    packing: Literal["auto", "on", "off"] = Field(
        "auto", description="Packed passes: each text group of a batch is encoded as one packed pass (its texts "
        "back to back, positions, attention and pooling per text) instead of length-bucketed padded passes, with "
        "the padded embeddings up to float rounding. auto = packed where the model's attention is FlashAttention "
        "(attn_implementation flash_attention_2/3: one row, variable-length kernel, no padding, no mask); under "
        "SDPA / eager, a group is packed (rows as wide as its longest text, a block-diagonal mask) where that "
        "needs at most 3/4 of its padded rows: short, length-skewed texts (STS-B batches: 1.8x faster in bf16, "
        "1.45x in fp32 on a 2-core CPU), not 256-token passages (one to a row either way, 10 % slower with the "
        "mask); on = every group packed; off = always padded passes. A sliding-window model keeps padded passes for a group "
        "with a text longer than its window.")
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "auto", description="Attention implementation the trained model is loaded with: auto = FlashAttention-2 on "
        "CUDA where the flash-attn package imports (packing: auto then packs), transformers' default (SDPA) "
        "elsewhere; flash_attention_2 is refused where it cannot run; flex_attention = torch's FlexAttention "
        "(compiled on first use), whose packed rows take a block-sparse document mask rather than a dense one: "
        "a GPU without flash-attn, with packing: on.")
    prefetch: bool = Field(True, description="Build and tokenize the next micro-batch on a background thread "
                           "while this one trains (same batches, same results; false: on the step).")
    weights_dtype: Literal["fp32", "bf16"] = Field("fp32", description="Storage of the weights that do not train: "
                                                   "bf16 halves a frozen LoRA base's bytes; trained weights and their "
                                                   "optimizer state stay fp32 (master weights) and compute follows "
                                                   "precision. Needs precision auto or bf16.")
    sharding: Literal["none", "fsdp"] = Field("none", description="fsdp: shard weights, gradients and optimizer "
                                              "state over the processes (torch FSDP2, one unit per transformer layer "
                                              "plus the root; bf16 compute with fp32 reductions under bf16 "
                                              "precision); works with GradCache, LoRA, dev evaluation and exact "
                                              "resume; checkpoints are sharded (torch.distributed.checkpoint).")
    fsdp_sync: Literal["every_backward", "step"] = Field(
        "every_backward", description="Under sharding: fsdp, when gradients are reduce-scattered: every_backward = "
        "after each backward pass (each GradCache chunk, each micro-batch), so a rank never holds more than its "
        "shard (≈ 16/N bytes per parameter); step = once, after a step's last backward: fewer collectives, but "
        "every rank holds an unsharded fp32 gradient (4 bytes per parameter) until then.")
    fsdp_mesh: Literal["auto", "flat", "hybrid"] = Field(
        "auto", description="Under sharding: fsdp, the device mesh: flat = every weight sharded over all ranks (1-D); "
        "hybrid = HSDP, sharded over a node's ranks (LOCAL_WORLD_SIZE) and replicated across nodes, so the "
        "per-pass all-gathers stay inside a node and only the gradient all-reduce crosses nodes (each rank then "
        "holds 1/local-ranks of the model, not 1/world); auto = hybrid where the ranks span several nodes, flat "
        "on one.")
    save_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Dtype of the committed model's weights (the training keeps fp32 master weights): "
        "auto = bf16 for a decoder LM (as Qwen/Llama checkpoints ship; half the bytes) and fp32 otherwise "
        "(BERT-like encoders); fp32 / bf16 = that dtype.")
    dist_timeout_s: float = Field(1800, ge=1, description="Seconds a collective (all-reduce, all-gather, barrier) "
                                  "waits for every process before the run fails with an error naming it (a rank "
                                  "that died or hangs); rank 0's dev evaluation is waited for without this limit.")
    processes: Annotated[int, Field(ge=1)] | Literal["auto"] = Field("auto", description="Processes one training stage runs on when it is "
                                             "not started by a launcher (the CLI without torchrun, a Prefect flow "
                                             "run on a GPU worker): auto = one per visible CUDA device (1 without "
                                             "CUDA); N = N processes on this machine (gloo on CPU, nccl on CUDA), "
                                             "this one rank 0, reporting to Prefect, at most 1024 and at most the "
                                             "machine's CUDA devices (its CPU cores without CUDA), checked when the "
                                             "stage starts. Under torchrun / deepspeed / "
                                             "accelerate launch the launcher's processes are used instead.")

    @field_validator("processes", mode="before")
    @classmethod
    def _processes(cls, v: Any) -> Any:
        """One line in the user's terms (not pydantic's union branches): auto, or 1..MAX_PROCESSES
        (a number written as a string, as a form may send it, is that number)."""
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_PROCESSES):
            return v
        raise ValueError(f"a number of processes from 1 to {MAX_PROCESSES}, or auto (got {v!r})")
    peak_tflops: float | None = Field(None, gt=0, description="The device's peak TFLOP/s for the compute precision, "
                                      "for MFU in the step metrics; None = from the table of known GPUs "
                                      "(embed_core/train/engine/telemetry.py), and no MFU on a device not in it (CPUs).")
    deepspeed: dict[str, Any] | None = Field(None, description="DeepSpeed config (ZeRO stage 1 or 2 etc.; ZeRO-3 is "
                                             "refused: use sharding: fsdp); needs the deepspeed extra.")
    lora: LoraSettings | None = Field(None, description="Train LoRA adapters instead of all weights (peft; the "
                                      "llm-train extra); None = full fine-tuning.")
    work_pool: str | None = Field(None, description="Prefect work pool whose deployment of the train flow runs the "
                                  "training stages when the pipeline runs as a deployment (e.g. gpu); None = in "
                                  "the pipeline's own process. The run directory must be on storage both pools mount.")
    matryoshka: MatryoshkaConfig | None = Field(None, description="Matryoshka training for every contrastive stage "
                                                "that sets none itself; None = no Matryoshka loss.")
    autoregembed: AutoRegEmbedConfig = Field(default_factory=AutoRegEmbedConfig, description="Settings of the AutoRegEmbed modes (stages with mode autoregembed_*).")
    stages: list[TrainStageConfig] = Field(min_length=1, description="Training stages, run in order (QZhou: retrieval only, then all tasks).")

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, v: list[TrainStageConfig]) -> list[TrainStageConfig]:
        names = [s.name for s in v]
        if len(set(names)) != len(names):
            raise ValueError("stage names must be unique")
        return v

    @field_validator("stages")
    @classmethod
    def _merge_with_earlier(cls, v: list[TrainStageConfig]) -> list[TrainStageConfig]:
        for i, stage in enumerate(v):
            earlier = [s.name for s in v[:i]]
            if stage.merge is not None and stage.merge.stage not in earlier:
                raise ValueError(f"stages[{stage.name}].merge.stage: {stage.merge.stage!r} is no earlier stage "
                                 f"(earlier: {', '.join(earlier) or 'none'})")
            if stage.merge is not None and not mode_of(stage).merges:
                raise ValueError(f"stages[{stage.name}].merge: only contrastive stages save weights that average")
        return v

    @field_validator("stages")
    @classmethod
    def _init_from_earlier(cls, v: list[TrainStageConfig]) -> list[TrainStageConfig]:
        # Stages run in order: one that starts from itself or a later stage would train on its own last
        # output (never fresh) or wait for a stage that waits for it, blocking every stage after it.
        names = [s.name for s in v]
        for i, stage in enumerate(v):
            if stage.init_from in (None, "base") or stage.init_from in names[:i]:
                continue
            where = f"stages[{stage.name}].init_from: {stage.init_from!r}"
            if stage.init_from not in names:
                raise ValueError(f"{where} is no stage (stages: {', '.join(names)}; 'base' for the base model)")
            chain = init_chain(v, i)
            what = "is the stage itself" if stage.init_from == stage.name else (
                "is a later stage, and the chain loops" if chain[-1] in chain[:-1] else "is a later stage")
            raise ValueError(f"{where} {what} ({' → '.join(chain)}): a stage starts from an earlier stage's model, "
                             "'base', or by default the previous stage's; reorder the stages or name an earlier one")
        return v

    def matryoshka_of(self, stage: TrainStageConfig) -> MatryoshkaConfig | None:
        """The Matryoshka settings ``stage`` trains with: its own, else the section's (contrastive stages)."""
        if not mode_of(stage).matryoshka:
            return None
        return stage.matryoshka if stage.matryoshka is not None else self.matryoshka

    @field_validator("stages")
    @classmethod
    def _matryoshka_contrastive(cls, v: list[TrainStageConfig]) -> list[TrainStageConfig]:
        for stage in v:
            if stage.matryoshka is not None and not mode_of(stage).matryoshka:
                raise ValueError(f"stages[{stage.name}].matryoshka: Matryoshka training is for contrastive stages, "
                                 f"not {stage.mode}")
        return v

    def fsdp_mesh_shape(self, world: int, local_world: int) -> tuple[int, ...]:
        """The FSDP mesh for ``world`` ranks, ``local_world`` of them per node: ``(world,)`` (flat) or
        ``(nodes, local_world)`` (hybrid: replicate × shard). One line when hybrid cannot split the world."""
        hybrid = self.fsdp_mesh == "hybrid" or (self.fsdp_mesh == "auto" and 0 < local_world < world)
        if not hybrid or local_world >= world:
            return (world,)
        if local_world < 1 or world % local_world:
            raise ConfigError(f"train.fsdp_mesh: hybrid needs the same number of ranks on every node, and "
                              f"{local_world} local ranks do not divide {world}; use fsdp_mesh: flat")
        return (world // local_world, local_world)

    def backend_name(self) -> str:
        """The training back end this section asks for: ``none``, ``fsdp`` or ``deepspeed`` (the names of
        ``embed_core.train.engine.backends``). The one place it is derived from ``sharding`` and
        ``deepspeed``: everything else asks this (a layout test holds it); both set is refused."""
        asked = [name for name, on in (("fsdp", self.sharding == "fsdp"), ("deepspeed", self.deepspeed is not None))
                 if on]
        if len(asked) > 1:
            raise ValueError("sharding: fsdp and deepspeed both shard the model: choose one (fsdp works with "
                             "GradCache and dev evaluation; docs/stages.md, 'Sharding and memory')")
        return asked[0] if asked else "none"

    def _zero_stage(self) -> int | None:
        """DeepSpeed's ZeRO stage (0 when its config names none); None without train.deepspeed."""
        if self.backend_name() != "deepspeed":
            return None
        return int((self.deepspeed.get("zero_optimization") or {}).get("stage", 0))

    @model_validator(mode="after")
    def _no_zero3(self) -> "TrainConfig":
        # ZeRO-3 partitions the parameters themselves: rank 0's save_pretrained would write empty tensors, and
        # the dev evaluation and GradCache's no-grad forward read whole parameters outside the engine.
        if self._zero_stage() == 3:
            raise ValueError("deepspeed.zero_optimization.stage 3 (ZeRO-3) is not supported: the final save would "
                             "write its partitioned (empty) parameters, and dev evaluation and GradCache cannot run on "
                             "partitioned parameters; use train.sharding: fsdp (shards weights, gradients and "
                             "optimizer state like ZeRO-3 and works with GradCache) or ZeRO stage 1 or 2")
        return self

    @model_validator(mode="after")
    def _dev_under_deepspeed(self) -> "TrainConfig":
        with_dev = [s.name for s in self.stages if s.dev is not None]
        if self.backend_name() == "deepspeed" and with_dev:
            raise ValueError(f"dev evaluation (stages {', '.join(with_dev)}) runs on rank 0 alone, which DeepSpeed's "
                             "partitioned state does not allow: drop train.deepspeed (train.sharding: fsdp works with "
                             "dev evaluation) or the stages' dev sections")
        return self

    @model_validator(mode="after")
    def _grad_cache_under_deepspeed(self) -> "TrainConfig":
        # GradCache runs one backward per chunk before the optimizer step; DeepSpeed reduces (ZeRO-2/3:
        # partitions) gradients in backward hooks that expect one backward per micro-batch
        # (sentence-transformers#3173, tevatron#206), so the combination is refused, not guessed at.
        cached = [s.name for s in self.stages if s.grad_cache_chunk or s.grad_cache_max_tokens]
        if self.backend_name() == "deepspeed" and cached:
            raise ValueError(f"grad_cache_chunk (stages {', '.join(cached)}) does not work with DeepSpeed (ZeRO stage "
                             f"{self._zero_stage()}): train without train.deepspeed (multi-process GradCache works "
                             "under torchrun), or use gradient_checkpointing instead of GradCache")
        return self

    @model_validator(mode="after")
    def _one_sharding(self) -> "TrainConfig":
        backend = self.backend_name()  # refuses fsdp and deepspeed together
        arc = [s.name for s in self.stages if not mode_of(s).shards]
        if backend == "fsdp" and arc:
            raise ValueError(f"sharding: fsdp is for contrastive stages; stages {', '.join(arc)} are AutoRegEmbed "
                             "(an encoder and a frozen decoder): train them with sharding: none")
        if self.weights_dtype == "bf16" and self.precision == "fp32":
            raise ValueError("weights_dtype: bf16 stores weights in bf16, which fp32 compute would read back "
                             "rounded: use precision: bf16 (or auto), or weights_dtype: fp32")
        return self

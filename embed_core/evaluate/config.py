"""The evaluate stage's config section: MTEB tasks on local files, the evaluated models, geometry
and the Hub upload."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from embed_core.config_base import StrictModel
from embed_core.model.config import EngineConfig
from embed_core.scoring.config import EvalTaskSpec

EvalPrecision = Literal["float32", "int8", "ubinary"]
RescoreWith = Literal["quantized", "int8", "float32"]


class GeometryConfig(StrictModel):
    task: str = Field(description="Name of an sts task in evaluate.tasks whose sentences are analysed.")
    max_texts: int = Field(1000, ge=2, description="Unique sentences analysed (first N of the file).")
    max_length: int = Field(128, ge=4, description="Tokens per sentence.")


class ReleaseConfig(StrictModel):
    """The release check (``embed_core.evaluate.release``): the probe the train stage recorded
    (``train-{stage}/probe.npz``, 32 of its texts under each prompt) is encoded again by the saved
    model, its base and any export; a disagreement or an unchanged model refuses the release."""

    tolerance: float = Field(1e-3, gt=0, lt=1, description="Largest 1 − cosine allowed between the saved model "
                             "and the in-training encoder (and an export and the saved model) on any probe text, "
                             "when the encoder trained in float32 (0.001: cosine ≥ 0.999; float32 round-off is "
                             "~1e-6).")
    bf16_tolerance: float = Field(1e-2, gt=0, lt=1, description="The same when the in-training encoder held "
                                  "bfloat16 weights (the saved model encodes in float32): bfloat16 keeps 8 bits of "
                                  "mantissa (relative error 2⁻⁹ per operation), which leaves cosines of 0.995–0.9999 "
                                  "between the two; 0.01 (cosine ≥ 0.99) allows that and refuses a missing merge.")
    unchanged_tolerance: float = Field(1e-8, ge=0, lt=1, description="A released model whose probe embeddings are "
                                       "all within this 1 − cosine of its base model's (the model its train stage "
                                       "started from), or whose weight files equal the base's byte for byte, did "
                                       "not move: the release is refused. 1 − cosine is quadratic in the change "
                                       "(‖Δ‖²/2), so a dozen steps at lr 3e-5 give ~1e-5; the same weights through "
                                       "two float32 code paths give < 1e-10.")
    allow_unchanged: bool = Field(False, description="Release a model equal to its base anyway (the figures are "
                                  "still recorded). Evaluating only the base model never releases and never checks.")
    export: list[Literal["onnx"]] = Field(default_factory=list, description="Exports written beside the released "
                                          "model and checked on the probe like it: onnx (model/onnx/model.onnx, "
                                          "written by torch's ONNX exporter: the transformer, its pooling and "
                                          "normalisation as one float32 graph with dynamic batch and sequence axes, "
                                          "encoded by onnxruntime with the model's tokenizer and prompts; needs the "
                                          "onnx extra: pip install -e '.[onnx]').")


class EvaluateConfig(StrictModel):
    """Evaluate stage: MTEB on local task data (metrics computed by mteb)."""

    models: list[str] | None = Field(None, description="What evaluate scores, by the pipeline and by evaluate run "
                                     "alone (embedpipe evaluate, the embedpipe-evaluate deployment) alike: 'base' "
                                     "(the run's base model), 'trained' (every train-stage checkpoint in the run) or "
                                     "local model directories; None = [base, trained]. --model names others for one "
                                     "run.")
    base_model: str = Field("default", description="Local path or 'default' (packaged all-MiniLM-L6-v2).")
    tasks: list[EvalTaskSpec] = Field(min_length=1, description="Tasks to evaluate every model on.")
    batch_size: int = Field(64, ge=1, description="Texts per encoding batch.")
    precision: Literal["auto", "fp32", "bf16", "trained"] = Field(
        "fp32", description="fp32 by default so published scores reproduce on any hardware; auto = bf16 autocast on "
        "CUDA and on CPUs with native bf16 (AMX / AVX512-BF16), else fp32; trained = each model as its train stage "
        "computed: a model trained under bf16 autocast as auto, every other model (the base included) in fp32.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Where the task texts are encoded "
                                 "(local, or Ray actors); not part of the stage's key: any engine gives the "
                                 "same scores.")
    dims: list[int] | None = Field(None, description="Also score every task with the embeddings cut to these sizes "
                                   "(first d coordinates, normalised again; each at most the model's size, checked "
                                   "per model); None = the model's trained Matryoshka dims (embedpipe.json), if any; "
                                   "[] = the full size only. Gives the sizes table (sizes.parquet, the report, the "
                                   "card, compare).")
    precisions: list[EvalPrecision] = Field(default_factory=lambda: ["float32"], min_length=1, description=(
        "Precisions each size is scored at: float32; int8 (sentence-transformers' quantize_embeddings, ranges "
        "calibrated on the task's corpus embeddings); ubinary (one bit per dimension, sign > 0). How each task type "
        "scores them: docs/stages.md, 'Sizes and precisions'."))
    rescore_multiplier: int | None = Field(None, ge=1, description="Retrieval at int8 / ubinary: also score a search "
                                           "that takes rescore_top_k × this many candidates by the quantized vectors "
                                           "and rescores them with the float32 query against the quantized document "
                                           "(sentence-transformers' semantic_search_* rescore); None = no rescored rows.")
    rescore_top_k: int = Field(10, ge=1, description="The hits the rescored search returns (sentence-transformers' "
                               "top_k): rescore_top_k × rescore_multiplier candidates are rescored and ranked first, "
                               "the rest of mteb's 1,000 hits follow in first-stage order. At least the k of the main "
                               "score (10 for nDCG@10) to measure it.")
    rescore_with: RescoreWith = Field("quantized", description="The document vectors the rescored rows rescore "
                                      "with: quantized (the vectors searched, as sentence-transformers' "
                                      "semantic_search_* rescore); int8 (int8 vectors kept on disk beside a binary "
                                      "index, sentence-transformers' quantized-retrieval demo); float32 (the original "
                                      "vectors on disk, as Qdrant's binary quantization rescores). The index in "
                                      "memory stays at its precision: the bytes per vector do not change.")
    geometry: GeometryConfig | None = Field(None, description="Token-embedding geometry of every evaluated model "
                                            "(CoDiEmb §4) on the sentences of an STS task; omitted = not computed.")
    push_to_hub: bool = Field(False, description="Upload the released model ({run_dir}/evaluate/model: weights, "
                              "prompts, model card with the scores) to the Hugging Face Hub after the stage commits; "
                              "needs hub_model_id, network and a token (HF_TOKEN or huggingface-cli login).")
    hub_model_id: str | None = Field(None, description="Hub repository for push_to_hub, e.g. my-org/my-embedder.")
    hub_private: bool = Field(True, description="Create the Hub repository as private (if it does not exist).")
    release: ReleaseConfig = Field(default_factory=ReleaseConfig, description="What the released model "
                                   "({run_dir}/evaluate/model) must prove before it is written: that it encodes like "
                                   "the in-training encoder and moved from its base (docs/stages.md, 'The release "
                                   "check').")

    @model_validator(mode="after")
    def _hub_target(self) -> "EvaluateConfig":
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("push_to_hub needs hub_model_id (e.g. my-org/my-embedder)")
        return self

    @model_validator(mode="after")
    def _sizes(self) -> "EvaluateConfig":
        if self.dims is not None:
            if any(d <= 0 for d in self.dims):
                raise ValueError(f"dims must be positive (got {self.dims})")
            if len(set(self.dims)) != len(self.dims):
                raise ValueError(f"dims has a repeated size (got {self.dims})")
        if len(set(self.precisions)) != len(self.precisions):
            raise ValueError(f"precisions has a repeated precision (got {self.precisions})")
        if self.rescore_with != "quantized" and self.rescore_multiplier is None:
            raise ValueError(f"rescore_with {self.rescore_with!r} needs rescore_multiplier (the candidates to "
                             "rescore: rescore_top_k × it)")
        return self

    @model_validator(mode="after")
    def _geometry_task(self) -> "EvaluateConfig":
        if self.geometry is not None:
            sts = [t.name for t in self.tasks if t.type == "sts"]
            if self.geometry.task not in sts:
                raise ValueError(f"geometry.task {self.geometry.task!r} must name an sts task of this section "
                                 f"(sts tasks: {', '.join(sts) or 'none'})")
        return self

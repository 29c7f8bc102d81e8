"""The encoder MTEB evaluates: any model directory the pipeline saves (or any sentence-transformers
/ Hugging Face encoder directory), with its pooling and instructions honoured, behind a text-level
embedding cache.

Instructions (see ``embed_core.model.settings``):
* a model trained with instructions (``use_instructions`` in ``embedpipe.json``) gets the task's
  instruction — the model's own instruction for that task name if it recorded one, else the task's
  (config ``instruction`` or MTEB's prompt) — on the query side only for retrieval and on both sides
  for symmetric tasks (STS, classification, pair classification), as it was trained (QZhou §3.1);
* a sentence-transformers model with named ``prompts`` gets them exactly as sentence-transformers
  would (MTEB's prompt-name priority);
* anything else (e.g. all-MiniLM-L6-v2) is encoded without instructions, as MTEB evaluates it.

Cache, two levels, both keyed by the exact input text (instruction or prompt included, so the key
is the pair (instruction, text) as the model reads it):
* in memory for one evaluate run (``TextEmbeddings``: float32 rows of every text of every task the
  model is scored on), so the tasks, the sizes and the precisions of the sizes table all read one
  set of embeddings;
* on disk by (model fingerprint, text) (``embed_core.model.embedding_cache``), so a rerun or another
  run directory encodes nothing again.
``prefetch`` encodes the texts mteb will ask for on a group of tasks (``embed_core.scoring.requests``)
before mteb scores them: each distinct text once, longest first, so batches hold texts of similar
length across tasks; mteb's ``encode`` calls then answer from memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from mteb.models.abs_encoder import AbsEncoder, get_prompt_name
from mteb.models.model_meta import ModelMeta, ScoringFunction
from mteb.types import PromptType

from embed_core.model.config import EngineConfig
from embed_core.engine import ray_encode
from embed_core.model.embedding_cache import EmbeddingCache
from embed_core.model.encoder import Encoder, model_dim, model_fingerprint, resolve_model_path, uses_bf16
from embed_core.model.settings import read_model_settings

SYMMETRIC_TYPES = ("STS", "Classification", "PairClassification", "Clustering")
MTEB_TO_TASK = {"STS": "sts", "Retrieval": "retrieval", "Classification": "classification",
                "PairClassification": "pair_classification"}


class TextEmbeddings:
    """float32 embeddings by input text, in memory (one model, one evaluate run)."""

    def __init__(self, dim: int):
        self.dim = dim
        self._rows: dict[str, int] = {}
        self._chunks: list[np.ndarray] = []
        self._matrix: np.ndarray | None = None  # the chunks joined, rebuilt after an add

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, text: str) -> bool:
        return text in self._rows

    def add(self, texts: list[str], embeddings: np.ndarray) -> None:
        fresh = [i for i, t in enumerate(texts) if t not in self._rows]
        for i in fresh:
            self._rows[texts[i]] = len(self._rows)
        if fresh:
            self._chunks.append(np.asarray(embeddings, dtype=np.float32)[fresh])
            self._matrix = None

    def get(self, texts: list[str]) -> np.ndarray:
        if self._matrix is None:
            self._matrix = np.concatenate(self._chunks) if self._chunks else np.zeros((0, self.dim), np.float32)
            self._chunks = [self._matrix]
        return self._matrix[[self._rows[t] for t in texts]]


class EvalModel(AbsEncoder):
    def __init__(self, model: str, *, label: str, cache_root: str | Path, batch_size: int = 64,
                 precision: str = "fp32", device: str | None = None, cache_max_bytes: int | None = None,
                 engine: EngineConfig | None = None):
        import torch

        self.path = resolve_model_path(model)
        self.label = label
        self.settings = read_model_settings(self.path)
        self.batch_size = batch_size
        self.precision = precision
        self.device = device
        self.engine = engine or EngineConfig()
        device_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.fingerprint = model_fingerprint(self.path, self.settings.pooling, self.settings.max_length,
                                             uses_bf16(precision, device_type))
        self.dim = model_dim(self.path)
        self.cache = EmbeddingCache(Path(cache_root), self.fingerprint, self.dim, dtype="float32",
                                    max_bytes=cache_max_bytes)
        self._encoder: Encoder | None = None
        self.memory = TextEmbeddings(self.dim)
        self.scoring_misses = 0  # texts mteb asked for that no prefetch had encoded
        self.recorded: list[np.ndarray] | None = None  # a list: every encode's output is kept (sizes' int8 ranges)
        self.model_prompts = self.settings.prompts or None
        self.mteb_model_meta = ModelMeta.create_empty(overwrites=dict(
            name=f"embedpipe/{label}", revision=self.fingerprint, embed_dim=self.dim,
            max_tokens=self.settings.max_length, similarity_fn_name=ScoringFunction.COSINE,
            use_instructions=self.settings.use_instructions, framework=["PyTorch"],
            loader=None, modalities=["text"]))

    @property
    def texts_encoded(self) -> int:
        return self.cache.encoded_texts

    def _encode_texts(self, texts: list[str]) -> np.ndarray:
        if self.engine.kind == "ray":  # inside the evaluate stage's engine_session
            return ray_encode(texts, model=str(self.path), pooling=self.settings.pooling,
                              max_length=self.settings.max_length, precision=self.precision,
                              batch_size=self.batch_size, dim=self.dim, engine=self.engine,
                              compress_tokens=self.settings.compress_tokens or 0)
        if self._encoder is None:  # loaded only when something is not cached
            self._encoder = Encoder(self.path, pooling=self.settings.pooling, max_length=self.settings.max_length,
                                    precision=self.precision, device=self.device,
                                    compress_tokens=self.settings.compress_tokens)
        return self._encoder.encode(texts, batch_size=self.batch_size, show_progress=True, desc=self.label)

    def instruction_for(self, task_metadata, prompt_type: PromptType | None) -> str:
        """The text put in front of each input (already formatted), or '' for none."""
        if self.settings.use_instructions and self.settings.instructions_fixed:
            # AutoRegEmbed: its own instruction per task type, passages included (I_self)
            kind = MTEB_TO_TASK.get(task_metadata.type, "sts")
            if task_metadata.type == "Retrieval" and prompt_type == PromptType.document:
                kind = "retrieval_passage"
            return self.settings.task_instructions.get(kind, "")
        if self.settings.use_instructions:
            if task_metadata.type == "Retrieval" and prompt_type == PromptType.document:
                return ""
            if task_metadata.type not in SYMMETRIC_TYPES and task_metadata.type != "Retrieval":
                return ""
            explicit = task_metadata.prompt  # config instruction or the task's own MTEB prompt
            if isinstance(explicit, dict):
                explicit = explicit.get((prompt_type or PromptType.query).value)
            return (self.settings.instructions.get(task_metadata.name) or explicit
                    or self.settings.task_instructions.get(MTEB_TO_TASK.get(task_metadata.type, ""))
                    or self.get_instruction(task_metadata, prompt_type or PromptType.query) or "")
        name = get_prompt_name(self.model_prompts, task_metadata, prompt_type)
        return self.model_prompts[name] if name else ""

    def model_inputs(self, inputs, task_metadata, prompt_type: PromptType | None) -> list[str]:
        """The exact texts the model encodes for mteb's ``inputs``: instruction or prompt included."""
        texts = [text for batch in inputs for text in batch["text"]]
        prefix = self.instruction_for(task_metadata, prompt_type)
        if prefix and self.settings.use_instructions:
            return [self.settings.format(prefix, t) for t in texts]
        if prefix:
            return [prefix + t for t in texts]  # sentence-transformers prompt semantics
        return texts

    def _fill(self, texts: list[str]) -> int:
        """Put ``texts`` missing from memory there (from the disk cache, or encoded longest first);
        returns how many were missing."""
        todo = sorted(dict.fromkeys(t for t in texts if t not in self.memory), key=len, reverse=True)
        if todo:
            self.memory.add(todo, self.cache.get_or_encode(todo, self._encode_texts))
        return len(todo)

    def prefetch(self, tasks) -> int:
        """Encode every text mteb will ask for on ``tasks`` (their data is loaded here), each distinct
        text once, longest first; returns the number of texts that were not in memory yet."""
        from embed_core.scoring.requests import task_requests

        texts = [text for task in tasks for batch, prompt_type in task_requests(task)
                 for text in self.model_inputs([{"text": batch}], task.metadata, prompt_type)]
        return self._fill(texts)

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str,
               prompt_type: PromptType | None = None, **kwargs: Any) -> np.ndarray:
        texts = self.model_inputs(inputs, task_metadata, prompt_type)
        self.scoring_misses += self._fill(texts)
        out = self.memory.get(texts)
        if self.recorded is not None:
            self.recorded.append(np.asarray(out))
        return out

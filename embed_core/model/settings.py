"""How a saved model wants to be used: pooling, max length and instructions.

Read, in order of precedence, from
1. ``embedpipe.json`` (written by the train stage): ``pooling``, ``max_length``, ``instruction_template``,
   ``instructions`` (dataset/task name -> instruction), ``task_instructions`` (task type ->
   instruction) and ``use_instructions``;
2. sentence-transformers files: ``1_Pooling/config.json`` (pooling), ``sentence_bert_config.json``
   (``max_seq_length``), ``config_sentence_transformers.json`` (``prompts``);
3. defaults (mean pooling, 512 tokens, no instructions).

So a pipeline-trained model and any sentence-transformers directory are encoded the way their
authors evaluated them (the main cause of MTEB scores that do not reproduce).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TEMPLATE = "Instruct: {instruction}\nQuery: {text}"
SETTINGS_FILE = "embedpipe.json"


@dataclass
class ModelSettings:
    pooling: str = "mean"
    max_length: int = 512
    use_instructions: bool = False
    instruction_template: str = DEFAULT_TEMPLATE
    instructions: dict[str, str] = field(default_factory=dict)  # dataset / task name -> instruction
    task_instructions: dict[str, str] = field(default_factory=dict)  # task type (sts, retrieval, …) -> instruction
    prompts: dict[str, str] = field(default_factory=dict)  # sentence-transformers named prompts
    compress_tokens: int = 0  # pooling "compress" (AutoRegEmbed): k compression tokens
    instructions_fixed: bool = False  # the method's own task_instructions win over task prompts (AutoRegEmbed)
    source: str = "defaults"

    def format(self, instruction: str | None, text: str) -> str:
        if not instruction:
            return text
        return self.instruction_template.format(instruction=instruction, text=text)


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_model_settings(path: str | Path) -> ModelSettings:
    root = Path(path)
    own = _json(root / SETTINGS_FILE)
    if own is not None:
        return ModelSettings(
            pooling=own.get("pooling", "mean"), max_length=int(own.get("max_length", 512)),
            use_instructions=bool(own.get("use_instructions", False)),
            instruction_template=own.get("instruction_template", DEFAULT_TEMPLATE),
            instructions=dict(own.get("instructions", {})),
            task_instructions=dict(own.get("task_instructions", {})),
            compress_tokens=int(own.get("compress_tokens", 0)),
            instructions_fixed=bool(own.get("instructions_fixed", False)), source=SETTINGS_FILE)
    settings = ModelSettings()
    pooling = _json(root / "1_Pooling" / "config.json")
    if pooling is not None:
        settings.source = "sentence-transformers"
        if pooling.get("pooling_mode_cls_token"):
            settings.pooling = "cls"
        elif pooling.get("pooling_mode_lasttoken"):
            settings.pooling = "last_token"
        else:
            settings.pooling = "mean"
    sbert = _json(root / "sentence_bert_config.json")
    if sbert and sbert.get("max_seq_length"):
        settings.max_length = int(sbert["max_seq_length"])
    st_config = _json(root / "config_sentence_transformers.json") or {}
    settings.prompts = {k: v for k, v in (st_config.get("prompts") or {}).items() if v}
    if settings.source == "defaults":
        hf = _json(root / "config.json") or {}
        limit = hf.get("max_position_embeddings")
        if isinstance(limit, int) and limit > 0:
            settings.max_length = min(settings.max_length, limit)
    return settings

"""How a saved model wants to be used: pooling, max length and instructions.

Read, in order of precedence, from
1. ``embedpipe.json`` (written by the train stage): ``pooling``, ``max_length``, ``instruction_template``,
   ``instructions`` (dataset/task name -> instruction), ``task_instructions`` (task type ->
   instruction), ``use_instructions`` and ``matryoshka`` (the trained prefix dimensions and their
   weights, when the model was trained with ``train.matryoshka``);
2. sentence-transformers files: ``1_Pooling/config.json`` (pooling), ``sentence_bert_config.json``
   (``max_seq_length``), ``config_sentence_transformers.json`` (``prompts``);
3. defaults (mean pooling, 512 tokens, no instructions).

So a pipeline-trained model and any sentence-transformers directory are encoded the way their
authors evaluated them (the main cause of MTEB scores that do not reproduce).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embed_core.schema import SYMMETRIC_TASKS, Record

Embed = Callable[[list[str]], Any]  # texts -> their embeddings (rows)

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
    retrieval_datasets: list[str] = field(default_factory=list)  # names in `instructions` of retrieval data
    matryoshka_dims: list[int] = field(default_factory=list)  # prefix dimensions trained (Matryoshka), descending
    source: str = "defaults"

    def format(self, instruction: str | None, text: str) -> str:
        if not instruction:
            return text
        return self.instruction_template.format(instruction=instruction, text=text)


# embedpipe task type -> MTEB task type (the key sentence-transformers' MTEB wrapper looks prompts up by)
MTEB_TYPES = {"sts": "STS", "classification": "Classification", "pair_classification": "PairClassification",
              "retrieval": "Retrieval"}


def prompt_prefix(template: str, instruction: str) -> str | None:
    """The text before the input that ``template`` puts around ``instruction`` (a sentence-
    transformers prompt is a prefix), or None when the template puts text after the input."""
    marker = "\0text\0"
    filled = template.format(instruction=instruction, text=marker)
    head, _, tail = filled.partition(marker)
    return head if not tail else None


def sentence_transformers_prompts(settings: ModelSettings) -> dict[str, str]:
    """Named prompts that make ``SentenceTransformer(path).encode(text, prompt_name=…)`` give what the
    evaluator (``embed_core.scoring.model``) encodes for a model trained with instructions:
    ``<dataset>`` for each trained dataset (on queries only for retrieval: ``<dataset>-document`` and
    ``document`` are empty, as passages are encoded without instruction), ``query`` for retrieval
    queries, and the MTEB task types (``STS``, ``Classification``, …) for symmetric tasks of any name.
    Empty when the model is used without instructions or the template is not a prefix."""
    return {name: prefix for name, (prefix, _) in prompt_instructions(settings).items()}


def prompt_instructions(settings: ModelSettings) -> dict[str, tuple[str, str]]:
    """name -> (sentence-transformers prompt, the instruction it stands for; "" for none) of
    ``sentence_transformers_prompts``: the release check encodes a probe under each name with the
    in-training encoder (the instruction) and with the saved model (the prompt)."""
    if not settings.use_instructions:
        return {}
    prompts: dict[str, tuple[str, str]] = {}

    def add(name: str, instruction: str) -> None:
        prefix = prompt_prefix(settings.instruction_template, instruction)
        if prefix is not None:
            prompts[name] = (prefix, instruction)

    for kind, instruction in settings.task_instructions.items():
        if kind in MTEB_TYPES and instruction:
            add(MTEB_TYPES[kind] + ("-query" if kind == "retrieval" else ""), instruction)
    if settings.task_instructions.get("retrieval"):
        add("query", settings.task_instructions["retrieval"])
        prompts["Retrieval-document"] = ("", "")
    prompts["document"] = ("", "")
    retrieval_names = set(settings.retrieval_datasets)
    for name, instruction in settings.instructions.items():
        add(name, instruction)
        if name in retrieval_names:
            prompts[f"{name}-document"] = ("", "")
    return prompts


def side_instruction(settings: ModelSettings, task: str, record_instruction: str, side: str) -> str | None:
    """The instruction a model trained here puts on one ``side`` ("query" or "document") of a record
    of ``task``, as training does (``embed_core.train.engine.batches``): none when it was trained without;
    the record's on the query side and, for symmetric tasks, on the document side too; a method's
    own fixed instructions (AutoRegEmbed) by task, passages included."""
    if not settings.use_instructions:
        return None
    if settings.instructions_fixed:
        kind = "retrieval_passage" if task == "retrieval" and side == "document" else task
        return settings.task_instructions.get(kind) or None
    if side == "document" and task not in SYMMETRIC_TASKS:
        return None
    return record_instruction or None


def instructed(records: list[Record], embed: Embed, settings: ModelSettings | None) -> tuple[Embed, Embed]:
    """(documents' embed, queries' embed) for a model used as it was trained
    (``side_instruction``): a query with its record's instruction, a document with the instruction
    of the record it comes from where the task puts one on both sides; texts as they are for a
    model trained without instructions (``settings`` None or ``use_instructions`` false)."""
    if settings is None or not settings.use_instructions:
        return embed, embed
    query_of: dict[str, str | None] = {}
    document_of: dict[str, str | None] = {}
    for r in records:
        query_of.setdefault(r.query, side_instruction(settings, r.task, r.instruction, "query"))
        for t in (*r.positives, *r.negatives, *([r.query] if r.task == "classification" else [])):
            document_of.setdefault(t, side_instruction(settings, r.task, r.instruction, "document"))
    fixed = side_instruction(settings, "retrieval", "", "document")  # a corpus text's (fixed instructions only)

    def documents(texts: list[str]):
        return embed([settings.format(document_of.get(t, fixed), t) for t in texts])

    def queries(texts: list[str]):
        return embed([settings.format(query_of.get(t), t) for t in texts])

    return documents, queries


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # a nesting too deep for the parser is as unreadable
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
            instructions_fixed=bool(own.get("instructions_fixed", False)),
            retrieval_datasets=list(own.get("retrieval_datasets", [])),
            matryoshka_dims=[int(d) for d in (own.get("matryoshka") or {}).get("dims", [])], source=SETTINGS_FILE)
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

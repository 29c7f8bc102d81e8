"""Versioned prompt templates (one YAML file per strategy and task kind) and the structured
answers they ask for.

A template file holds ``name``, ``version``, ``output`` (which answer model validates the reply),
``chat`` (system + user messages, for instruction-tuned models) and ``completion`` (a few-shot text
for base models, ending inside the JSON answer; ``prefix`` is put back in front of the reply before
parsing). Placeholders are ``$query`` and ``$positive`` (``queries-*``: ``$passage``, ``$k`` and
``$persona_note``; ``judge-*``: ``$query`` and ``$passage``) (``string.Template``, so JSON braces in the
examples need no escaping). Cache keys hold the version and the rendered prompt, so an edited
template never replays old answers; the version names the prompt in manifests and stats.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from embed_core.errors import ConfigError
from embed_core.safe_yaml import read_yaml

PACKAGED_PROMPTS = Path(__file__).parent / "prompts"


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @field_validator("*")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        v = " ".join(str(v).split())
        if not v:
            raise ValueError("empty text")
        return v


class PairAnswer(_Answer):
    query: str
    positive: str


class TextAnswer(_Answer):
    text: str


class NegativeAnswer(_Answer):
    negative: str


class QueriesAnswer(BaseModel):
    """Strategy ``queries``: one or more queries for a passage (blank ones dropped, at least one)."""

    model_config = ConfigDict(extra="ignore")
    queries: list[str]

    @field_validator("queries")
    @classmethod
    def _some_queries(cls, v: list[str]) -> list[str]:
        out = [" ".join(str(q).split()) for q in v]
        out = [q for q in out if q]
        if not out:
            raise ValueError("no query")
        return out


ANSWER_MODELS: dict[str, type[BaseModel]] = {"pair": PairAnswer, "text": TextAnswer, "negative": NegativeAnswer,
                                             "queries": QueriesAnswer}


# A judge template (synthesize.queries.judge) answers "yes" or "no", read from the reply's logprobs or
# text by ``embed_core.synthesize.judge``, not parsed as JSON.
JUDGMENT = "judgment"


class MalformedAnswer(ValueError):
    """The reply holds no JSON object that validates against the template's answer model."""


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    version: str
    output: str
    chat_system: str
    chat_user: str
    completion: str
    prefix: str = ""
    stop: tuple[str, ...] = ()
    max_input_chars: int = 900
    source: str = ""
    digest: str = field(default="", compare=False)

    def answer_schema(self) -> tuple[str, dict]:
        """(name, JSON schema) of the answer this template asks for: every field a required string
        (or list of strings), nothing else (the shape OpenAI's strict structured outputs accept)."""
        model = ANSWER_MODELS[self.output]
        schema = model.model_json_schema()
        schema = {"type": "object", "properties": {
                      k: {"type": "array", "items": {"type": "string"}} if p.get("type") == "array" else {"type": "string"}
                      for k, p in schema["properties"].items()},
                  "required": list(schema["properties"]), "additionalProperties": False}
        return f"{self.output}_answer", schema

    def _values(self, values: dict[str, str], one_line: bool) -> dict[str, str]:
        out = {}
        for k, v in values.items():
            v = v[: self.max_input_chars]
            out[k] = " ".join(v.split()) if one_line else v
        return out

    def render(self, mode: str, values: dict[str, str]) -> str | list[dict[str, str]]:
        """``completion``: the prompt text; ``chat``: the message list."""
        if mode == "completion":
            # Few-shot lines: a newline inside a value would end the example early.
            return Template(self.completion).substitute(self._values(values, one_line=True))
        vals = self._values(values, one_line=False)
        return [{"role": "system", "content": self.chat_system},
                {"role": "user", "content": Template(self.chat_user).substitute(vals)}]

    def parse(self, mode: str, reply: str) -> BaseModel:
        """The validated answer, or ``MalformedAnswer`` naming what was wrong."""
        text = (self.prefix + reply) if mode == "completion" else reply
        text = re.sub(r"^```(?:json)?\s*|\s*```\s*$", "", text.strip())
        start = text.find("{")
        if start < 0:
            raise MalformedAnswer("no JSON object in the reply")
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
        except json.JSONDecodeError as exc:
            raise MalformedAnswer(f"invalid JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise MalformedAnswer("the JSON is not an object")
        try:
            return ANSWER_MODELS[self.output].model_validate(obj)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise MalformedAnswer(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def _load(path: Path) -> PromptTemplate:
    try:
        raw = read_yaml(path)
        chat = raw.get("chat") or {}
        tpl = PromptTemplate(
            name=str(raw["name"]), version=str(raw["version"]), output=str(raw["output"]),
            chat_system=str(chat.get("system", "")), chat_user=str(chat["user"]), completion=str(raw["completion"]),
            prefix=str(raw.get("prefix", "")), stop=tuple(raw.get("stop") or ()),
            max_input_chars=int(raw.get("max_input_chars", 900)), source=str(path),
            digest=hashlib.sha256(path.read_bytes()).hexdigest()[:16])
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{path}: not a prompt template ({type(exc).__name__}: {exc})") from None
    if tpl.output not in ANSWER_MODELS and tpl.output != JUDGMENT:
        raise ConfigError(f"{path}: output {tpl.output!r} unknown (choose from {', '.join(ANSWER_MODELS)}, {JUDGMENT})")
    return tpl


def load_templates(prompt_dir: str | Path | None = None) -> dict[str, PromptTemplate]:
    """Packaged templates, each replaced by a same-named file from ``prompt_dir`` when given."""
    templates: dict[str, PromptTemplate] = {}
    for directory in [PACKAGED_PROMPTS, *([Path(prompt_dir)] if prompt_dir else [])]:
        if not directory.is_dir():
            raise ConfigError(f"synthesize.prompt_dir: {directory} is not a directory")
        seen: set[str] = set()
        for path in sorted(directory.glob("*.yaml")):
            tpl = _load(path)
            if tpl.name in seen:
                raise ConfigError(f"{path}: a second template named {tpl.name!r} in {directory}")
            seen.add(tpl.name)
            templates[tpl.name] = tpl
    return templates


def template_versions(templates: dict[str, PromptTemplate]) -> dict[str, str]:
    """name → ``version`` (what cache keys and the stage fingerprint record)."""
    return {name: t.version for name, t in sorted(templates.items())}

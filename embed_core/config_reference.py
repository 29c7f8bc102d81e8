"""The configuration reference (docs/configuration.md), generated from the config models' field
descriptions and the loss and converter registries, so the docs cannot drift from the code (a test
compares).

    python -m embed_core.config_reference > docs/configuration.md
"""

from __future__ import annotations

import json
import re
import sys
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from embed_core.config import RunConfig
from embed_core.losses import DEFAULT_LOSSES, LOSSES
from embed_core.schema import CORPUS_KIND
from embed_core.prepare.convert import CONVERTERS

HEADER = """# Configuration reference

Generated from the config models' field descriptions (`embed_core/config.py`, each stage's
`embed_core/<stage>/config.py`), the loss registry (`embed_core/losses/`) and the converter registry
(`embed_core/prepare/convert/`): `python -m embed_core.config_reference > docs/configuration.md`.
A run config is YAML; unknown keys are errors that name the file and the key. `extends: other.yaml`
starts from another config (mappings merge key by key; lists and scalars replace).
"""


def _type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    # Annotated[int, FieldInfo(...)] -> int: the constraints are in the description
    text = re.sub(r"Annotated\[(\w+), FieldInfo\((?:[^()]|\([^()]*\))*\)\]", r"\1", text)
    for noise in ("typing.", "<class '", "'>"):
        text = text.replace(noise, "")
    return re.sub(r"embed_core(\.\w+)*\.", "", text).replace("|", "\\|")


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return f"`{json.dumps(value, default=str)}`".replace("|", "\\|")


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    """The config sections inside a field's type (a model without fields, like the base of the
    converters' parameters, is documented with its owner instead)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation] if annotation.model_fields else []
    return [m for arg in typing.get_args(annotation) for m in _nested_models(arg)]


def _section(path: str, model: type[BaseModel], out: list[str], seen: dict[type, str]) -> None:
    if model in seen:
        out += [f"## `{path}`", "", f"Same keys as `{seen[model]}`.", ""]
        return
    seen[model] = path
    doc = (model.__doc__ or "").strip()
    out += [f"## `{path}`", ""] + ([" ".join(doc.split()), ""] if doc and model is not RunConfig else [])
    out += ["| key | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
        nested += [(f"{path}.{name}" if path else name, m) for m in _nested_models(field.annotation)]
    out.append("")
    for sub_path, sub in nested:
        _section(sub_path, sub, out, seen)


def _parameters(params: type[BaseModel], out: list[str]) -> None:
    if params.model_fields:
        out += ["| parameter | type | default | description |", "|---|---|---|---|"]
        for pname, field in params.model_fields.items():
            out.append(f"| `{pname}` | {_type_name(field.annotation)} | {_default(field)} | {field.description} |")
        out.append("")


def _losses(out: list[str]) -> None:
    out += ["## Losses (`train.stages[].losses`)", "",
            "Per task, `{name: <loss>, <parameter>: <value>, ...}` or just the name. Without an entry a task "
            "trains with QZhou's loss: " + ", ".join(f"{t} `{n}`" for t, n in DEFAULT_LOSSES.items()) + ".", ""]
    for name, cls in LOSSES.items():
        summary = " ".join((cls.__doc__ or "").split())
        out += [f"### `{name}`", "", f"{summary} Tasks: {', '.join(cls.tasks)}. Source: "
                f"`{cls.__module__.replace('.', '/')}.py`.", ""]
        _parameters(cls.Params, out)


def _source_kinds(out: list[str]) -> None:
    out += ["## Source kinds (`prepare.sources[].kind`)", "",
            "Each kind is a converter, one file under `embed_core/prepare/convert/`. `columns` maps its fields to "
            "the file's columns: by default to the names below, or, with `header: false`, to the positions in "
            "this order (0, 1, ...). The settings only a kind has go under `params:`, e.g. "
            "`{name: scifact, kind: beir, path: scifact, params: {split: test}}`.", ""]
    for kind, cls in CONVERTERS.items():
        module_doc = sys.modules[cls.__module__].__doc__ or ""
        fields = ", ".join(f"`{f}` (`{c}`{', optional' if f in cls.optional else ''})"
                           for f, c in cls.columns.items()) or "none (a directory)"
        passages = cls.produces == CORPUS_KIND  # a corpus: documents, no columns, no records
        fields = "none (a file or folder of documents)" if passages else fields
        out += [f"### `{kind}`", "", " ".join(module_doc.split()), "",
                f"Task: {cls.task}. Columns: {fields}. Contamination texts: "
                f"{', '.join(cls.text_fields) or ('the passages' if passages else 'the judged queries')}"
                f"{'; pairs (match: pair)' if cls.pair else ''}. "
                f"Source: `{cls.__module__.replace('.', '/')}.py`.", ""]
        _parameters(cls.Params, out)


def render() -> str:
    out = [HEADER]
    _section("", RunConfig, out, {})
    out[1] = "## Top level"
    _source_kinds(out)
    _losses(out)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")

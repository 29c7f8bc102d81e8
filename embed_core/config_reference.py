"""The configuration reference (docs/configuration.md), generated from the config models' field
descriptions and the loss registry, so the docs cannot drift from the code (a test compares).

    python -m embed_core.config_reference > docs/configuration.md
"""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from embed_core.config import RunConfig
from embed_core.losses import DEFAULT_LOSSES, LOSSES

HEADER = """# Configuration reference

Generated from the config models' field descriptions (`embed_core/config.py`) and the loss
registry (`embed_core/losses/`): `python -m embed_core.config_reference > docs/configuration.md`.
A run config is YAML; unknown keys are errors that name the file and the key. `extends: other.yaml`
starts from another config (mappings merge key by key; lists and scalars replace).
"""


def _type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    for noise in ("typing.", "embed_core.config.", "<class '", "'>"):
        text = text.replace(noise, "")
    return text.replace("|", "\\|")


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return f"`{json.dumps(value, default=str)}`".replace("|", "\\|")


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
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


def _losses(out: list[str]) -> None:
    out += ["## Losses (`train.stages[].losses`)", "",
            "Per task, `{name: <loss>, <parameter>: <value>, ...}` or just the name. Without an entry a task "
            "trains with QZhou's loss: " + ", ".join(f"{t} `{n}`" for t, n in DEFAULT_LOSSES.items()) + ".", ""]
    for name, cls in LOSSES.items():
        summary = " ".join((cls.__doc__ or "").split())
        out += [f"### `{name}`", "", f"{summary} Tasks: {', '.join(cls.tasks)}. Source: "
                f"`{cls.__module__.replace('.', '/')}.py`.", ""]
        if cls.Params.model_fields:
            out += ["| parameter | type | default | description |", "|---|---|---|---|"]
            for pname, field in cls.Params.model_fields.items():
                out.append(f"| `{pname}` | {_type_name(field.annotation)} | {_default(field)} | {field.description} |")
            out.append("")


def render() -> str:
    out = [HEADER]
    _section("", RunConfig, out, {})
    out[1] = "## Top level"
    _losses(out)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")

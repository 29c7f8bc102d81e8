"""A stage's options (its ``options`` pydantic model) on the command line: the flags the model
declares, and the model back from the parsed flags."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel


def add_option_flags(p: argparse.ArgumentParser, options: type[BaseModel]) -> None:
    """``--name`` per field (a list field repeats or takes a comma-separated value; a bool field is
    ``--name/--no-name``); ``cli_flag`` in a field's ``json_schema_extra`` renames its flag."""
    for name, f in options.model_fields.items():
        flag = (f.json_schema_extra or {}).get("cli_flag", f"--{name.replace('_', '-')}")
        if f.annotation is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f.description)
        elif "list" in str(f.annotation):
            p.add_argument(flag, dest=name, action="append", help=f"{f.description} (repeatable or comma-separated)")
        else:
            p.add_argument(flag, dest=name, help=f.description)


def stage_options(stage, args: argparse.Namespace) -> Any:
    """The stage's options model from its parsed flags (a list: repeated and/or comma-separated values)."""
    values = {}
    for name in stage.options.model_fields:
        value = getattr(args, name)
        if isinstance(value, list):
            value = [v.strip() for item in value for v in item.split(",") if v.strip()]
        values[name] = value
    return stage.options(**values)

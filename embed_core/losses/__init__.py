"""Training losses, one module each (formula and source in each docstring), and their registry.

Every module under this package that defines a subclass of ``Loss`` with a ``name`` is found
here: a stage config names the loss per task (``losses: {retrieval: {name: pair_bce, scale:
20.0}}``), ``loss_for`` builds it with validated parameters, and ``DEFAULT_LOSSES`` gives QZhou's
choice for every task a stage does not name.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from pydantic import ValidationError

from embed_core.losses.base import Loss, LossContext, LossParams

__all__ = ["Loss", "LossContext", "LossParams", "LOSSES", "DEFAULT_LOSSES", "loss_for", "validate_loss_spec"]


def _discover() -> dict[str, type[Loss]]:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    found: dict[str, type[Loss]] = {}
    todo = list(Loss.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if getattr(cls, "name", None):
            if cls.name in found and found[cls.name] is not cls:
                raise RuntimeError(f"two losses are named {cls.name!r}: {found[cls.name]} and {cls}")
            found[cls.name] = cls
    return dict(sorted(found.items()))


LOSSES: dict[str, type[Loss]] = _discover()
DEFAULT_LOSSES: dict[str, str] = {task: cls.name for cls in LOSSES.values() for task in cls.default_for}


def validate_loss_spec(task: str, spec: str | dict[str, Any]) -> dict[str, Any]:
    """``{name, **params}`` with every parameter filled in; ``ValueError`` says what is wrong."""
    if task not in DEFAULT_LOSSES:
        raise ValueError(f"no losses for task {task!r} (tasks: {', '.join(DEFAULT_LOSSES)})")
    spec = {"name": spec} if isinstance(spec, str) else dict(spec)
    name = spec.pop("name", None)
    choices = [n for n, cls in LOSSES.items() if task in cls.tasks]
    if name not in LOSSES or task not in LOSSES[name].tasks:
        raise ValueError(f"loss {name!r} is not available for {task} (choose from {', '.join(choices)})")
    try:
        params = LOSSES[name].Params.model_validate(spec)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{task} ({name}): {'.'.join(map(str, first['loc']))}: {first['msg']} "
                         f"(parameters: {', '.join(LOSSES[name].Params.model_fields)})") from None
    return {"name": name, **params.model_dump(mode="json")}


def loss_for(task: str, spec: dict[str, Any] | None) -> Loss:
    """The loss a stage trains ``task`` with (its config's choice, else QZhou's)."""
    spec = validate_loss_spec(task, spec or DEFAULT_LOSSES[task])
    cls = LOSSES[spec.pop("name")]
    return cls(cls.Params.model_validate(spec))

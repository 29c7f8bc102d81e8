"""Training losses, one module each (formula and source in each docstring), and their registry.

Every module under this package that defines a subclass of ``Loss`` with a ``name`` is found
here: a stage config names the loss per task (``losses: {retrieval: {name: pair_bce, scale:
20.0}}``), ``loss_for`` builds it with validated parameters, and ``DEFAULT_LOSSES`` gives QZhou's
choice for every task a stage does not name.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from embed_core.losses.base import Loss, LossContext, LossParams
from embed_core.registry import discover

__all__ = ["Loss", "LossContext", "LossParams", "LOSSES", "DEFAULT_LOSSES", "loss_for", "validate_loss_spec"]


LOSSES: dict[str, type[Loss]] = discover(__name__, __path__, Loss, "name", "losses")
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

"""Training back ends, one module each, and their registry (read like ``embed_core.losses``).

Every module here that defines a subclass of ``Backend`` with a ``name`` is found; ``backend_for``
picks the one a stage's train config asks for (``sharding: fsdp``, ``deepspeed: {...}``, else
``none``). The trainer's loop calls only the ``Backend`` interface.
"""

from __future__ import annotations

import importlib
import pkgutil

from embed_core.train.backends.base import Backend

__all__ = ["Backend", "BACKENDS", "backend_for"]


def _discover() -> dict[str, type[Backend]]:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    found: dict[str, type[Backend]] = {}
    todo = list(Backend.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if getattr(cls, "name", None):
            if cls.name in found and found[cls.name] is not cls:
                raise RuntimeError(f"two training back ends are named {cls.name!r}: {found[cls.name]} and {cls}")
            found[cls.name] = cls
    return dict(sorted(found.items()))


BACKENDS: dict[str, type[Backend]] = _discover()


def backend_for(train) -> type[Backend]:
    """The back end ``train`` asks for (config validation allows exactly one)."""
    chosen = [cls for cls in BACKENDS.values() if cls.applies(train)]
    if len(chosen) != 1:
        raise RuntimeError(f"train config selects {len(chosen)} back ends: {[c.name for c in chosen]}")
    return chosen[0]

"""Training back ends, one module each, and their registry (read like ``embed_core.losses``).

Every module here that defines a subclass of ``Backend`` with a ``name`` is found; ``backend_for``
picks the one a stage's train config names (``TrainConfig.backend_name``: ``sharding: fsdp``,
``deepspeed: {...}``, else ``none``). The trainer's loop calls only the ``Backend`` interface.
"""

from __future__ import annotations

from embed_core.registry import discover
from embed_core.train.engine.backends.base import Backend

__all__ = ["Backend", "BACKENDS", "backend_for"]


BACKENDS: dict[str, type[Backend]] = discover(__name__, __path__, Backend, "name", "training back ends")


def backend_for(train) -> type[Backend]:
    """The back end ``train`` asks for (``TrainConfig.backend_name``, the one place it is derived)."""
    return BACKENDS[train.backend_name()]

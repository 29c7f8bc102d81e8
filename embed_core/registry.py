"""Discovery for the registries that read one module per entry (losses, source converters, training
back ends): import every module of a package, then collect the subclasses of its base class by the
name each declares. Two classes claiming one name is an error at import, not a silent override."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def discover(package: str, path: Iterable[str], base: type[T], attr: str, what: str, *,
             own: bool = False) -> dict[str, type[T]]:
    """``{name: class}`` for every subclass of ``base`` (at any depth) whose ``attr`` is set;
    ``own``: only classes defined in the package's modules that set ``attr`` themselves (not inherit it)."""
    modules = {f"{package}.{m.name}" for m in pkgutil.iter_modules(path)}
    for name in sorted(modules):
        importlib.import_module(name)
    found: dict[str, type[T]] = {}
    todo = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        key = vars(cls).get(attr) if own else getattr(cls, attr, None)
        if not key or (own and cls.__module__ not in modules):
            continue
        if key in found and found[key] is not cls:
            raise RuntimeError(f"two {what} are named {key!r}: {found[key]} and {cls}")
        found[key] = cls
    return dict(sorted(found.items()))

"""Reading a YAML file someone else may have written (a run config, a prompt template) with bounds:
a regular file of at most ``MAX_YAML_BYTES``, UTF-8, no key twice in one mapping, and at most
``MAX_YAML_NODES`` nodes and ``MAX_YAML_EXPANDED_BYTES`` bytes of scalars once every alias is
expanded. An alias bomb (a few lines whose aliases expand to billions of nodes, or 90,000 aliases
of one 3 MiB string: few nodes, gigabytes once the config is copied or serialised) or
``/dev/zero`` then fails in milliseconds with one line instead of filling memory while the run
directory is locked; a FIFO is refused instead of blocking.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable

import yaml

from embed_core.errors import ConfigError

MAX_YAML_BYTES = 4 * 1024 * 1024
MAX_YAML_NODES = 100_000
# Scalar bytes (UTF-8) of the document with its aliases expanded: four times what the file itself may hold.
MAX_YAML_EXPANDED_BYTES = 4 * MAX_YAML_BYTES


class _BoundedLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that appears twice in one mapping (plain YAML keeps the
    last value silently, so an edited config could lose a list of sources without a word) and a
    document that expands (aliases counted at every use) to more than ``MAX_YAML_NODES`` nodes."""

    def construct_document(self, node):
        if _expanded_size(node, {}, _one, MAX_YAML_NODES) > MAX_YAML_NODES:
            raise yaml.constructor.ConstructorError(
                None, None, f"expands to more than {MAX_YAML_NODES} values once its aliases (*name) are "
                "followed; write the values out or use fewer nested aliases", node.start_mark)
        if _expanded_size(node, {}, _scalar_bytes, MAX_YAML_EXPANDED_BYTES) > MAX_YAML_EXPANDED_BYTES:
            raise yaml.constructor.ConstructorError(
                None, None, f"expands to more than {MAX_YAML_EXPANDED_BYTES // 2 ** 20} MiB of text once its aliases "
                "(*name) are followed (each use of an alias counts its value again); write the values out or "
                "alias less text", node.start_mark)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<: *base' merges keys that this mapping may override: not a duplicate
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _one(node: yaml.Node) -> int:
    return 1


def _scalar_bytes(node: yaml.Node) -> int:
    return len(node.value.encode("utf-8", "surrogatepass")) if isinstance(node, yaml.ScalarNode) else 0


def _expanded_size(node: yaml.Node, sizes: dict[int, int], weight: Callable[[yaml.Node], int], cap: int) -> int:
    """The summed ``weight`` (1: nodes; scalar bytes) of ``node`` with every alias expanded,
    computed once per distinct node (an alias is the same node object as its anchor), so the count
    costs the file's size, not its expansion. Capped just above ``cap`` so the sum itself stays small."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = cap + 1  # a node reached again while being counted: a cycle
    if isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    else:
        children = []
    total = min(weight(node), cap + 1)
    for child in children:
        total = min(total + _expanded_size(child, sizes, weight, cap), cap + 1)
    sizes[id(node)] = total
    return total


def _read_bounded(path: Path) -> bytes:
    """The bytes of ``path`` if it is a regular file within the size bound; else one ConfigError."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:  # ELOOP (a symlink loop), EACCES, ENAMETOOLONG, ...
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path}: is a directory, expected a YAML file")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path}: not a regular file (a device, pipe or socket); give a YAML file")
    if info.st_size > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: {info.st_size} bytes, more than the {MAX_YAML_BYTES // 2 ** 20} MiB a YAML "
                          "file may have here")
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    if len(data) > MAX_YAML_BYTES:  # grew since the stat
        raise ConfigError(f"{path}: more than the {MAX_YAML_BYTES // 2 ** 20} MiB a YAML file may have here")
    return data


def read_yaml(path: str | Path) -> Any:
    """A YAML file's content; a missing, unreadable, irregular, oversized, non-UTF-8 or invalid file
    (duplicate keys and alias bombs included) is a ConfigError naming the file and where in it."""
    path = Path(path)
    data = _read_bounded(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{data[exc.start]:02x}); save the file as UTF-8") from None
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None

"""Containment: reading inside a root (a run directory, a model directory, a data root) never
follows a symbolic link out of it.

Run directories and data folders may come from others; a link in them to ``~/.ssh/id_rsa`` must
not be read into an artifact, a model release or an upload. So, as a package manager refuses to
follow links out of the tree it installs, every walk over a tree embedpipe did not just write goes
through these helpers: a link whose target stays inside the root is read as that target; one that
leaves it is an ``OutsideRootError`` naming the link and its target.
"""

from __future__ import annotations

import os
from pathlib import Path

from embed_core.errors import EmbedpipeError


class OutsideRootError(EmbedpipeError):
    """A path under a root resolves (through a symbolic link) to a place outside that root."""


def resolve_within(root: str | Path, path: str | Path) -> Path:
    """``path`` (absolute, or relative to ``root``) with every link resolved, or ``OutsideRootError``
    when that leaves ``root``."""
    base = Path(root).resolve()
    full = Path(root) / path
    target = full.resolve()
    if target != base and not target.is_relative_to(base):
        raise OutsideRootError(f"{full}: a symbolic link to {target}, outside {Path(root)}; refusing to read it "
                               "(links may not leave the directory they are in: replace the link by the file)")
    return target


def files_within(root: str | Path) -> list[Path]:
    """Every file under ``root`` (paths under ``root``, sorted), found without following links to
    directories; a link to a file is listed when its target is inside ``root``, an error when not
    (``OutsideRootError``); a link to a directory is skipped when inside, an error when not."""
    root = Path(root)
    if not root.is_dir():
        return []
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        for name in dirnames:
            if (here / name).is_symlink():
                resolve_within(root, here / name)  # a link to a directory inside is walked where it points
        for name in filenames:
            path = here / name
            if path.is_symlink():
                target = resolve_within(root, path)
                if not target.is_file():
                    continue  # dangling, or a special file
            elif not path.is_file():
                continue  # a FIFO, a socket, a device
            out.append(path)
    return sorted(out)

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
import stat
from pathlib import Path

from embed_core.errors import EmbedpipeError


class OutsideRootError(EmbedpipeError):
    """A path under a root resolves (through a symbolic link) to a place outside that root."""


class NotAFileError(EmbedpipeError):
    """A path where a file is expected is missing, a directory, or no regular file (a FIFO, a
    device, a socket)."""


def file_problem(path: str | Path) -> str | None:
    """Why ``path`` (links followed) cannot be read as a file, or None when it is a regular file:
    the one rule every reader of a file it is given applies before opening it, so a directory or a
    FIFO there is one line naming it, not a library's ``IsADirectoryError`` (or a read that hangs)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "not found"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISDIR(mode):
        return "is a directory, expected a file"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a FIFO, a device or a socket), expected a file"
    return None


def regular_file(path: str | Path, hint: str = "") -> Path:
    """``path`` when it is a regular file (``file_problem``), else a ``NotAFileError`` naming it,
    with ``hint`` (what to do) after the reason."""
    problem = file_problem(path)
    if problem is not None:
        raise NotAFileError(f"{path}: {problem}" + (f"; {hint}" if hint else ""))
    return Path(path)


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

"""A run directory's own bookkeeping: the lock that keeps two runs out of one directory, the
snapshot of the config it was last run with, and the history of stage results.

``<run_dir>/.embedpipe``    the marker: written when embedpipe makes a directory a run directory. Only an
                            empty (or new) directory, or one already marked, becomes one: embedpipe never
                            deletes or replaces a file in a folder of yours (see ``claim_run_dir``).
``<run_dir>/.lock``         held (``flock``) while a flow works in the directory; its text names the holder.
``<run_dir>/config.yaml``   the config of the latest run that committed a stage (a failed run leaves it as it
                            was), so ``embedpipe <stage> --run-dir D`` needs no ``--config``.
``<run_dir>/history.jsonl`` one line per stage result: computed or cache hit, when, how long.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

from embed_core import __version__
from embed_core.artifacts import atomic_write_bytes, clean_leftovers, read_manifest
from embed_core.config import RunConfig, load_config
from embed_core.errors import EmbedpipeError, printable
from embed_core.paths import file_problem

log = logging.getLogger("embedpipe.rundir")

MARKER = ".embedpipe"
LOCK_FILE = ".lock"
CONFIG_SNAPSHOT = "config.yaml"
HISTORY = "history.jsonl"
SNAPSHOT_HEADER = "# Written by embedpipe: the config of this run directory's latest run.\n"


class RunDirBusy(EmbedpipeError):
    """Another process is working in the run directory."""


class RunDirError(EmbedpipeError):
    """The run directory cannot be created or written."""


# Locks this process holds, by resolved run dir: a flow that calls another flow on the same run
# dir (data-watch -> pipeline) re-enters instead of deadlocking on its own flock.
_held: dict[str, tuple[int, int]] = {}
_held_guard = threading.Lock()
_created: dict[str, Path] = {}  # run directories this process made -> the topmost directory it made for it


@contextmanager
def run_dir_lock(run_dir: str | Path, purpose: str = "", token: str | None = None) -> Iterator[None]:
    """Hold ``<run_dir>/.lock`` for the block, or raise :class:`RunDirBusy` naming the holder.

    ``flock`` is released by the kernel when its holder dies, so a killed run never leaves a
    stale lock behind; the file's text says who holds it (and ``token``, e.g. the Prefect flow
    run id, which a run it starts on another pool shows to work in the directory under this lock).
    """
    run_dir = Path(run_dir)
    claim_run_dir(run_dir)
    key = str(run_dir.resolve())
    with _held_guard:
        if key in _held:
            fd, depth = _held[key]
            _held[key] = (fd, depth + 1)
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _held_guard:
                fd, depth = _held[key]
                _held[key] = (fd, depth - 1)
        return

    fd = _open_lock_file(run_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _busy(run_dir) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "purpose": purpose,
                                  "token": token, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "command": " ".join(sys.argv)[:300]}).encode(), 0)
        os.fsync(fd)  # the holder's token must be readable from another worker of a shared volume
        with _held_guard:
            _held[key] = (fd, 1)
        for action in clean_leftovers(run_dir):  # what a killed run left behind; nobody else is in here now
            log.info("%s: %s", run_dir, action)
        yield
    finally:
        with _held_guard:
            _held.pop(key, None)
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        _discard_if_unused(run_dir)


def raise_if_busy(run_dir: str | Path) -> None:
    """Raise what :func:`run_dir_lock` would raise right now, holding nothing afterwards:
    :class:`RunDirError` when the directory cannot be created or written, :class:`RunDirBusy`
    when another process holds its lock. A command calls it to refuse a busy run directory before
    it starts anything slow; the lock itself is taken where the work is done."""
    run_dir = Path(run_dir)
    claim_run_dir(run_dir)
    if str(run_dir.resolve()) in _held:
        return  # this process holds it: run_dir_lock re-enters
    fd = _open_lock_file(run_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a probe, released at once by close
    except BlockingIOError:
        raise _busy(run_dir) from None
    finally:
        os.close(fd)


def claim_run_dir(run_dir: str | Path) -> None:
    """Make ``run_dir`` a run directory, or check that it is one, or raise :class:`RunDirError`.

    A run directory is embedpipe's own: it is created (with its marker) when missing or empty, and
    accepted when it carries the marker (a JSON object naming the embedpipe version that wrote it,
    ``is_marked``), or holds what only embedpipe writes (a stage directory with a valid manifest, a
    config snapshot with embedpipe's first line: a run directory of a version before the marker,
    which then gets it). A file name alone proves nothing: a folder holding ``history.jsonl`` or an
    ``.embedpipe`` that is not the marker is anybody's. Any other folder is refused, naming it and
    a file in it, before anything in it is touched (nothing is written or deleted: the lock file
    and the clean-up of leftovers come after this check), as git refuses to clone into a non-empty
    folder. In a marked directory embedpipe replaces only its own entries: stage directories with a
    manifest, its config snapshot, and leftovers named the way its writers name them
    (``artifacts.clean_leftovers``).
    """
    run_dir = Path(run_dir)
    _make_dir(run_dir)
    if is_marked(run_dir):
        _check_snapshot_slot(run_dir)
        return
    try:
        entries = sorted(e.name for e in os.scandir(run_dir) if e.name != LOCK_FILE)
    except OSError as exc:
        raise RunDirError(f"{run_dir}: cannot read the run directory: {exc.strerror}") from None
    if entries and not _written_by_embedpipe(run_dir, entries):
        shown = ", ".join(printable(e, 60) for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise RunDirError(f"{run_dir}: not an embedpipe run directory and not empty (it holds {shown}); embedpipe "
                          "never writes into a folder of yours: pass a new or empty --run-dir / run_dir")
    _check_snapshot_slot(run_dir)  # before the marker: a refused folder keeps no trace of the attempt
    try:
        atomic_write_bytes(run_dir / MARKER, (json.dumps({"embedpipe": __version__, "since": _now()}) + "\n").encode())
    except OSError as exc:
        raise RunDirError(f"{run_dir}: cannot write in the run directory: {exc.strerror}") from None


def _check_snapshot_slot(run_dir: Path) -> None:
    """Refuse, before a run starts, a run directory whose ``config.yaml`` someone else put there:
    the run would end by replacing it with its config snapshot."""
    path = run_dir / CONFIG_SNAPSHOT
    if path.exists() and not is_own_snapshot(path):
        raise RunDirError(f"{path}: not a config snapshot embedpipe wrote, and a run would replace it; move it "
                          "out of the run directory")


def is_marked(run_dir: str | Path) -> bool:
    """True when ``run_dir`` carries embedpipe's marker: a regular file ``.embedpipe`` holding the
    JSON object ``claim_run_dir`` writes (the embedpipe version and when). A file of that name with
    other content (another tool's, an empty one) does not make a folder a run directory."""
    path = Path(run_dir) / MARKER
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as fh:
            marker = json.loads(fh.read(4096))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and isinstance(marker.get("embedpipe"), str) and isinstance(marker.get("since"), str)


def _written_by_embedpipe(run_dir: Path, entries: list[str]) -> bool:
    """A run directory from before the marker: it holds a config snapshot embedpipe wrote, or a
    stage directory with a valid manifest. A ``history.jsonl`` is no proof: it is a name any tool
    may use."""
    if is_own_snapshot(run_dir / CONFIG_SNAPSHOT):
        return True
    return any(read_manifest(run_dir, name) is not None for name in entries
               if (run_dir / name).is_dir() and not (run_dir / name).is_symlink())


def is_own_snapshot(path: Path) -> bool:
    """True when ``path`` is a config snapshot embedpipe wrote (its first line says so)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(SNAPSHOT_HEADER.encode())) == SNAPSHOT_HEADER.encode()
    except OSError:
        return False


def _make_dir(run_dir: Path) -> None:
    missing = [p for p in [run_dir, *run_dir.parents] if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if missing:  # made by this process: gone again if its run refuses before writing anything
            _created[str(run_dir.resolve())] = missing[-1].resolve()
    except FileExistsError:
        raise RunDirError(f"{run_dir}: cannot be a run directory: it (or a parent) is a file") from None
    except NotADirectoryError:
        raise RunDirError(f"{run_dir}: cannot be a run directory: a parent of it is a file") from None
    except OSError as exc:
        raise RunDirError(f"{run_dir}: cannot create the run directory: {exc.strerror}") from None


def _discard_if_unused(run_dir: Path) -> None:
    """Remove ``run_dir`` (and the parents made with it) when this process created it and nothing but
    its marker and lock is in it: a refused run (a missing upstream stage, a bad launch) leaves no
    directory behind. A directory anything was written into is kept, and forgotten."""
    top = _created.pop(str(run_dir.resolve()), None)
    if top is None:
        return
    try:
        if {e.name for e in os.scandir(run_dir)} - {MARKER, LOCK_FILE}:
            return
        for name in (MARKER, LOCK_FILE):
            (run_dir / name).unlink(missing_ok=True)
        for path in [run_dir, *run_dir.parents]:
            path.rmdir()  # an empty directory only
            if path == top:
                break
    except OSError:
        return  # in use after all (another process wrote into it): kept


def _open_lock_file(run_dir: Path) -> int:
    try:
        return os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise RunDirError(f"{run_dir}: cannot write in the run directory: {exc.strerror}") from None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _busy(run_dir: Path) -> RunDirBusy:
    holder = (run_dir / LOCK_FILE).read_text(encoding="utf-8", errors="replace").strip() or "unknown process"
    return RunDirBusy(f"{run_dir}: another embedpipe run is using this run directory ({holder}); "
                      "wait for it to finish or pass another --run-dir / run_dir")


def lock_holder(run_dir: str | Path) -> str | None:
    """Who holds the run directory's lock right now (its recorded text), or None when it is free."""
    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return None
    key = str(Path(run_dir).resolve())
    if key in _held:
        return path.read_text(encoding="utf-8", errors="replace").strip() or "this process"
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return path.read_text(encoding="utf-8", errors="replace").strip() or "unknown process"
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def lock_token(run_dir: str | Path) -> str | None:
    """The token the run directory's lock was taken under (see ``run_dir_lock``), if any."""
    path = Path(run_dir) / LOCK_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("token")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def check_delegated(run_dir: str | Path, token: str) -> None:
    """For a run started on another work pool by the run that holds the directory's lock: the
    directory must be visible here, and its lock must be held under ``token``."""
    run_dir = Path(run_dir)
    if not (run_dir / LOCK_FILE).exists():
        raise EmbedpipeError(f"{run_dir}: not visible from this worker ({socket.gethostname()}): the run directory must "
                             "be on storage both work pools mount (set run_root to a shared volume or bucket mount)")
    if lock_token(run_dir) != token:
        holder = lock_holder(run_dir) or "nobody"
        raise RunDirBusy(f"{run_dir}: started under the lock of run {token}, but the directory's lock is held by "
                         f"{holder}; run it without parent_lock")


def save_config_snapshot(run_dir: str | Path, config: RunConfig) -> Path:
    """Write the config this run uses to ``<run_dir>/config.yaml``.

    ``data_root`` and ``run_root`` are written as absolute paths so the snapshot works from any
    working directory; stage fingerprints key files by their path under ``data_root``, so cache
    keys are the same for the config and its snapshot.
    """
    path = Path(run_dir) / CONFIG_SNAPSHOT
    _check_snapshot_slot(Path(run_dir))
    body = yaml.safe_dump(portable_config(config), sort_keys=False, allow_unicode=True)
    atomic_write_bytes(path, (SNAPSHOT_HEADER + body).encode())
    return path


def portable_config(config: RunConfig) -> dict:
    """``config`` as plain data with ``data_root`` and ``run_root`` absolute: it means the same
    from any working directory (the snapshot; the config a run sends to another work pool)."""
    data = config.model_dump(mode="json")
    data["data_root"] = str(Path(config.data_root).expanduser().resolve())
    data["run_root"] = str(Path(config.run_root).expanduser().resolve())
    return data


def load_config_snapshot(run_dir: str | Path) -> RunConfig:
    path = Path(run_dir) / CONFIG_SNAPSHOT
    if not path.exists():
        raise EmbedpipeError(f"{path}: not found — pass --config (this run directory has not been run yet)")
    return load_config(path)


def append_history(run_dir: str | Path, entry: dict[str, Any]) -> None:
    """Append one stage result; a single ``write`` of one line keeps concurrent appends whole."""
    line = json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **entry}, sort_keys=True) + "\n"
    path = Path(run_dir) / HISTORY
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)


MAX_HISTORY_LINE = 64 * 1024  # an entry is a few hundred bytes; a longer line is not one


def read_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's stage results, oldest first. What is not an entry — a line cut by a crash, bytes
    that are not UTF-8 or JSON, a JSON value that is not an object naming its stage, a line longer
    than any entry — is skipped (the file is a log others may have damaged, never a reason to fail
    ``status``), and a line is never held past ``MAX_HISTORY_LINE`` bytes."""
    path = Path(run_dir) / HISTORY
    if file_problem(path) is not None:
        return []
    out = []
    with open(path, "rb") as fh:
        while line := fh.readline(MAX_HISTORY_LINE + 1):
            if len(line) > MAX_HISTORY_LINE and not line.endswith(b"\n"):
                while (rest := fh.readline(MAX_HISTORY_LINE)) and not rest.endswith(b"\n"):
                    pass  # the rest of an over-long line, dropped chunk by chunk
                continue
            entry = _history_entry(line)
            if entry is not None:
                out.append(entry)
    return out


def _history_entry(line: bytes) -> dict[str, Any] | None:
    try:
        entry = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("stage"), str):
        return None
    seconds = entry.get("seconds")
    return {**entry, "cached": entry.get("cached") is True, "at": str(entry.get("at", "")),
            "seconds": seconds if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else None}



"""Typed flow parameters and the run-directory context shared by the flows (the Prefect UI renders
the parameters as a form)."""

from __future__ import annotations

import functools
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from embed_core.config import RunConfig, load_config, parse_config
from embed_core.errors import ConfigError
from embed_core.rundir import check_delegated, run_dir_lock
from embed_core.safe_yaml import read_yaml
from flows.env import apply_defaults

DEFAULT_CONFIG = "deployments/configs/demo.yaml"

# The run arguments every flow takes, as its docstring documents them (the UI shows each under its
# field). No angle brackets: the UI renders descriptions as HTML.
RUN_ARGS_DOC = """config_path: YAML run config, a path on the worker (relative to the repository root).
        config: inline config, merged over config_path's like ``extends`` (mappings key by key; lists and values replace), so it need only hold what changes, e.g. {"run_name": "try-2", "train": {"work_pool": null}}; with config_path empty, it is the whole config.
        run_name: the run's name (its directory, and the flow run's name unless one is typed for the run); overrides the config's run_name.
        run_dir: run directory; defaults to {run_root}/{run_name}."""


def with_run_args_doc(fn):
    """``{run_args}`` in ``fn``'s docstring becomes :data:`RUN_ARGS_DOC` (one text for every flow)."""
    fn.__doc__ = (fn.__doc__ or "").replace("{run_args}", RUN_ARGS_DOC)
    return fn


def resolve_run(config_path: str | None, config: dict[str, Any] | RunConfig | None, run_dir: str | None,
                run_name: str | None = None) -> tuple[RunConfig, str]:
    """The run's config and directory. ``config`` (a flow run's inline config) is merged over
    ``config_path``'s file like ``extends`` (mappings key by key; lists and values replace); with
    no ``config_path`` it is the whole config. ``run_name`` overrides the config's; ``run_dir``
    defaults to ``{run_root}/{run_name}``."""
    if isinstance(config, RunConfig):  # a whole config from Python (the CLI, a parent flow, a test): validated once
        cfg = config
    elif config_path:
        cfg = load_config(config_path, overrides=config)
    elif config:
        cfg = parse_config(dict(config), origin="the inline config")
    else:
        raise ConfigError("give config_path, or the whole config inline")
    if run_name:
        cfg = cfg.with_run_name(run_name)
    return cfg, str(Path(run_dir) if run_dir else cfg.default_run_dir())


def with_corpus_path(config: RunConfig, corpus_path: str | None) -> RunConfig:
    """``config`` with its one corpus source (``kind: corpus``) reading ``corpus_path`` (a folder or
    file; relative to data_root, or absolute), validated again; unchanged without a path. A config
    with no or several corpus sources is refused (edit its sources, or the inline config, instead)."""
    if not corpus_path:
        return config
    corpora = [i for i, s in enumerate(config.prepare.sources) if s.kind == "corpus"]
    if len(corpora) != 1:
        names = ", ".join(config.prepare.sources[i].name for i in corpora)
        raise ConfigError(f"corpus_path {corpus_path}: the config has {len(corpora)} corpus sources (kind: corpus)"
                          f"{': ' + names if names else ''}; corpus_path points exactly one at a folder (with several, "
                          "set prepare.sources in the inline config)")
    raw = config.model_dump(mode="json")
    raw["prepare"]["sources"][corpora[0]]["path"] = corpus_path
    return parse_config(raw, origin=f"the config with corpus_path {corpus_path}")


@contextmanager
def run_context(config: RunConfig, run_dir: str, purpose: str, parent_lock: str | None = None) -> Iterator[None]:
    """Hold the run directory's lock (a second run on it is refused, never interleaved): the one
    place it is taken, for a run started from the CLI and from the UI alike (the CLI only checks
    beforehand that it is free, ``raise_if_busy``). The config snapshot (for ``embedpipe <stage>
    --run-dir D`` and ``embedpipe status``) is written by each stage that completes, so a run that
    fails before any stage leaves the last good one. The environment defaults (``flows.env``) are
    applied first, for a flow run in a worker whose environment lacks them.

    ``parent_lock``: this run was started on another work pool by the run that holds the lock (its
    flow run id); it works under that lock after checking the directory is visible and held by it."""
    apply_defaults()
    if parent_lock:
        check_delegated(run_dir, parent_lock)
        yield
        return
    from prefect.runtime import flow_run

    with run_dir_lock(run_dir, purpose, token=flow_run.id):
        yield


def run_name_of(parameters: dict) -> str:
    """The run name a flow run's parameters give: ``run_name``, else the config's (inline, then
    file). A config that does not load still names the run: its ``run_name`` as written, else
    the file's stem, so a failed run is found under the name its user gave it."""
    if parameters.get("run_name"):
        return str(parameters["run_name"])
    config = parameters.get("config")
    inline = config.run_name if isinstance(config, RunConfig) else dict(config or {}).get("run_name")
    if inline:
        return str(inline)
    path = parameters.get("config_path") if "config_path" in parameters else DEFAULT_CONFIG
    if not path:
        return RunConfig.model_fields["run_name"].default
    try:
        return load_config(path).run_name
    except Exception:  # noqa: BLE001 — the flow itself reports a bad config; the name must not fail first
        return _written_run_name(Path(path))


def _written_run_name(path: Path) -> str:
    try:
        written = read_yaml(path).get("run_name")
    except Exception:  # noqa: BLE001 — unreadable: the stem
        written = None
    return written if isinstance(written, str) and written else path.stem


def flow_run_name() -> str:
    """Prefect flow-run name: a name the user typed for the run (the UI's Run Name field, ``name``
    of ``run_deployment``) stays; one Prefect generated (``adjective-animal``) becomes the
    embedpipe run name, so the UI lists runs by what they write."""
    from prefect.runtime import flow_run

    given = flow_run.name
    if given and not is_generated_name(given):
        return given
    return run_name_of(flow_run.parameters)


# The Prefect UI's Run Name field comes filled with a name of its own: a Greek letter, maybe with a
# number, and a constellation, maybe with a suffix ("lambda2-arietis", "mu-canis-majoris-nebula").
_UI_NAME = re.compile(r"(?:alpha|beta|gamma|delta|epsilon|zeta|eta|theta|iota|kappa|lambda|mu|nu|xi|omicron|pi|rho"
                      r"|sigma|tau|upsilon|phi|chi|psi|omega)\d*(?:-[a-z]+)+")


def is_generated_name(name: str) -> bool:
    """Whether ``name`` is one Prefect makes up for a run nobody named: the UI form's suggestion
    (a Greek letter and a constellation) or the API's (two words of its name generator's lists,
    ``coolname``: an adjective, then an animal) joined by dashes."""
    if _UI_NAME.fullmatch(name):
        return True
    words = _generator_words()
    parts = name.split("-")
    if words is None:  # the generator's lists are not readable: the shape alone
        return len(parts) == 2 and all(p.isalpha() and p.islower() for p in parts)
    return len(parts) == 2 and parts[0] in words[0] and parts[1] in words[1]


@functools.cache
def _generator_words() -> tuple[frozenset[str], frozenset[str]] | None:
    """The two word lists Prefect's run names are drawn from (``prefect.utilities.names.generate_slug(2)``
    draws coolname's two-word slugs, its ``an`` list: adjectives x animals)."""
    try:
        from coolname.data import config
    except ImportError:
        return None

    def words(name: str) -> set[str]:
        entry = config[name]
        if "lists" in entry:
            return {w for sub in entry["lists"] for w in words(sub)}
        return {w for w in entry.get("words", ()) if isinstance(w, str)}

    try:
        first, second = config["an"]["lists"]
        return frozenset(words(first)), frozenset(words(second))
    except (KeyError, ValueError, TypeError):
        return None

"""The transformers versions embedpipe runs on, checked where a model is built.

From 5.2 on, transformers passes ``config.is_causal`` to every attention call (eager, SDPA,
FlashAttention) and builds bidirectional masks from it (huggingface/transformers#43705); before,
FlashAttention-2 kept each module's hard-coded ``is_causal = True``, so a decoder made bidirectional
silently stayed causal, and the packed passes' helpers (``is_flash_attention_requested``,
``packed_sequence_mask_function``) do not exist. ``pyproject.toml`` requires the same range (a
layout test keeps the two equal); an older transformers on a GPU machine, where the bundle keeps
what the machine has, is refused with one line here.
"""

from __future__ import annotations

import functools

from embed_core.errors import ConfigError

TRANSFORMERS_RANGE = ">=5.2,<6"


def transformers_problem(installed: str) -> str | None:
    """Why transformers ``installed`` cannot run embedpipe's models (one line), or None."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = Version(installed) in SpecifierSet(TRANSFORMERS_RANGE)
    except InvalidVersion:
        return f"transformers reports the version {installed!r}, which is not a version number"
    if ok:
        return None
    return (f"transformers {installed} is installed; embedpipe needs transformers{TRANSFORMERS_RANGE} (bidirectional "
            f"decoders and packed passes): pip install 'transformers{TRANSFORMERS_RANGE}'")


@functools.cache
def require_transformers() -> None:
    """A ConfigError (one line) unless the installed transformers is in ``TRANSFORMERS_RANGE``."""
    from importlib.metadata import version

    problem = transformers_problem(version("transformers"))
    if problem:
        raise ConfigError(problem)

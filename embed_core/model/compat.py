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


def installed_transformers() -> str | None:
    """The installed transformers' version, read from its metadata (transformers not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def transformers_problem(installed: str | None) -> str | None:
    """Why transformers ``installed`` (None: not installed) cannot run embedpipe's models (one
    line), or None."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    install = f"pip install 'transformers{TRANSFORMERS_RANGE}'"
    if installed is None:
        return f"transformers is not installed; embedpipe needs transformers{TRANSFORMERS_RANGE}: {install}"
    try:
        ok = Version(installed) in SpecifierSet(TRANSFORMERS_RANGE)
    except InvalidVersion:
        return f"transformers reports the version {installed!r}, which is not a version number: {install}"
    if ok:
        return None
    return (f"transformers {installed} is installed; embedpipe needs transformers{TRANSFORMERS_RANGE} (bidirectional "
            f"decoders and packed passes): {install}")


@functools.cache
def require_transformers() -> None:
    """A ConfigError (one line) unless the installed transformers is in ``TRANSFORMERS_RANGE``."""
    problem = transformers_problem(installed_transformers())
    if problem:
        raise ConfigError(problem)


def deepspeed_only_once_imported() -> None:
    """Keep ``save_pretrained`` from importing DeepSpeed (and MLflow, which DeepSpeed imports) in a
    process that does not use it.

    transformers' ``save_pretrained`` unwraps the model with accelerate's
    ``extract_model_from_parallel``, which imports DeepSpeed whenever it is installed (the
    ``deepspeed`` and ``dev`` extras) to ask whether the model is a ``DeepSpeedEngine``: about 7
    CPU-seconds of imports in every process that saves a model. A model can only be wrapped in a
    ``DeepSpeedEngine`` by a process that imported DeepSpeed, so accelerate's availability check is
    answered there as installed *and* already imported; a DeepSpeed run (which imports it to build
    its engine) unwraps as before. Idempotent; without accelerate there is nothing to change."""
    import sys

    try:
        from accelerate.utils import other
    except ImportError:
        return
    installed = other.is_deepspeed_available
    if getattr(installed, "only_once_imported", False):
        return

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and installed()

    is_deepspeed_available.only_once_imported = True
    other.is_deepspeed_available = is_deepspeed_available

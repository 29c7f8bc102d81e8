"""A rank that ``embed_core.dist.spawn.local_ranks`` started: ``python -m embed_core.dist.spawned
<spec.json>`` runs the body the spec names (``module:function``, the training stage's) on the
stage the spec names as one of the launched ranks (its environment holds
the rank, the world size and the rendezvous address). It ends as a launched rank does
(``rank_ending_cleanly``: its process groups destroyed, a SIGTERM obeyed even in a C++ collective),
and an error of the user's input or machine (a collective that timed out included) ends it with
exit code 2 and one line, ``embedpipe: error: ...``, last in its log, where rank 0 reads it."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(spec_path: str) -> int:
    from embed_core.errors import user_error
    from embed_core.dist.distributed import rank_ending_cleanly

    try:
        with rank_ending_cleanly():
            _train(spec_path)
    except Exception as exc:  # noqa: BLE001 — the error boundary, as the CLI's
        message = user_error(exc)
        if message is None:
            raise
        print(f"embedpipe: error: {message}", file=sys.stderr, flush=True)
        return 2
    return 0


def _train(spec_path: str) -> None:
    import importlib

    from embed_core.config import RunConfig

    spec = json.loads(Path(spec_path).read_text())
    module, _, name = spec["body"].partition(":")
    body = getattr(importlib.import_module(module), name)
    body(RunConfig.model_validate(spec["config"]), spec["run_dir"], spec["stage"],
         upstream=spec["upstream"], resume=spec["resume"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""A rank that ``embed_core.train.spawn.local_ranks`` started: ``python -m embed_core.train.spawned
<spec.json>`` trains the stage the spec names as one of the launched ranks (its environment holds
the rank, the world size and the rendezvous address)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(spec_path: str) -> None:
    from embed_core.config import RunConfig
    from embed_core.train.run import run_train_stage

    spec = json.loads(Path(spec_path).read_text())
    run_train_stage(RunConfig.model_validate(spec["config"]), spec["run_dir"], spec["stage"],
                    upstream=spec["upstream"], resume=spec["resume"])


if __name__ == "__main__":
    main(sys.argv[1])

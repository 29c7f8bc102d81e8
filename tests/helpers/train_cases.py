"""Train several run configurations one after another in one launch, each into its own run
directory, through the train stage as the CLI runs it (``embed_core.stages``; every rank runs it,
rank 0 commits). Under ``torchrun`` the ranks share one process group for all cases, so a matrix
of back ends and options costs one launch, not one per row. Usage::

    torchrun --standalone --nproc_per_node N tests/helpers/train_cases.py SPEC.json
    python tests/helpers/train_cases.py SPEC.json        # one process (the reference runs)

SPEC.json: ``{"cases": [{"config": {...RunConfig...}, "run_dir": "..."}]}``; each run directory
already holds the ``prepare`` stage the config's training reads.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(spec_path: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)  # "resumed from ..."
    from embed_core import stages
    from embed_core.config import RunConfig
    from embed_core.dist.distributed import destroy_process_group

    spec = json.loads(Path(spec_path).read_text())
    try:
        for case in spec["cases"]:
            config = RunConfig.model_validate(case["config"])
            stage = stages.get("train")
            ctx = stages.context(config, case["run_dir"], stage)
            fingerprint, hit = stages.cache_decision(stage, ctx)
            if not hit:
                stage.run(ctx, fingerprint)
            print(f"case done: {case['run_dir']}", flush=True)
    finally:
        destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

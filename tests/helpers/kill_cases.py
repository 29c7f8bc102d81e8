"""``train_cases.py`` with one rank that SIGKILLs itself right after a given optimizer step (a real
crash: no cleanup, no exception handlers), so the launch dies mid-stage. Usage::

    torchrun --standalone --nproc_per_node N tests/helpers/kill_cases.py RANK STEP SPEC.json
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from embed_core.train.trainer import Trainer  # noqa: E402
from tests.helpers.train_cases import main  # noqa: E402

kill_rank, kill_after = int(sys.argv[1]), int(sys.argv[2])
train_step = Trainer.train_step


def train_step_then_die(self):
    rows = train_step(self)
    if self.rank == kill_rank and self.step == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    return rows


Trainer.train_step = train_step_then_die
main(sys.argv[3])

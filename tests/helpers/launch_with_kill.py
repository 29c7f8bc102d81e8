"""``embedpipe`` under a launcher, with one rank that SIGKILLs itself right after a given optimizer
step (a real crash: no cleanup, no exception handlers). Usage, as the launcher's script:

    torchrun --standalone --nproc_per_node 2 tests/helpers/launch_with_kill.py RANK STEP train --config ...
"""

import os
import signal
import sys
from pathlib import Path

# the checkout this script is in, before an installed copy: a script's own directory, not the working
# directory, is first on sys.path (a git worktree would otherwise run the main checkout's code)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from embed_core.train.trainer import Trainer  # noqa: E402
from flows.cli import main  # noqa: E402

kill_rank, kill_after = int(sys.argv[1]), int(sys.argv[2])
train_step = Trainer.train_step


def train_step_then_die(self):
    rows = train_step(self)
    if self.rank == kill_rank and self.step == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    return rows


Trainer.train_step = train_step_then_die
sys.exit(main(sys.argv[3:]))

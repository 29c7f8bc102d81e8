"""``embedpipe`` under a launcher, with one rank that stalls before a given optimizer step's work (a
rank stuck outside any collective: a slow filesystem, a deadlocked data loader), while the others
go on into the step's first collective and wait there. Usage, as the launcher's script:

    torchrun --standalone --nproc_per_node 2 tests/helpers/launch_with_stall.py RANK STEP train --config ...

Before stalling the rank writes ``stalled`` (the time, in seconds since the epoch) into the
directory ``STALL_DIR`` names. ``STALL_IGNORES_SIGTERM=1``: the stalled rank ignores SIGTERM too (a
rank hung where no signal handler helps), so only SIGKILL ends it.
"""

import os
import signal
import sys
import time
from pathlib import Path

# the checkout this script is in, before an installed copy: a script's own directory, not the working
# directory, is first on sys.path (a git worktree would otherwise run the main checkout's code)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from embed_core.train.engine.trainer import Trainer  # noqa: E402
from flows.cli import main  # noqa: E402

stall_rank, stall_before = int(sys.argv[1]), int(sys.argv[2])
train_step = Trainer.train_step


def stall_then_train_step(self):
    if self.rank == stall_rank and self.step + 1 == stall_before:
        if os.environ.get("STALL_IGNORES_SIGTERM") == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        Path(os.environ["STALL_DIR"], "stalled").write_text(str(time.time()))
        time.sleep(3600)
    return train_step(self)


Trainer.train_step = stall_then_train_step
sys.exit(main(sys.argv[3:]))

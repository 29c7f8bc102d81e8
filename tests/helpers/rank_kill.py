"""A rank that SIGKILLs itself right after a given optimizer step (a real crash: no cleanup, no
exception handlers), armed by patching the trainer's step in this process only."""

import os
import signal


def arm(kill_rank: int, kill_after: int) -> None:
    from embed_core.train.engine.trainer import Trainer

    train_step = Trainer.train_step

    def train_step_then_die(self):
        rows = train_step(self)
        if self.rank == kill_rank and self.step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return rows

    Trainer.train_step = train_step_then_die

"""Work one rank does for all: under a multi-process launch (``torchrun``, ``deepspeed``,
``accelerate launch``, or the ranks ``train.processes`` starts) every rank runs the train command,
but a step that is not training itself — re-mining (``mine-<stage>``), targeted synthesis
(``synth-<stage>``), AutoRegEmbed's reference scores (``reference-<stage>``) and the commit of a
trained stage (its model, with a ``merge`` averaged in) — must run once and commit once. Two
staging directories of one stage would each delete the other (``StageWriter`` cleans a stage's
leftovers as it opens), two commits would swap the artifact under a reader, and an LLM or a corpus
would be worked through once per rank.

So every rank calls the same two functions at the same points, and only rank 0 works:

* ``main_decides(value)``: rank 0's value (a cache decision) on every rank. A rank that decided for
  itself could see an artifact rank 0 committed a moment earlier and skip a step rank 0 then
  waits in: both ranks would wait forever in different collectives.
* ``on_main_rank(what, work, read)``: rank 0 runs ``work``; the others wait for it at the patient
  barrier (``wait_for_main``: no collective timeout, since re-mining a corpus or averaging two
  large models can outlast ``train.dist_timeout_s``) and then ``read`` what rank 0 committed.
  When ``work`` fails on rank 0 the others end with one line saying so instead of waiting.

Outside a multi-process job both are the identity: ``work`` runs, ``value`` is returned. Torch is
imported only inside a multi-process job.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from embed_core.dist.world import env_rank, launched

T = TypeVar("T")


def _join(timeout_s: float | None) -> Any:
    """The distributed helpers, with this process in the job's process group (the first step can
    come before the first training stage, which would otherwise create it)."""
    from embed_core.dist import distributed

    distributed.init_process_group(timeout_s=timeout_s)
    return distributed


def main_decides(value: T, *, timeout_s: float | None = None) -> T:
    """Rank 0's ``value`` on every rank, once rank 0 has reached this point (patiently: rank 0 may
    still be publishing the previous stage's artifacts)."""
    if not launched():
        return value
    distributed = _join(timeout_s)
    distributed.wait_for_main()
    return distributed.broadcast_from_main(value)


def on_main_rank(what: str, work: Callable[[], T], read: Callable[[], T], *, timeout_s: float | None = None) -> T:
    """``work()`` on rank 0; on the other ranks, once rank 0 is done, ``read()`` (what it committed).
    ``what`` names the step in the line a rank ends with when rank 0's work failed."""
    if not launched():
        return work()
    distributed = _join(timeout_s)
    if distributed.is_main_process():
        try:
            result = work()
        except Exception as exc:
            _release(distributed, f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
        _release(distributed, None)
        return result
    distributed.wait_for_main()
    failure = distributed.broadcast_from_main(None)
    if failure is not None:
        from embed_core.errors import EmbedpipeError

        raise EmbedpipeError(f"{what}: rank 0 failed ({failure}); rank {env_rank()} has nothing to read")
    return read()


def _release(distributed: Any, failure: str | None) -> None:
    """Rank 0: let the waiting ranks go, telling them whether there is a result to read."""
    distributed.wait_for_main()
    distributed.broadcast_from_main(failure)


def committed(run_dir: str | Path, instance: str, key: str) -> dict[str, Any]:
    """The manifest rank 0 committed for ``instance``, checked to be of the inputs this rank computed
    (``key``): a rank never goes on with an artifact of other inputs. (Its files are not hashed
    again here: rank 0 has just written them, and the stage that reads them checks them.)"""
    from embed_core.artifacts import read_manifest
    from embed_core.errors import EmbedpipeError

    manifest = read_manifest(Path(run_dir), instance)
    if manifest is None or manifest.get("input_fingerprint") != key:
        raise EmbedpipeError(f"{Path(run_dir) / instance}: rank 0 committed no artifact of this rank's inputs "
                             f"({key[:12]}); do all ranks read the same run directory and config?")
    return manifest

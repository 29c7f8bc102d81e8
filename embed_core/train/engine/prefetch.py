"""The micro-batches of a training stage, built off the step.

``BatchSource.get(i)`` returns micro-batch ``i`` (the stage's running micro-batch counter): drawn
from the sampler on the calling thread — so the sampler's state, which checkpoints save, is
exactly that of the draws made — and built (records → texts, ``build_batch``) and tokenized
(``Embedder.tokenize``) on one background thread, one micro-batch ahead: while micro-batch ``i``
trains, ``i + 1`` is being assembled. A checkpoint saves the sampler's state from *before* the
draw made ahead (``sampler_state``), and a resume discards it (``reset``), so a resumed run draws
and trains exactly what the uninterrupted one did. Building a batch touches no global RNG (its
choices come from a generator seeded by (seed, micro-batch)), and the tokenizer is used under a
lock (``Embedder.tokenize``), so the thread changes no result: ``train.prefetch: false`` builds the
same batches on the step itself.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from embed_core.losses.batch import TaskBatch
from embed_core.train.engine.pages import release_pages
from embed_core.train.engine.sampling import Batch, GroupedBatchSampler


class BatchSource:
    def __init__(self, sampler: GroupedBatchSampler, build: Callable[[Batch, int], TaskBatch], prefetch: bool):
        self.sampler = sampler
        self._build_batch = build
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="embedpipe-batches") if prefetch else None
        self._ahead: tuple[int, dict[str, Any], Future] | None = None  # (index, sampler state before, job)

    def get(self, index: int) -> TaskBatch:
        """Micro-batch ``index``; with prefetching, ``index + 1`` starts building before this returns."""
        if self._ahead is not None and self._ahead[0] == index:
            batch = self._ahead[2].result()
        else:
            self.reset()
            batch = self._build(self.sampler.next_batch(), index)
        self._ahead = None
        if self._pool is not None:
            state = self.sampler.state_dict()
            self._ahead = (index + 1, state, self._pool.submit(self._build, self.sampler.next_batch(), index + 1))
        return batch

    def sampler_state(self) -> dict[str, Any]:
        """The sampler's state after the draws consumed so far (not the one made ahead)."""
        return self._ahead[1] if self._ahead is not None else self.sampler.state_dict()

    def reset(self) -> None:
        """Forget the micro-batch built ahead, putting its draw back (before a resume's sampler
        state is loaded, or when a micro-batch other than the one ahead is asked for)."""
        if self._ahead is not None:
            _, state, job = self._ahead
            self._ahead = None
            job.cancel() or job.exception()  # wait for a running build: it must not outlive the reset
            self.sampler.load_state_dict(state)

    def _build(self, drawn: Batch, index: int) -> TaskBatch:
        try:
            return self._build_batch(drawn, index)
        finally:
            release_pages()  # the batch holds its texts now: the record pages it read can go

    def close(self) -> None:
        self.reset()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

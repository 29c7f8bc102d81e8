"""Progress of a long loop, for a terminal and for logs.

A terminal gets a tqdm bar (when stderr is a TTY); the ``embedpipe.*`` logger gets an INFO line at
most every ``every_s`` seconds (default 30) and one at the end, with the count, the rate and an
ETA, and the loop's own figures (``update(loss=…)``: the training loss, requests in flight and
failed). Prefect forwards the ``embedpipe`` loggers to the run logs, so a UI user sees a stage that
works for minutes move.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
LOG_EVERY_S = 30.0


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    def __init__(self, what: str, *, total: int | None = None, unit: str = "items", logger: logging.Logger,
                 every_s: float = LOG_EVERY_S):
        self.what, self.total, self.unit, self.log, self.every_s = what, total, unit, logger, every_s
        self.n = 0
        self.figures: dict[str, object] = {}
        self.start = self.last = time.monotonic()
        self.bar = tqdm(total=total, desc=what, unit=f" {unit}", leave=False, disable=None)

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        done = f"{self.n:,}/{self.total:,}" if self.total else f"{self.n:,}"
        eta = (f", ETA {_duration((self.total - self.n) / rate)}" if self.total and rate > 0 and self.n < self.total
               else "")
        figures = "".join(f", {k} {v}" for k, v in self.figures.items())
        return f"{self.what}: {done} {self.unit}{figures} ({rate:,.1f}/s, {_duration(elapsed)} elapsed{eta})"

    def update(self, n: int = 1, **figures: object) -> None:
        """Count ``n`` more; ``figures`` (e.g. ``loss="0.4312"``) show on the bar and in the log lines."""
        self.n += n
        if figures:
            self.figures.update(figures)
            self.bar.set_postfix({k: str(v) for k, v in self.figures.items()}, refresh=False)
        self.bar.update(n)
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.log.info(self.line())

    def close(self) -> None:
        self.bar.close()
        if time.monotonic() - self.start >= self.every_s:  # short loops stay quiet
            self.log.info(self.line())

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iterate(items: Iterable[T], what: str, *, logger: logging.Logger, total: int | None = None,
            unit: str = "items", every_s: float = LOG_EVERY_S) -> Iterator[T]:
    with Progress(what, total=total, unit=unit, logger=logger, every_s=every_s) as progress:
        for item in items:
            yield item
            progress.update()

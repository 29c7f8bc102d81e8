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
        self.logged_n: int | None = None  # the count of the last line logged (a line is never logged twice)
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
        return f"{self.what}: {done} {self.unit}{figures} ({self._rate(rate)}, {_duration(elapsed)} elapsed{eta})"

    def _rate(self, per_s: float) -> str:
        """Items per second, or seconds per item when that is slower than one a second (a 40-second
        training step reads "40.0 s/step", not "0.0/s")."""
        if 0 < per_s < 1:
            return f"{1 / per_s:,.1f} s/{self.unit.removesuffix('s') or self.unit}"
        return f"{per_s:,.1f}/s"

    def _log(self) -> None:
        if self.logged_n != self.n:
            self.logged_n = self.n
            self.log.info(self.line())

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
            self._log()

    def close(self) -> None:
        self.bar.close()
        if time.monotonic() - self.start >= self.every_s:  # short loops stay quiet
            self._log()

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

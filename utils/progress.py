"""Progress of a long phase (building data, training a vocabulary, tokenizing, decoding, sweeps).

On a terminal a tqdm bar with the rate and the time left; otherwise (a log file,
a batch job) a plain log line at the start, every `log_every` seconds and at the
end, so that a job's log says how far it got without filling it with redraws.

    with progress.phase("tokenizing train", total=len(records), unit="pairs") as bar:
        for chunk in chunks:
            ...
            bar.advance(len(chunk))

    for item in progress.track(items, "decoding dev", total=len(items)):
        ...
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

from utils import stop_signals

Item = TypeVar("Item")


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Phase:
    """Counts the units done of one phase and shows them (see the module docstring)."""

    def __init__(self, what: str, total: int | None, unit: str, *, interactive: bool, log_every: float, enabled: bool):
        self.what, self.total, self.unit = what, total, unit
        self.done = 0
        self.enabled = enabled
        self.log_every = log_every
        self.start = self.last_logged = time.monotonic()
        self.bar = (
            tqdm(total=total, desc=what, unit=f" {unit}", unit_scale=True, dynamic_ncols=True, leave=False)
            if enabled and interactive
            else None
        )
        if enabled and self.bar is None:
            logging.info("%s: started%s", what, f" ({total:,} {unit})" if total is not None else "")

    def advance(self, count: int = 1) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(count)
        elif self.enabled and time.monotonic() - self.last_logged >= self.log_every:
            self.last_logged = time.monotonic()
            logging.info("%s", self.line())

    def line(self) -> str:
        """`what: done/total unit (percent), rate unit/s, time left` (the parts that are known)."""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        text = f"{self.what}: {self.done:,}"
        if self.total:
            text += f"/{self.total:,} {self.unit} ({100 * self.done / self.total:.0f}%)"
        else:
            text += f" {self.unit}"
        text += f", {rate:,.1f} {self.unit}/s"
        if self.total and rate > 0:
            text += f", {_clock((self.total - self.done) / rate)} left"
        return text

    def close(self, ended: str = "done") -> None:
        """Ends the phase: `ended` is "done", or "stopped" where an error or a stop signal cut it short."""
        if self.bar is not None:
            self.bar.close()
        if self.enabled:
            logging.info(
                "%s: %s, %s %s in %s",
                self.what,
                ended,
                f"{self.done:,}",
                self.unit,
                _clock(time.monotonic() - self.start),
            )


@contextlib.contextmanager
def phase(
    what: str, *, total: int | None = None, unit: str = "items", log_every: float = 30.0, enabled: bool = True
) -> Iterator[Phase]:
    """A `Phase` closed at the end of the block (`enabled=False`: counts silently, e.g. on a
    process other than the first)."""
    with stop_signals.phase(what):
        shown = Phase(what, total, unit, interactive=sys.stderr.isatty(), log_every=log_every, enabled=enabled)
        try:
            yield shown
        except BaseException:
            shown.close("stopped")
            raise
        shown.close()


def track(
    items: Iterable[Item], what: str, *, total: int | None = None, unit: str = "items", enabled: bool = True
) -> Iterator[Item]:
    """Yields `items`, advancing a phase by one per item (`total` defaults to `len(items)` when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with phase(what, total=total, unit=unit, enabled=enabled) as shown:
        for item in items:
            yield item
            shown.advance()

"""The one way a long-running command stops on request: SIGTERM or SIGINT set a flag.

The trainer checks the flag after each step (it saves, then stops); a sweep
worker stops its trial (which saves) and leaves; the sweep launcher passes the
signal on to its workers (`on_signal`).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While active (`with StopSignals() as stop:`), SIGTERM/SIGINT set `stop.requested` and call
    `on_signal(signum)` instead of ending the process (or only `signals`, when given). The previous
    handlers come back on exit.
    Outside the main thread, where Python cannot install handlers, it installs none."""

    def __init__(
        self, on_signal: Callable[[int], None] | None = None, *, message: str = "", signals: tuple[int, ...] = SIGNALS
    ):
        self.requested = False
        self._signals = signals
        self._on_signal = on_signal
        self._message = message
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for signum in self._signals:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:
                # not the main thread
                pass
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self._message:
            logging.warning("received %s: %s", signal.Signals(signum).name, self._message)
        self.requested = True
        if self._on_signal is not None:
            self._on_signal(signum)

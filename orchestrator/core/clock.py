"""The clock the supervisor's timers read: the lock's lease, the hang clock, the mirrors' outage
and backoff, the waits between attempts.

One object, passed in, instead of ``time.monotonic()``/``time.time()``/``Event.wait`` read
directly: a test gives a clock it moves by hand, and a 5 s lease or a 60 s backoff is then
proven in microseconds, without a process or a real wait. The default is the system's.
"""
from __future__ import annotations

import threading
import time


class Clock:
    """The system's time: monotonic for durations, wall for what is journaled."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float | None) -> bool:
        """Wait up to ``seconds`` for ``event`` (a stop, a wake-up); True when it is set. The
        waits that a stop must cut short go through here, not through ``sleep``."""
        return event.wait(seconds)


SYSTEM = Clock()

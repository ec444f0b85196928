"""The run directory's lock while the run directory comes and goes: core/lock.py's takeover rule.

Kept from the mirrors' threads, before each pass that would write to the run directory (a
Drive that just came back must not receive our held-back events before we know the run is
still ours). Refresh when due; when the refresh fails, the outage is reported and, past the
lease, the worker is paused (SIGSTOP to its process groups, the hang clock paused, no new
attempt started); when it succeeds again, the worker goes on; when another supervisor's token
is in the lock, ``on_lost`` is told and nothing more is written.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Callable

from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.lock import Lease, LockLost, RunLock
from orchestrator.core.outage import Outage
from orchestrator.supervise.hangs import HangClock

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, lock: RunLock, lease: Lease, outage: Outage, journal: Journal,
                 hang: HangClock, signal_worker: Callable[[int], int | None],
                 on_lost: Callable[[LockLost], None], clock: Clock = SYSTEM):
        self.lock, self.lease, self.outage, self.journal = lock, lease, outage, journal
        self.clock = clock
        self.hang, self.signal_worker = hang, signal_worker
        self._on_lost = [on_lost]
        self.held = threading.Event()  # clear while the worker is paused
        self.held.set()
        self.paused_at: float | None = None
        self.lost: LockLost | None = None
        self._guard = threading.Lock()

    def when_lost(self, tell: Callable[[LockLost], None]) -> None:
        """Tell ``tell`` too when the lock is lost (once, from the thread that found it):
        for a part built after the lease that must stop writing at once (the durable mirror)."""
        self._on_lost.append(tell)

    def hold(self) -> bool:
        """True when the run directory may be written now (the lock is ours, confirmed)."""
        with self._guard:
            if self.lost is not None:
                return False
            if not self.lease.due() and not self.outage.down and self.paused_at is None:
                return True
            try:
                exc = self.lock.refresh()
            except LockLost as lost:
                self.lost = lost
                self.journal.append(Event.LOCK_LOST, owner=lost.current)
                for tell in self._on_lost:
                    tell(lost)
                return False
            if exc is None:
                self.lease.renewed()
                if self.paused_at is not None:
                    self._resume()
                return True
            self.outage.failed(exc, during="refreshing the lock")
            if self.lease.expired() and self.paused_at is None:
                self._pause()
            return False

    def wait_held(self, stopped: threading.Event) -> bool:
        """Block while the worker is paused by the lease; False when ``stopped`` is set."""
        while not self.clock.wait(self.held, 0.5):
            if stopped.is_set():
                return False
        return True

    def _pause(self) -> None:
        self.paused_at = self.clock.time()
        self.held.clear()
        self.hang.pause()
        pgid = self.signal_worker(signal.SIGSTOP)
        self.journal.append(Event.WORKER_PAUSED, pid=pgid, lease_s=self.lease.lease_s,
                            stale_after_s=self.lease.stale_after)
        log.info(f"the lock could not be refreshed for {self.lease.lease_s:.0f} s: the worker is "
                 f"paused, so that no other machine can take the run over while it trains")

    def _resume(self) -> None:
        paused = self.clock.time() - self.paused_at
        self.paused_at = None
        pgid = self.signal_worker(signal.SIGCONT)
        self.hang.resume()
        self.held.set()
        self.journal.append(Event.WORKER_RESUMED, pid=pgid, paused_s=round(paused, 3))
        log.info(f"the lock is ours again: the worker goes on after {paused:.0f} s paused")

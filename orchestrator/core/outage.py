"""Whether the run directory answers: one object for every part of the supervisor that writes it.

The run directory is often a Google Drive mount that drops for seconds or minutes. Five parts
meet that one fact: the control mirror (journal, heartbeat, logs), the durable mirror (the
checkpoints folder), the lock's lease, the start (lock and journal must be reachable) and the
end (the export is written there). They share this object, so an outage has one beginning and
one end in each part's terms, each journaled once (from any thread), timed by one clock:

- ``RUN_DIR``: the run directory itself (``run_dir_unreachable``/``run_dir_restored``: what
  was held back on the local disk meanwhile);
- ``CHECKPOINTS``: its checkpoints folder, the durable tier (``durable_unreachable``/
  ``durable_restored``: the backlog left), which may fail alone (a folder replaced, a copy
  that does not read back) and whose outage the durable mirror's backoff and remount follow.

The event pair of each part is named once (``events.OUTAGE_EVENTS``), which is also how
``ops/status.py`` reads them back.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.core.events import CHECKPOINTS, OUTAGE_EVENTS, RUN_DIR
from orchestrator.core.journal import Journal
from orchestrator.core.rundir import RunDirUnreachable

log = logging.getLogger(__name__)

__all__ = ["CHECKPOINTS", "RUN_DIR", "START_RETRY_S", "Outage"]

# A run directory that does not answer at start is retried this long (a Drive mount that is
# remounting takes seconds), then the start fails with a clear message.
START_RETRY_S = 30.0


class Outage:
    def __init__(self, journal: Journal, root: str, clock: Clock = SYSTEM):
        self.journal, self.root, self.clock = journal, root, clock
        self.failures = 0  # the run directory's failed calls, this session
        self._since: dict[str, float] = {}  # part -> when it stopped answering
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- state
    @property
    def since(self) -> float | None:
        return self._since.get(RUN_DIR)

    @property
    def down(self) -> bool:
        """The run directory does not answer (its checkpoints folder may, apart)."""
        return self.is_down(RUN_DIR)

    def is_down(self, part: str) -> bool:
        return part in self._since

    # ---------------------------------------------------------------- any part
    def went_down(self, part: str, says: str, **fields) -> bool:
        """A call to ``part`` failed: the first failure since it last answered is journaled
        (with ``fields``) and ``says`` is said; True then."""
        with self._lock:
            if part in self._since:
                return False
            self._since[part] = self.clock.time()
        self.journal.append(OUTAGE_EVENTS[part][0], **fields)
        log.info(says)
        return True

    def came_back(self, part: str, says: Callable[[float], str],
                  fields: Callable[[float, float], dict]) -> bool:
        """A call to ``part`` succeeded: when that ends an outage, it is journaled with
        ``fields(since, seconds down)`` and ``says(seconds down)`` is said; True then."""
        with self._lock:
            since = self._since.pop(part, None)
        if since is None:
            return False
        length = self.clock.time() - since
        self.journal.append(OUTAGE_EVENTS[part][1], **fields(since, length))
        log.info(says(length))
        return True

    # ---------------------------------------------------------------- the run directory
    def failed(self, exc: OSError, during: str) -> None:
        """The run directory failed ``during`` (mirroring the control state, refreshing the
        lock): training goes on, its files wait on the local disk."""
        with self._lock:
            self.failures += 1
        self.went_down(RUN_DIR, f"the run directory {self.root} cannot be written ({exc}); "
                                f"training goes on, its files are kept on the local disk until "
                                f"it is back", error=str(exc), errno=exc.errno, during=during)

    def ok(self, held_back: dict | None = None) -> bool:
        """The run directory answers; True when that ends an outage (journaled, with what
        was ``held_back`` on the local disk when it came back)."""
        return self.came_back(
            RUN_DIR, lambda s: f"the run directory is back after {s:.0f} s",
            lambda since, s: dict(outage_s=round(s, 3), down_since=round(since, 3),
                                  held_back=held_back or {}))

    def retry_start(self, step):
        """A start step that touches the run directory (the lock, the journal), retried while
        it does not answer; past ``START_RETRY_S``, ``RunDirUnreachable`` says what to do.
        Nothing is journaled: the journal is what does not answer."""
        retrying = Retrying(retry=retry_if_exception_type(OSError), reraise=True,
                            stop=stop_after_delay(START_RETRY_S),
                            wait=wait_exponential(multiplier=0.5, max=5.0))
        try:
            return retrying(step)
        except OSError as exc:
            raise RunDirUnreachable(
                f"{self.root}: the run directory cannot be written ({exc}), retried for "
                f"{START_RETRY_S:.0f} s; the supervisor needs it to start (its lock and journal "
                f"are there). Check the mount (on Colab: drive.mount(..., force_remount=True)) "
                f"and run again: nothing was lost.") from exc

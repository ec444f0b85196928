"""The worker slot: the attempt in flight, the one queue its loop waits on, and the run's stop.

Why one object: several parts must reach the worker while the loop waits on it, from other
threads. The lock's lease pauses it (SIGSTOP, the hang clock paused) from a mirror's thread; a
signal or a lost lock stops the run; the accelerator probe and the remedies must know its
process group (never to signal our own worker as a stranger); the waits between attempts must
end at a stop. Each of them is handed this slot, built first, instead of a callback into the
supervisor. The watchers (checkpoint commits, heartbeats) feed the same queue (messages.py).
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading

from watchdog.events import (DirCreatedEvent, DirMovedEvent, FileCreatedEvent, FileMovedEvent,
                             FileSystemEventHandler)
from watchdog.observers import Observer

from orchestrator.checkpoint.store import COMMIT_MARKER
from orchestrator.checkpoint.tiers import TieredStore
from orchestrator.core.clock import Clock
from orchestrator.core.rundir import RunDir
from orchestrator.core.spec import JobSpec
from orchestrator.supervise.attempt import Stopped
from orchestrator.supervise.hangs import HangClock, HeartbeatEvents
from orchestrator.supervise.messages import Committed, Stop

log = logging.getLogger(__name__)

# What the watchers act on: a file or folder created or renamed into place (a commit, a
# heartbeat). Unfiltered, inotify reports each write, open and close under the watched folders
# (the blobs a checkpoint writes and the mirror reads back, the logs), which watchdog's threads
# parse in this process, beside the loop, on the path from a worker's death to the next start.
PLACED = [FileCreatedEvent, DirCreatedEvent, FileMovedEvent, DirMovedEvent]


class WorkerSlot:
    def __init__(self, spec: JobSpec, rd: RunDir, clock: Clock):
        self.events: queue.Queue = queue.Queue()
        self.hang = HangClock(rd.control, spec.hang_timeout, spec.startup_timeout, clock)
        self.attempt = None             # the attempt in flight (supervise/attempt.py), if any
        self.stopped = threading.Event()
        self.stop_signal: int | None = None  # what stopped us: SIGINT is a cell interrupt
        self.clock = clock

    # ------------------------------------------------------------------ the stop
    def stop(self, signum: int | None = None) -> None:
        """Stop the run, from any thread (a signal handler, the lease's thread): the loop's
        wait and any wait between attempts end with ``Stopped``."""
        if signum is not None:
            self.stop_signal = signum
        self.stopped.set()
        self.events.put(Stop())

    def sleep(self, seconds: float) -> None:
        """Wait between attempts (a backoff, an accelerator's wait); a stop cuts it short."""
        if self.clock.wait(self.stopped, seconds):
            raise Stopped()

    def install_signal_handlers(self):
        """SIGTERM and SIGINT stop the run (main thread only); returns what to restore."""
        if threading.current_thread() is not threading.main_thread():
            return None
        return {s: signal.signal(s, lambda signum, frame: self.stop(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}

    @staticmethod
    def restore_signal_handlers(old) -> None:
        for s, h in (old or {}).items():
            signal.signal(s, h)

    # ------------------------------------------------------------------ the worker in it
    def pgid(self) -> int | None:
        """The process group of the attempt's worker (its pid), if one runs."""
        a = self.attempt
        return a.proc.pid if a is not None and a.proc is not None else None

    def signal(self, sig: int) -> int | None:
        """Send ``sig`` to the worker's process group(s) (the lease's SIGSTOP and SIGCONT);
        returns the group it went to, for the journal."""
        a = self.attempt
        if a is not None:
            a.signal(sig)
        return self.pgid()

    def end(self, grace: float | None = None) -> None:
        """Stop the attempt in flight (its whole process group) and empty the slot."""
        a, self.attempt = self.attempt, None
        if a is not None:
            a.stop(grace=grace)


class _CheckpointEvents(FileSystemEventHandler):
    """Commits only: a checkpoint directory renamed into place, or its commit marker written."""

    def __init__(self, q: queue.Queue):
        self.q = q

    def on_moved(self, event):
        self._maybe(event.dest_path)

    def on_created(self, event):
        self._maybe(event.src_path)

    def _maybe(self, path) -> None:
        name = os.path.basename(os.fsdecode(path))
        if name == COMMIT_MARKER or (len(name) == 10 and name.isdigit()):
            self.q.put(Committed(path))


def watch(observer: Observer, slot: WorkerSlot, store: TieredStore, rd: RunDir) -> None:
    """Feed the slot's queue: checkpoints committed (either tier's folder here), heartbeats."""
    os.makedirs(store.local.root, exist_ok=True)
    observer.schedule(_CheckpointEvents(slot.events), store.local.root, recursive=True,
                      event_filter=PLACED)
    try:  # made now, so that it is watched: the durable copies of a chief on another node
        os.makedirs(rd.checkpoints, exist_ok=True)
    except OSError as exc:  # the run directory away: the commits' beats still tell them
        log.warning(f"cannot watch {rd.checkpoints} ({exc.strerror or exc}): its commits are "
                    f"heard from the workers' heartbeats and the scans")
    else:
        observer.schedule(_CheckpointEvents(slot.events), rd.checkpoints, event_filter=PLACED)
    observer.schedule(HeartbeatEvents(slot.events, rd.control), rd.control, recursive=True,
                      event_filter=PLACED)
    observer.start()

"""Hang detection for the supervisor: heartbeats heard as file events, and a deadline.

A worker that is alive but stuck (the multiprocessing data-loader deadlock that freezes
``fit`` at epoch 1, a wedged collective) never exits; only its silence tells. Every replacement
of ``heartbeat.json`` arrives as a watchdog event, so the supervisor waits on its queue with a
timeout equal to the time left, never polling. Before the first training beat of an attempt the
longer ``startup_timeout`` applies (imports, TPU initialisation, XLA compilation).
"""
from __future__ import annotations

import os
import queue

from watchdog.events import FileSystemEventHandler

from orchestrator.core import heartbeat
from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.supervise.messages import Beat

# Heartbeat phases written once a training step is done (core/heartbeat.Phase).
STEPPED = heartbeat.Phase.STEPPED
# Those of start-up, when the longer timeout applies: until the first step is done, its trace
# and XLA compilation included (minutes on a TPU; a JAX group's first step took over 20 s on
# 2 loaded cores, and a hang_timeout of 20 s stopped it as hung three times in one run).
STARTUP = (heartbeat.Phase.STARTING, heartbeat.Phase.TRAIN_BEGIN)


class HeartbeatEvents(FileSystemEventHandler):
    """Puts ``Beat()`` on the supervisor's queue whenever heartbeat.json is replaced."""

    def __init__(self, q: queue.Queue):
        self.q = q

    def _check(self, path) -> None:
        if os.path.basename(os.fsdecode(path)) == heartbeat.FILE:
            self.q.put(Beat())

    def on_moved(self, event):
        self._check(event.dest_path)

    def on_created(self, event):
        self._check(event.src_path)

    def on_modified(self, event):
        self._check(event.src_path)


class HangClock:
    """When the attempt in flight counts as hung."""

    def __init__(self, run_dir: str, hang_timeout: float, startup_timeout: float,
                 clock: Clock = SYSTEM):
        self.run_dir, self.clock = run_dir, clock
        self.hang_timeout, self.startup_timeout = hang_timeout, startup_timeout
        self.attempt = None
        self.last = clock.monotonic()
        self.last_wall = clock.time()
        self.training = False  # past start-up: the hang timeout applies
        self.stepped = False   # a training step is done (a standby may start)
        self.paused = False  # the worker is stopped on purpose (core/lock.py's lease)

    def start(self, attempt: int) -> None:
        self.attempt, self.training, self.stepped = attempt, False, False
        self.last, self.last_wall = self.clock.monotonic(), self.clock.time()

    def beat(self) -> None:
        """A heartbeat file event: count it if it is the current attempt's."""
        rec = heartbeat.read(self.run_dir)
        if not rec or rec.get("attempt") != self.attempt:
            return
        self.last = self.clock.monotonic()
        self.last_wall = float(rec.get("time", self.clock.time()))
        if rec.get("phase") not in STARTUP:
            self.training = True
        if rec.get("phase") in STEPPED:
            self.stepped = True

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        """A paused worker goes on: its silence while stopped was ours, not a hang."""
        self.paused = False
        self.last, self.last_wall = self.clock.monotonic(), self.clock.time()

    @property
    def timeout(self) -> float:
        return self.hang_timeout if self.training else self.startup_timeout

    def remaining(self) -> float:
        if self.paused:
            return float("inf")
        return self.timeout - (self.clock.monotonic() - self.last)

    def age(self) -> float:
        """Seconds since the last beat, by the beat's own timestamp."""
        return self.clock.time() - self.last_wall


def dump_stacks(pid: int, log_path: str, wait: float = 2.0, clock: Clock = SYSTEM) -> bool:
    """Ask the worker for a stack dump into its log; True once the log grew (or the wait ends)."""
    try:
        size = os.path.getsize(log_path)
    except OSError:
        size = 0
    try:
        os.kill(pid, heartbeat.STACK_DUMP_SIGNAL)
    except ProcessLookupError:
        return False
    deadline = clock.monotonic() + wait
    grew_at = None
    while clock.monotonic() < deadline:  # a short bounded wait for a write we just caused
        try:
            now = os.path.getsize(log_path)
        except OSError:
            now = size
        if now > size:
            if grew_at is not None and now == grew_at:
                return True  # grown and settled
            grew_at = now
        clock.sleep(0.05)
    return grew_at is not None

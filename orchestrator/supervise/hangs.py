"""Hang detection for the supervisor: heartbeats heard (file events here, or relayed through
Ray from a rank's node), and a deadline per rank.

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
from orchestrator.core.rundir import rank_dir, rank_of
from orchestrator.supervise.messages import Beat

# Heartbeat phases written once a training step is done (core/heartbeat.Phase).
STEPPED = heartbeat.Phase.STEPPED
# Those of start-up, when the longer timeout applies: until the first step is done, its trace
# and XLA compilation included (minutes on a TPU; a JAX group's first step took over 20 s on
# 2 loaded cores, and a hang_timeout of 20 s stopped it as hung three times in one run).
STARTUP = (heartbeat.Phase.STARTING, heartbeat.Phase.TRAIN_BEGIN)


class HeartbeatEvents(FileSystemEventHandler):
    """Puts ``Beat(rank)`` on the supervisor's queue whenever a rank's heartbeat.json in the
    control folder is replaced (rank 0's in the folder, rank k's in ``rank-k/``: rundir.py)."""

    def __init__(self, q: queue.Queue, control: str):
        self.q, self.control = q, control

    def _check(self, path) -> None:
        path = os.fsdecode(path)
        if os.path.basename(path) == heartbeat.FILE:
            rank = rank_of(self.control, os.path.dirname(path))
            if rank is not None:
                self.q.put(Beat(rank))

    def on_moved(self, event):
        self._check(event.dest_path)

    def on_created(self, event):
        self._check(event.src_path)


class _Rank:
    """One rank's side of the clock: when it last beat, and whether it is past start-up."""

    def __init__(self, now: float, wall: float):
        self.last, self.last_wall = now, wall
        self.training = False

    def timeout(self, clock: "HangClock") -> float:
        return clock.hang_timeout if self.training else clock.startup_timeout


class HangClock:
    """When the attempt in flight counts as hung: when its slowest rank has been silent past its
    timeout. One worker is rank 0 alone. In a group every rank's beat counts, wherever it runs
    (a file here, or relayed through Ray from its node: rayengine.py): a rank stuck in a
    collective holds the others, and the one that went silent first is the one named."""

    def __init__(self, run_dir: str, hang_timeout: float, startup_timeout: float,
                 clock: Clock = SYSTEM):
        self.run_dir, self.clock = run_dir, clock
        self.hang_timeout, self.startup_timeout = hang_timeout, startup_timeout
        self.attempt = None
        self.ranks = {0: _Rank(clock.monotonic(), clock.time())}
        self.stepped = False   # a training step is done (a standby may start)
        self.paused = False  # the worker is stopped on purpose (core/lock.py's lease)

    def start(self, attempt: int, ranks: int = 1) -> None:
        self.attempt, self.stepped = attempt, False
        now, wall = self.clock.monotonic(), self.clock.time()
        self.ranks = {r: _Rank(now, wall) for r in range(ranks)}

    def beat(self, rank: int = 0, record: dict | None = None) -> None:
        """A heartbeat of ``rank``: relayed (``record``) or a file event (read here). Counted if
        it is the current attempt's."""
        rec = record if record is not None else heartbeat.read(rank_dir(self.run_dir, rank))
        r = self.ranks.get(rank)
        if r is None or not rec or rec.get("attempt") != self.attempt:
            return
        r.last = self.clock.monotonic()
        r.last_wall = float(rec.get("time", self.clock.time()))
        if rec.get("phase") not in STARTUP:
            r.training = True
        if rec.get("phase") in STEPPED:
            self.stepped = True

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        """A paused worker goes on: its silence while stopped was ours, not a hang."""
        self.paused = False
        now, wall = self.clock.monotonic(), self.clock.time()
        for r in self.ranks.values():
            r.last, r.last_wall = now, wall

    @property
    def training(self) -> bool:
        """Past start-up: every rank has beaten from training."""
        return all(r.training for r in self.ranks.values())

    def _left(self, r: _Rank) -> float:
        return r.timeout(self) - (self.clock.monotonic() - r.last)

    def silent(self) -> int:
        """The rank closest to its timeout (past it, when the attempt is hung)."""
        return min(self.ranks, key=lambda k: self._left(self.ranks[k]))

    @property
    def timeout(self) -> float:
        return self.ranks[self.silent()].timeout(self)

    def remaining(self) -> float:
        if self.paused:
            return float("inf")
        return self._left(self.ranks[self.silent()])

    def age(self) -> float:
        """Seconds since the silent rank's last beat, by the beat's own timestamp."""
        return self.clock.time() - self.ranks[self.silent()].last_wall

    def ages(self) -> dict[int, float]:
        """Every rank's seconds since its last beat (journaled with a hang)."""
        now = self.clock.time()
        return {k: round(now - r.last_wall, 3) for k, r in sorted(self.ranks.items())}


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

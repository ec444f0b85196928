"""Heartbeat: the worker says it is alive and where it is; the supervisor reads it.

The worker replaces ``heartbeat.json`` in the run directory at most once per interval (atomic
rename, not fsynced: it is liveness, not history). Its modification time is the beat. The
supervisor hears each beat as a file event (hangs.py), or relayed through Ray from the rank's
node (supervise/relay.py); a worker that stops beating is asked for a stack dump of every
thread (``STACK_DUMP_SIGNAL``, faulthandler) into its attempt log.

A commit rides the same channel: the rank that commits a checkpoint beats at once with it in
``commits`` (its last few, so that a beat coalesced away on the way loses none), and the
supervisor journals it when its own copy verifies (supervise/ledger.py). A watched folder
could not tell it: the chief's local tier may be on another node, and a shared folder may
deliver no event for a write made elsewhere.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time

from orchestrator.core.osutil import read_json, write_json_atomic

FILE = "heartbeat.json"
STACK_DUMP_SIGNAL = signal.SIGUSR1
# How many of its latest commits each beat carries (a beat replaced before it was read, by a
# relay that reads every POLL_S, takes nothing with it that the next does not carry again).
COMMITS_KEPT = 4


class Phase:
    """What the worker is doing, in each beat's ``phase``: written by the worker
    (train/worker.py, train/callbacks.py), read by the supervisor's hang clock
    (supervise/hangs.py) to pick the start-up or the hang timeout and to know when a standby
    may start, and shown by ``orchestrator status``. Plain strings in ``heartbeat.json``."""

    STARTING = "starting"        # imports, build, restore: the start-up timeout applies
    TRAIN_BEGIN = "train_begin"  # the first step, traced and compiled: still start-up
    TRAINING = "training"
    VALIDATION = "validation"
    EPOCH_END = "epoch_end"
    EXPORTING = "exporting"      # the run's model written for inference, after the last epoch

    #: a training step is done: a warm standby may start beside the worker
    STEPPED = (TRAINING, VALIDATION, EPOCH_END)


def register_stack_dump(stream=None) -> None:
    """Worker side: dump every thread's stack to ``stream`` (the attempt log) on the signal."""
    faulthandler.register(STACK_DUMP_SIGNAL, file=stream or sys.stderr, all_threads=True)


class Position:
    """Where the attempt is, for the heartbeat and the error record (the console's progress
    display is ``supervise.console.Progress``)."""

    def __init__(self, epoch: int = 0):
        self.epoch = epoch  # epochs completed
        self.batch = 0      # batches done in the current epoch
        self.step = 0       # training batches run in the whole run (the checkpoint key)

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "step": self.step}


def resident_bytes() -> int | None:
    """This process's resident size: the supervisor compares a SIGKILLed worker's last one
    with its memory limit (recovery/oom.py)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HeartbeatWriter:
    def __init__(self, run_dir: str, attempt: int, interval: float = 1.0):
        self.path = os.path.join(run_dir, FILE)
        self.attempt, self.interval = attempt, interval
        self._last = 0.0
        self.failures, self.last_error = 0, None  # beats that could not be written
        self._where: dict = {}   # the last beat's position and phase, for a commit's beat
        self.commits: list[dict] = []  # the latest commits, newest last (COMMITS_KEPT)
        self._lock = threading.Lock()  # the training thread and the checkpoint writer's

    def beat(self, force: bool = False, **where) -> bool:
        with self._lock:
            now = time.time()
            if not force and now - self._last < self.interval:
                return False
            self._last = now
            self._where = where
            record = {"time": round(now, 3), "pid": os.getpid(), "attempt": self.attempt,
                      "rss": resident_bytes(), **where}
            if self.commits:
                record["commits"] = list(self.commits)
            try:
                write_json_atomic(self.path, record, durable=False)
            except OSError as exc:  # the run dir on Drive may be gone a while: keep training
                self.failures += 1
                self.last_error = exc
                return False
            return True

    def committed(self, step: int, epoch: int, path: str, digest: str | None) -> bool:
        """A checkpoint was committed (the checkpoint writer's thread): beat now, where the
        last beat was, with it (``commits``). ``digest``: the store's name for the commit
        (CheckpointStore.digest), which the supervisor's copy must match."""
        with self._lock:
            self.commits = (self.commits + [{"step": int(step), "epoch": int(epoch),
                                             "path": path, "digest": digest}])[-COMMITS_KEPT:]
            where = dict(self._where)
        return self.beat(force=True, **where)

    @contextlib.contextmanager
    def beating(self, **where):
        """Beat every interval from a thread while a long step with no callbacks runs (the
        export at the end of a run), so that it is not taken for a hang."""
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                self.beat(force=True, **where)
                stop.wait(self.interval)

        t = threading.Thread(target=loop, name="heartbeat", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()


def read(run_dir: str) -> dict | None:
    return read_json(os.path.join(run_dir, FILE))

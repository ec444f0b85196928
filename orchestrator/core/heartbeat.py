"""Heartbeat: the worker says it is alive and where it is; the supervisor reads it.

The worker replaces ``heartbeat.json`` in the run directory at most once per interval (atomic
rename, not fsynced: it is liveness, not history). Its modification time is the beat. The
supervisor hears each beat as a file event (hangs.py); a worker that stops beating is asked for a
stack dump of every thread (``STACK_DUMP_SIGNAL``, faulthandler) into its attempt log.
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

    def beat(self, force: bool = False, **where) -> bool:
        now = time.time()
        if not force and now - self._last < self.interval:
            return False
        self._last = now
        try:
            write_json_atomic(self.path, {"time": round(now, 3), "pid": os.getpid(),
                                          "attempt": self.attempt, "rss": resident_bytes(),
                                          **where}, durable=False)
        except OSError as exc:  # the run dir on Drive may be gone a while: keep training
            self.failures += 1
            self.last_error = exc
            return False
        return True

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

"""Checkpoint writes off the training thread: one background thread, at most one write in flight.

The training thread takes a host copy of the state (train/state.py) in a few milliseconds and
hands the rest (hashes, fingerprints, blobs, fsync, rename, commit marker, retention: the
store's atomic commit) to ``CheckpointWriter``. The store's protocol is unchanged, so a kill at any
moment still leaves the previous checkpoint intact: the write in flight never got its marker.

When a checkpoint falls due while the previous one is still being written (writes slower than
the checkpoint interval), the writer decides, by why the checkpoint is taken:

* ``periodic`` (``every_steps`` / ``every_seconds`` within an epoch): **skipped**, unless the
  previous periodic one was skipped too. Waiting would stall training for the rest of a write,
  which is what the background thread is there to avoid; skipping one costs at most one more
  interval of work on a kill. Never two in a row, so a kill never costs more than two intervals.
* ``epoch_end``, ``preemption``, ``final``: **waited for**. An epoch-end checkpoint may be the
  only one in an epoch (``every_epochs`` alone), a preemption has a deadline and must save the
  step it stops at, and the final one is the run's result.

Each decision is journaled (``checkpoint_skipped_busy``, ``checkpoint_waited`` with the wait in
ms), and each finished write as ``checkpoint_written`` with the training thread's stall. A write
that fails (ENOSPC, EIO, a lost mount) is never dropped: ``check()`` raises it on the training
thread at the next step boundary and ``drain()`` at the end, so the worker's error record
classifies it as ``storage`` like a failure of a write made in line. No TensorFlow here.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Callable

from orchestrator.core.events import Event

log = logging.getLogger(__name__)

PERIODIC, EPOCH_END, PREEMPTION, FINAL = "periodic", "epoch_end", "preemption", "final"
REASONS = (PERIODIC, EPOCH_END, PREEMPTION, FINAL)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 2)


class CheckpointWriter:
    """Runs checkpoint writes one at a time, in a background thread or (``background=False``,
    the switch ``checkpoint.background: false``) in line on the caller's thread.

    ``journal(event, **fields)`` records decisions and finished writes; in background mode a
    finished write is journaled by the writer thread, so the training thread never waits for
    the journal's fsync.
    """

    def __init__(self, background: bool = True,
                 journal: Callable[..., object] | None = None):
        self.background = background
        self.journal = journal or (lambda event, **fields: None)
        self._pool = (concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="checkpoint-writer") if background else None)
        self._pending: concurrent.futures.Future | None = None
        self._pending_step: int | None = None
        self._skipped_last = False
        self.stalls_ms: list[float] = []  # per checkpoint written: the training thread's stall

    # ---------------------------------------------------------------- training thread
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def check(self) -> None:
        """Raise, on the caller's thread, the error of a background write that has failed."""
        f = self._pending
        if f is not None and f.done():
            self._pending = None
            exc = f.exception()
            if exc is not None:
                raise exc

    def admit(self, step: int, reason: str) -> float | None:
        """May the checkpoint of ``step`` be taken now? None: skip it (journaled). Otherwise the
        ms the caller waited for the write in flight (0.0 when the writer was free)."""
        if reason not in REASONS:
            raise ValueError(f"checkpoint reason {reason!r}: expected one of {REASONS}")
        self.check()
        if not self.busy():
            self._skipped_last = False  # taken: the next periodic one may be skipped again
            return 0.0
        busy_with = self._pending_step
        if reason == PERIODIC and not self._skipped_last:
            self._skipped_last = True
            self.journal(Event.CHECKPOINT_SKIPPED_BUSY, step=step, reason=reason,
                         writing_step=busy_with,
                         why="the previous checkpoint is still being written; the next "
                             "periodic one will wait rather than skip")
            return None
        t0 = time.perf_counter()
        concurrent.futures.wait([self._pending])
        waited = _ms(time.perf_counter() - t0)
        self._skipped_last = False
        self.journal(Event.CHECKPOINT_WAITED, step=step, reason=reason, writing_step=busy_with,
                     wait_ms=waited,
                     why=("the previous periodic checkpoint was skipped" if reason == PERIODIC
                          else f"a {reason.replace('_', '-')} checkpoint is never skipped"))
        self.check()
        return waited

    def prepare(self, work: Callable[[], object]) -> None:
        """Run ``work`` (a warm-up: tracing the snapshot reader) in the writer's thread, ahead of
        the first checkpoint; in line mode, nothing (the first checkpoint pays for it)."""
        if self._pool is not None:
            self._pool.submit(work)

    def submit(self, step: int, work: Callable[[], object], stall_ms: float,
               **facts) -> None:
        """Write the checkpoint of ``step``: ``work()`` does it all (fingerprints, payload,
        the store's commit). ``stall_ms``: what taking it cost the training thread so far."""
        if self.busy():
            raise RuntimeError("a checkpoint write is already in flight; admit() first")
        self.check()
        if not self.background:
            t0 = time.perf_counter()
            work()
            write = time.perf_counter() - t0
            self._written(step, stall_ms + _ms(write), write, "inline", facts)
            return
        self.stalls_ms.append(stall_ms)
        self._pending_step = step
        self._pending = self._pool.submit(self._run, step, work, stall_ms, facts)

    def _run(self, step, work, stall_ms, facts) -> None:
        t0 = time.perf_counter()
        work()
        self._written(step, stall_ms, time.perf_counter() - t0, "background", facts,
                      record=False)

    def _written(self, step, stall_ms, write_s, writer, facts, record=True) -> None:
        if record:
            self.stalls_ms.append(stall_ms)
        self.journal(Event.CHECKPOINT_WRITTEN, step=step, writer=writer,
                     stall_ms=round(stall_ms, 2), write_ms=_ms(write_s), **facts)

    def drain(self) -> float:
        """Wait for the write in flight and raise its error; returns the ms waited. The end
        of the run, a preemption and the export go through here."""
        t0 = time.perf_counter()
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
        self.check()
        return _ms(time.perf_counter() - t0)

    def close(self, failing: bool = False) -> None:
        """Finish the write in flight (it may save work for the next attempt) and stop the
        thread. ``failing``: the training thread is already raising; a write error then is
        printed, not raised, so that it does not hide the first failure."""
        try:
            self.drain()
        except Exception as exc:  # noqa: BLE001 - raised below unless another error is up
            if not failing:
                raise
            log.warning(f"the checkpoint write in flight failed too: "
                        f"{type(exc).__name__}: {exc}")
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

"""The standby worker: warm up beside the active worker, wait for promotion, become an attempt.

It runs ``configure`` and ``prepare`` (attempt.py) and traces one step at low priority (nice
19, first for the OOM killer), journals ``standby_ready`` and waits on stdin; the promotion
line (``{"attempt": N}``) makes it attempt N through the cold attempt's ``run``, with its
priority put back. A closed pipe (discarded, or the supervisor gone) ends it. Why its session's
autogroup is left as it is, with the figures: ARCHITECTURE.md, "The warm standby".
"""
from __future__ import annotations

import json
import logging
import os
import random
import sys
import threading
import time
import traceback

from orchestrator.core.events import Event
from orchestrator.core.heartbeat import Position, resident_bytes
from orchestrator.core.journal import Journal
from orchestrator.core.rundir import EXIT_PREEMPTED
from orchestrator.core.standbymode import StandbyMode
from orchestrator.train import attempt
from orchestrator.train import holders, outcome, state
from orchestrator.train.preemption import Preempted

log = logging.getLogger(__name__)

STANDBY_NICE = 19
STANDBY_OOM_SCORE_ADJ = 1000  # the kernel's OOM killer takes the standby before the worker
OOM_SCORE_ADJ = "/proc/self/oom_score_adj"


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        return [0]


def _set_priority(nice: int) -> None:
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def _oom_score_adj(value: int) -> None:
    with open(OOM_SCORE_ADJ, "w", encoding="ascii") as f:
        f.write(str(value))


def lower_priority(nice: int = STANDBY_NICE) -> int:
    """Every thread of this process to ``nice``, and this process first in line for the
    kernel's OOM killer (it holds about as much memory as the worker, which must not be the
    one to go); returns the nice value before."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    _set_priority(max(before, nice))
    try:
        _oom_score_adj(STANDBY_OOM_SCORE_ADJ)  # raising it needs no privilege
    except OSError as exc:  # no procfs: only the priority is lowered
        log.info(f"oom_score_adj not raised ({exc})")
    return before


def restore_priority(before: int) -> str | None:
    """Every thread back to ``before``, the OOM score back to neutral; None when done, else
    why not (it stays lowered)."""
    try:
        _set_priority(before)
        _oom_score_adj(0)
    except PermissionError as exc:
        return (f"stays at nice {os.getpriority(os.PRIO_PROCESS, 0)} or OOM score "
                f"{STANDBY_OOM_SCORE_ADJ}: {exc} (restoring them needs root)")
    except FileNotFoundError:  # no procfs: the priority was all there was to restore
        return None
    return None


def trace(prep) -> None:
    """One step of ``fit`` on the job's real first batch (and one validation batch), so that
    the functions the attempt's ``fit`` calls are traced already (Keras keeps them on the
    model); then every effect of that step is put back: model and optimizer variables
    (weights, seed generators, iterations, slots), metric state, Python's and NumPy's RNGs.
    Checked by fingerprint: a standby that cannot put its state back fails its warm-up and the
    recovery goes cold, rather than train from a state a cold start would not have. A model
    whose optimizers its own ``train_step`` builds at the first step is not traced (the build
    cannot be undone): the standby waits with the model built, and the step traces once
    promoted."""
    import numpy as np

    model = prep.model
    late = [g.where for g in holders.discover(model).groups
            if g.kind == holders.OPTIMIZER and not g.holder.built]
    if late:  # built by the traced step, and a built optimizer cannot be un-built
        log.info(f"not tracing a step: {', '.join(late)} would be built by it (a "
                 f"train_step of the model's own); the promoted worker traces its first step")
        return
    before = state.capture(model)
    print_before = state.state_fingerprint(model)
    rngs = random.getstate(), np.random.get_state()
    backend = prep.backend
    ds = backend.train_data(prep.data, prep.spec.seed, 0, 1, prep.global_batch,
                            prep.placement.drop_remainder)
    val = backend.validation_sample(prep.val_ds, prep.global_batch)
    model.fit(ds, validation_data=val, epochs=1, steps_per_epoch=1, verbose=0,
              **backend.fit_options(prep.global_batch))
    with prep.strategy.scope():
        state.restore(model, before)
    model.reset_metrics()
    model.stop_training = False
    random.setstate(rngs[0])
    np.random.set_state(rngs[1])
    after = state.state_fingerprint(model)
    if after != print_before:
        raise RuntimeError(f"the traced step could not be undone (state sha256 "
                           f"{print_before[:12]} before, {after[:12]} after)")


def wait_for_promotion(stream) -> dict | None:
    """Block until the supervisor writes the promotion line; None when the pipe closes (the
    supervisor discarded this standby or is gone). A line that is not the expected JSON
    object is an error: the two processes are the same version of this package."""
    line = stream.readline()
    if not line:
        return None
    order = json.loads(line)
    if not isinstance(order, dict) or not isinstance(order.get("attempt"), int):
        raise ValueError(f"promotion line {line!r}: expected {{\"attempt\": N}}")
    return order


class Promotion:
    """The promotion line, read on a thread of its own from the start of the warm-up, so that a
    standby can be *adopted* before it is ready: the supervisor promotes one still warming up
    when the worker dies (a kill 1-2 s after an attempt's first step finds it importing), and
    it gets its priority back at once (from this thread, every thread of the process) and
    finishes its start-up as the attempt, skipping what only a waiting standby needs (the
    traced step, which ``fit`` then does). It is never slower than a cold start: the same code
    from the same point, with the part already done behind it."""

    def __init__(self, stream, nice_before: int):
        self.stream, self.nice_before = stream, nice_before
        self.arrived = threading.Event()
        self.order: dict | None = None
        self.error: BaseException | None = None
        self.priority_why_not: str | None = None
        self.arrived_at: float | None = None
        threading.Thread(target=self._read, name="promotion", daemon=True).start()

    def _read(self) -> None:
        try:
            self.order = wait_for_promotion(self.stream)
        except Exception as exc:  # noqa: BLE001 - raised in the main thread by wait()
            self.error = exc
        if self.order is not None:
            self.arrived_at = time.time()
            self.priority_why_not = restore_priority(self.nice_before)
        self.arrived.set()

    def adopted(self) -> bool:
        """The line came while warming up (checked between the warm-up's stages)."""
        return self.arrived.is_set() and self.order is not None

    def closed(self) -> bool:
        """The pipe closed while warming up: discarded, or the supervisor is gone."""
        return self.arrived.is_set() and self.order is None and self.error is None

    def pending(self) -> bool:
        """Neither adopted nor closed: the warm-up goes on."""
        return not (self.adopted() or self.closed())

    def wait(self) -> dict | None:
        self.arrived.wait()
        if self.error is not None:
            raise self.error
        return self.order


def _raising(exc: BaseException):
    def body():
        raise exc
    return body


def serve(spec, layout, number: int, mode: str, notice, t0: float) -> int:
    """Warm up at low priority, journal ``standby_ready``, wait for the promotion line on
    stdin, then become attempt ``number`` (the number the promotion line gives) through the
    cold attempt's own steps (attempt.py). A line that comes during the warm-up adopts it
    (``Promotion``)."""
    nice = lower_priority()
    promotion = Promotion(sys.stdin, nice)
    prep, ready_at = None, None
    try:
        marks = attempt.configure(spec, t0)
        if mode == StandbyMode.WARM and promotion.pending():
            prep = attempt.prepare(spec, t0, marks)
            if promotion.pending():
                trace(prep)
                prep.backend.after_compile()
                marks["traced"] = round(time.time() - t0, 3)
        if promotion.pending():
            ready_at = time.time()
            Journal(layout.journal).append(Event.STANDBY_READY, source="worker",
                                           for_attempt=number, pid=os.getpid(), mode=mode,
                                           phases_s=marks, rss=resident_bytes())
            log.info(f"ready ({mode}) after {ready_at - t0:.1f} s; waiting")
        order = promotion.wait()
    except (Exception, Preempted) as exc:  # noqa: BLE001 - a standby's failure is not fatal
        if promotion.adopted():  # it is the attempt now: its failure is the attempt's, recorded
            return outcome.guarded(layout, promotion.order["attempt"], Position(),
                                   _raising(exc))
        if isinstance(exc, Preempted):
            return EXIT_PREEMPTED
        traceback.print_exc()
        log.info("failed to warm up; the next recovery is a cold start")
        return 1
    if order is None:
        log.info("discarded")
        return 0
    t_start = promotion.arrived_at or time.time()
    n = order["attempt"]
    if ready_at is None:  # adopted: threads its warm-up started since the line came, too
        why_not = restore_priority(nice)
        info = {"adopted": True, "warmed_s": round(t_start - t0, 3),
                "done": sorted(k for k in marks if k != "traced")}
    else:
        why_not = promotion.priority_why_not
        info = {"waited_s": round(t_start - ready_at, 3), "warm_up_s": round(ready_at - t0, 3)}
    info.update(mode=mode, priority_restored=why_not is None)
    if why_not:
        log.info(f"priority {why_not}")
    log.info(f"{'adopted' if ready_at is None else 'promoted'} as attempt {n}")
    progress = Position()

    def body():
        marks = {}
        return attempt.run(prep or attempt.prepare(spec, t_start, marks),
                         attempt.Attempt(layout, n, progress, t_start, marks, notice, None, info))

    return outcome.guarded(layout, n, progress, body)

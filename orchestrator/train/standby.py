"""The standby worker: warm up beside the active worker, wait for promotion, become an attempt.

It runs ``configure`` and ``prepare`` (attempt.py) and traces one step at low priority (nice
19, first for the OOM killer), journals ``standby_ready`` and waits on stdin; the promotion
line (``{"attempt": N}``) makes it attempt N through the cold attempt's ``run``, with its
priority put back. A closed pipe (discarded, or the supervisor gone) ends it. Why its session's
autogroup is left as it is, with the figures: ARCHITECTURE.md, "The warm standby".
"""
from __future__ import annotations

import logging
import os
import random
import sys
import time
import traceback

from orchestrator.core.events import Event
from orchestrator.core.heartbeat import Position, resident_bytes
from orchestrator.core.journal import Journal
from orchestrator.core.rundir import EXIT_PREEMPTED
from orchestrator.core.standbymode import StandbyMode
from orchestrator.train import attempt, holders, multiworker, outcome, state
from orchestrator.train.preemption import Preempted
from orchestrator.train.promotion import Promotion, lower_priority, restore_priority

log = logging.getLogger(__name__)

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
        # adopted before its model was built: the checkpoint is read while it is built
        reading = None if prep else attempt.read_beside(spec, layout, n, multiworker.rank())
        return attempt.run(prep or attempt.prepare(spec, t_start, marks),
                           attempt.Attempt(layout, n, progress, t_start, marks, notice, None,
                                           info), reading)

    return outcome.guarded(layout, n, progress, body)

"""The recovery policy: failure kind -> the next action on that kind's ladder, with budgets.

Read like tenacity's composed strategies: a ladder is a list of rungs (``Rung(action, times)``);
each failure of a kind takes the next use of its ladder, skipping rungs that do not apply now
(reinstall not opted in, batch already minimal, no strategy left to fall back to). Past the last
rung comes ``give_up``. On top of the ladders sit the run-wide stops: the restart budget and the
crash-loop rule (the same kind at the same step N times in a row, or K failures within T minutes
without a new checkpoint). A new checkpoint ends a streak: ladders start again from the bottom.
Supervisor side: never imports TensorFlow.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.core.spec import RecoverySpec, Rung
from orchestrator.core.kinds import Action, Kind

GIVE_UP = Action.GIVE_UP
STRATEGY_ORDER = ("tpu", "gpu", "cpu")

DEFAULT_LADDERS: dict[str, tuple[Rung, ...]] = {
    # a fresh process, then a fresh TPU system, then a fresh TensorFlow, then another device
    Kind.ACCELERATOR_CONTEXT: (Rung(Action.RESTART), Rung(Action.REINIT_ACCELERATOR),
                            Rung(Action.REINSTALL_TENSORFLOW), Rung(Action.FALLBACK_STRATEGY)),
    Kind.ACCELERATOR_UNAVAILABLE: (Rung(Action.WAIT_ACCELERATOR, 3), Rung(Action.FALLBACK_STRATEGY)),
    Kind.ACCELERATOR_BUSY: (Rung(Action.WAIT_ACCELERATOR, 3),),
    Kind.OUT_OF_MEMORY: (Rung(Action.HALVE_BATCH, 2), Rung(Action.RESTART)),
    Kind.STORAGE: (Rung(Action.RESTART, None),),  # the restart backoff is the wait
    Kind.HANG: (Rung(Action.RESTART, 2),),
    Kind.KILLED: (Rung(Action.RESTART, None),),   # preemptions: as long as the budget lasts
    Kind.USER_ERROR: (),                     # retrying will not help ([restart] to confirm once)
    Kind.UNKNOWN: (Rung(Action.RESTART, None),),
}


@dataclass(frozen=True)
class Failure:
    attempt: int
    kind: str
    signature: str | None
    position: str        # where training stood ("epoch E batch B")
    time: float
    evidence: str = ""
    escalate: dict | None = None


@dataclass(frozen=True)
class Decision:
    action: str
    kind: str            # the kind acted on (after escalation)
    reason: str          # why this action (or why giving up)


@dataclass
class RecoveryPolicy:
    spec: RecoverySpec
    max_restarts: int
    # action -> None if it can be taken now, else why not (set by the supervisor)
    applicable: Callable[[str], str | None] = lambda action: None
    clock: Callable[[], float] = time.time
    streak: list = field(default_factory=list)      # failures since the last new checkpoint
    _rung: dict = field(default_factory=dict)       # kind -> (rung index, uses of it)

    def ladder(self, kind: str) -> tuple[Rung, ...]:
        custom = self.spec.ladder(kind)
        return custom if custom is not None else DEFAULT_LADDERS.get(kind, ())

    def progress(self) -> None:
        """A new checkpoint was committed: the run is moving, start the ladders afresh."""
        self.streak.clear()
        self._rung.clear()

    def decide(self, failure: Failure, restarts_used: int) -> Decision:
        failure = self._escalated(failure)
        self.streak.append(failure)
        decision = self.next_rung(failure.kind)
        if decision.action == GIVE_UP:
            return decision
        if restarts_used >= self.max_restarts:
            return Decision(GIVE_UP, failure.kind, f"restart budget of {self.max_restarts} spent")
        loop = self._crash_loop()
        if loop:
            return Decision(GIVE_UP, failure.kind, f"crash loop: {loop}")
        return decision

    def next_rung(self, kind: str) -> Decision:
        """Take the next use of ``kind``'s ladder (skipping rungs that do not apply now)."""
        ladder = self.ladder(kind)
        index, uses = self._rung.get(kind, (0, 0))
        skipped = []
        while index < len(ladder):
            rung = ladder[index]
            if rung.action == GIVE_UP:
                break
            why_not = self.applicable(rung.action)
            if why_not is None and (rung.times is None or uses < rung.times):
                self._rung[kind] = (index, uses + 1)
                of = "" if rung.times is None else f", {uses + 1} of {rung.times}"
                note = f"; skipped {'; '.join(skipped)}" if skipped else ""
                return Decision(rung.action, kind,
                                f"{kind}: ladder rung {index + 1} ({rung.action}{of}{note})")
            if why_not is not None:
                skipped.append(f"{rung.action}: {why_not}")
            index, uses = index + 1, 0
        self._rung[kind] = (index, 0)
        note = f" (skipped {'; '.join(skipped)})" if skipped else ""
        if not ladder:
            return Decision(GIVE_UP, kind, f"{kind}: a restart cannot fix it")
        return Decision(GIVE_UP, kind, f"{kind}: recovery ladder exhausted{note}")

    def first_action(self, kind: str) -> str:
        """What the policy would do about a first failure of ``kind`` (for diagnose)."""
        saved = dict(self._rung)
        try:
            return self.next_rung(kind).action
        finally:
            self._rung = saved

    # ------------------------------------------------------------------ rules
    def _escalated(self, f: Failure) -> Failure:
        """E.g. an illegal CUDA address once is the device; at the same step twice, the job."""
        esc = f.escalate
        if not esc or not f.signature:
            return f
        need = int(esc.get("after", 2)) - 1
        prev = self.streak[-need:] if need > 0 else []
        if len(prev) == need and all(p.signature == f.signature and p.position == f.position
                                     for p in prev):
            return Failure(f.attempt, esc["kind"], f.signature, f.position, f.time, f.evidence)
        return f

    def _crash_loop(self) -> str | None:
        c = self.spec.crash_loop
        last = self.streak[-c.same_failure:]
        if len(last) == c.same_failure and len({(f.kind, f.position) for f in last}) == 1:
            return (f"{last[0].kind} at the same step ({last[0].position}) "
                    f"{c.same_failure} times in a row")
        window = c.window_minutes * 60
        recent = [f for f in self.streak if f.time >= self.clock() - window]
        if len(recent) >= c.failures:
            return (f"{len(recent)} failures within {c.window_minutes:g} minutes "
                    f"without a new checkpoint")
        return None


def next_strategy(current: str) -> str | None:
    """The strategy to fall back to from ``current`` (tpu -> gpu -> cpu), or None."""
    if current not in STRATEGY_ORDER:
        return None
    i = STRATEGY_ORDER.index(current)
    return STRATEGY_ORDER[i + 1] if i + 1 < len(STRATEGY_ORDER) else None

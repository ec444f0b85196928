"""The recovery policy: failure kind -> the next action on that kind's ladder, with budgets.

Read like tenacity's composed strategies: a ladder is a list of rungs (``Rung(action, times)``);
each failure of a kind takes the next use of its ladder, skipping rungs that do not apply now
(reinstall not opted in, batch already minimal, no strategy left to fall back to). Past the last
rung comes ``give_up``. On top of the ladders sit the run-wide stops, all decided here, once:

- two budgets. Kills from outside (``killed``: preemptions, recycled VMs) count against
  ``restarts.preemptions`` (no limit by default, as SkyPilot's managed jobs); every other failure
  counts against ``restarts.max``, since the last new checkpoint, so a run that keeps
  progressing is never stopped by scattered failures;
- the crash-loop rule, over the job's own failures only (the same kind at the same step N times
  in a row, or K failures within T minutes without a new checkpoint). Kills that land during
  start-up all share "the same step" and measured as a crash loop after three (17 s) before
  kills were set apart;
- the backoff: the first failure after progress restarts at once; consecutive failures with no
  new checkpoint in between are spaced ``restarts.backoff`` apart (tenacity's exponential
  wait), counted from the failed attempt's start: a worker that dies at its import waits, one
  killed after running longer than the wait (a cold start's worth, or more) has waited already
  and restarts at once, so a storm of kills still slows down once the wait outgrows the
  attempts. A new checkpoint ends a streak: the ladders and the backoff start again from the
  bottom.

``decide`` returns the whole answer: the action, the kind acted on, the delay and the reason.
Supervisor side: never imports TensorFlow.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Callable

from tenacity import wait_exponential

from orchestrator.core.spec import RecoverySpec, RestartSpec, Rung
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
    ran_s: float = 0.0   # how long the failed attempt ran (its start to its end)


@dataclass(frozen=True)
class Decision:
    action: str
    kind: str            # the kind acted on (after escalation)
    reason: str          # why this action (or why giving up)
    delay_s: float = 0.0  # how long to wait before the next attempt


def is_preemption(kind: str) -> bool:
    """A kill from outside: it has its own budget and never makes a crash loop by itself."""
    return kind == Kind.KILLED


@dataclass
class RecoveryPolicy:
    spec: RecoverySpec
    restarts: RestartSpec = RestartSpec()
    # action -> None if it can be taken now, else why not (given by the supervisor's remedies;
    # it reads state only, it never probes)
    applicable: Callable[[str], str | None] = lambda action: None
    clock: Callable[[], float] = time.time
    streak: list = field(default_factory=list)      # failures since the last new checkpoint
    preemptions: int = 0                            # kills from outside, this run
    _rung: dict = field(default_factory=dict)       # kind -> (rung index, uses of it)

    def ladder(self, kind: str) -> tuple[Rung, ...]:
        custom = self.spec.ladder(kind)
        return custom if custom is not None else DEFAULT_LADDERS.get(kind, ())

    def progress(self) -> None:
        """A new checkpoint was committed: the run is moving, start the ladders afresh."""
        self.streak.clear()
        self._rung.clear()

    @property
    def errors(self) -> list[Failure]:
        """The failures that count against ``restarts.max``: not preemptions, since progress."""
        return [f for f in self.streak if not is_preemption(f.kind)]

    def counters(self) -> dict:
        """Both budgets as the journal and status show them."""
        r = self.restarts
        return {"errors": len(self.errors), "errors_max": r.max,
                "preemptions": self.preemptions, "preemptions_max": r.preemptions}

    def decide(self, failure: Failure) -> Decision:
        failure = self._escalated(failure)
        self.streak.append(failure)
        if is_preemption(failure.kind):
            self.preemptions += 1
        decision = self.next_rung(failure.kind)
        if decision.action == GIVE_UP:
            return decision
        stop = self._budget_spent(failure) or self._crash_loop()
        if stop:
            return Decision(GIVE_UP, failure.kind, stop)
        return replace(decision, delay_s=max(0.0, self.backoff() - failure.ran_s))

    def backoff(self) -> float:
        """The spacing due between the starts of the last failed attempt and the next: 0 s for
        the first failure since progress, then the exponential wait over the consecutive
        failures that committed nothing new (1, 2, 4 ... s by default)."""
        n = len(self.streak)
        if n <= 1:
            return 0.0
        r = self.restarts
        wait = wait_exponential(multiplier=r.backoff_initial, exp_base=r.backoff_multiplier,
                                max=r.backoff_max)
        return float(wait(SimpleNamespace(attempt_number=n - 1)))

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
            return replace(f, kind=esc["kind"], escalate=None)
        return f

    def _budget_spent(self, failure: Failure) -> str | None:
        r = self.restarts
        if is_preemption(failure.kind):
            if r.preemptions is not None and self.preemptions > r.preemptions:
                return f"preemption budget of {r.preemptions} spent"
            return None
        if len(self.errors) > r.max:
            return f"restart budget of {r.max} spent"
        return None

    def _crash_loop(self) -> str | None:
        """Over the failures that can be the job's own. A storage outage fails at the same step
        until the mount returns, which says nothing about the job: its budget and backoff bound
        it, as kills are bounded by theirs."""
        c = self.spec.crash_loop
        errors = [f for f in self.errors if f.kind != Kind.STORAGE]
        last = errors[-c.same_failure:]
        if len(last) == c.same_failure and len({(f.kind, f.position) for f in last}) == 1:
            return (f"crash loop: {last[0].kind} at the same step ({last[0].position}) "
                    f"{c.same_failure} times in a row")
        window = c.window_minutes * 60
        recent = [f for f in errors if f.time >= self.clock() - window]
        if len(recent) >= c.failures:
            return (f"crash loop: {len(recent)} failures within {c.window_minutes:g} minutes "
                    f"without a new checkpoint")
        return None


def next_strategy(current: str) -> str | None:
    """The strategy to fall back to from ``current`` (tpu -> gpu -> cpu), or None."""
    if current not in STRATEGY_ORDER:
        return None
    i = STRATEGY_ORDER.index(current)
    return STRATEGY_ORDER[i + 1] if i + 1 < len(STRATEGY_ORDER) else None

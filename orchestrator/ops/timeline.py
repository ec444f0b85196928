"""The run's history as sessions, attempts and faults, and where its wall time went.

Read from the journal alone, so that ``status``, ``report`` and the progress line agree, and so
that a run can be judged after the machine that ran it is gone. This is the one place goodput is
defined (see ``account``). Fields added by later versions of the supervisor (an attempt's
``kind``, ``recovery`` events) are used when present; older journals fall back to what the exit
status says.

Goodput = useful / wall, where, from journal timestamps:
  * wall: the sum of supervisor sessions, each from its ``run_started``/``run_resumed`` to its
    ``run_completed``/``run_failed``/``supervisor_stopped`` (or to its last event when the
    supervisor vanished, or to now while it runs). Time with no supervisor (a recycled VM nobody
    restarted yet) is ``away``, outside wall time.
    Where the run was carried through runtimes by ``orchestrator colab`` (core/hosts.py), the
    wall time is the outer loop's, from its first request for a runtime to its end: the time
    between two supervisors (a runtime lost, the next one asked for, set up, waiting for the
    lost one's lock to go stale) is charged to ``between_runtimes``, nothing is away.
  * useful: per attempt, from its first training step (``first_step``; else ``worker_ready``;
    else its start) to its last committed checkpoint: training whose result was kept.
Everything else in wall time is charged to one cause: ``startup`` (a session's first worker
starting up), a fault kind (progress lost after the last checkpoint of the failed attempt, the
wait before the next attempt and that attempt's start-up), ``stopped`` (progress lost when the
supervisor was stopped), ``overhead`` (the supervisor's own bits, the final checkpoint's exit)
or ``in_progress`` (the running attempt's training since its last checkpoint: not lost yet).
Training a recycled runtime's write-back cache took with it (``durable_lost``,
checkpoint/lost.py) is moved from ``useful`` (else from ``between_runtimes``, where a journal
that never reached the cloud leaves it) to ``durable_lost``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator.checkpoint.lost import lost_s
from orchestrator.recovery.failures import kind_of
from orchestrator.core.events import Event
from orchestrator.core.kinds import Kind

NOT_LOST = ("useful", "in_progress")
NOT_FAULTS = ("startup", "overhead", "stopped")  # lost, but to no fault
SESSION_START = (Event.RUN_STARTED, Event.RUN_RESUMED)
SESSION_END = (Event.RUN_COMPLETED, Event.RUN_FAILED, Event.SUPERVISOR_STOPPED)
CHECKPOINT_EVENTS = (Event.CHECKPOINT_COMMITTED,)


@dataclass
class Attempt:
    n: int
    started: float
    session: int
    from_epoch: int = 0
    ready: float | None = None
    first_step: float | None = None
    last_commit: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    kind: str | None = None       # why it failed; None while running or when it succeeded
    actions: list = field(default_factory=list)
    how: str = ""                 # how it ended: "killed by SIGKILL", "exit code 1"
    error: dict | None = None
    epoch: int | None = None      # epochs completed when it ended
    steps_per_epoch: int | None = None

    @property
    def failed(self) -> bool:
        return self.kind is not None

    @property
    def training_start(self) -> float:
        return self.first_step or self.ready or self.started


@dataclass
class Session:
    started: float
    ended: float
    how: str    # completed | failed | stopped | vanished | running | ended
    attempts: list = field(default_factory=list)
    host: str | None = None  # where its supervisor ran (journals from before: None)


@dataclass
class FaultMark:
    """A failed attempt as the report and status mark it (an injected fault is
    ``recovery.faults.FaultSpec``)."""

    ts: float
    attempt: int | None
    kind: str
    action: str
    detail: str


@dataclass
class Timeline:
    sessions: list
    attempts: list
    faults: list
    markers: list         # (ts, event name, detail): injections, hangs, recoveries
    epochs: list          # epoch_completed events, in journal order
    events: list

    @property
    def started(self) -> float | None:
        return self.sessions[0].started if self.sessions else None




def error_line(error: dict | None) -> str | None:
    """``Type: first line of the message``, or None."""
    if not error:
        return None
    msg = (error.get("message") or "").strip().splitlines()
    return f"{error.get('type') or 'Error'}: {msg[0] if msg else ''}".rstrip(": ")


def build(events: list[dict], running: bool = False, now: float | None = None) -> Timeline:
    """Sessions, attempts, faults from the journal. ``running``: the last session is live."""
    now = time.time() if now is None else now
    r = _Reading()
    for e in events:
        r.read(e)
    r.close(running, now)
    faults = [FaultMark(ts=a.ended, attempt=a.n, kind=a.kind,
                        action="; ".join(a.actions) or "none",
                        detail=error_line(a.error) or a.how)
              for a in r.attempts.values() if a.failed]
    return Timeline(sessions=r.sessions, attempts=list(r.attempts.values()), faults=faults,
                    markers=r.markers, epochs=r.epochs, events=events)


class _Reading:
    """The journal read in order: the sessions, attempts, markers and epochs so far."""

    def __init__(self):
        self.sessions: list[Session] = []
        self.attempts: dict[int, Attempt] = {}
        self.current: Attempt | None = None
        self.markers: list = []
        self.epochs: list = []

    def read(self, e: dict) -> None:
        ev, ts = e.get("event"), e.get("ts", 0.0)
        if ev in SESSION_START:
            if self.sessions and self.sessions[-1].how == "open":
                _close(self.sessions[-1], self.current)
            self.sessions.append(Session(started=ts, ended=ts, how="open", host=e.get("host")))
            self.current = None
            return
        if not self.sessions:
            self.sessions.append(Session(started=ts, ended=ts, how="open"))
        s = self.sessions[-1]
        if s.how == "open":
            s.ended = max(s.ended, ts)
        if not self._attempt_event(ev, e, ts, s):
            self._recovery_event(ev, e, ts)
        if ev in SESSION_END and s.how == "open":
            s.how = {Event.RUN_COMPLETED: "completed", Event.RUN_FAILED: "failed",
                     Event.SUPERVISOR_STOPPED: "stopped"}[ev]
            s.ended = ts

    def _attempt_event(self, ev, e: dict, ts: float, s: Session) -> bool:
        """An attempt's start, readiness, first step, commit, epoch or end; False: none."""
        attempts, current = self.attempts, self.current
        if ev == Event.ATTEMPT_STARTED:
            self.current = Attempt(n=e["attempt"], started=ts, session=len(self.sessions) - 1,
                                   from_epoch=e.get("from_epoch", 0))
            attempts[self.current.n] = self.current
            s.attempts.append(self.current)
        elif ev == Event.WORKER_READY and e.get("attempt") in attempts:
            a = attempts[e["attempt"]]
            a.ready, a.steps_per_epoch = ts, e.get("steps_per_epoch")
        elif ev == Event.FIRST_STEP and e.get("attempt") in attempts:
            attempts[e["attempt"]].first_step = ts
        elif ev in CHECKPOINT_EVENTS and current is not None and current.ended is None:
            current.last_commit = ts
        elif ev == Event.EPOCH_COMPLETED:
            self.epochs.append(e)
        elif ev == Event.ATTEMPT_ENDED and e.get("attempt") in attempts:
            a = attempts[e["attempt"]]
            a.ended, a.exit_code, a.signal = ts, e.get("exit_code"), e.get("signal")
            a.kind, a.error, a.epoch = kind_of(e), e.get("error"), e.get("epoch")
            a.how = _how(e)
        else:
            return False
        return True

    def _recovery_event(self, ev, e: dict, ts: float) -> None:
        """What the supervisor did about a failure, and the faults and takeovers it noted."""
        if ev == Event.RECOVERY:
            a = self.attempts.get(e.get("attempt"))
            if a is not None:
                a.kind = e.get("kind") or a.kind
                if e.get("action") != "restart":  # a restart is told by its restart event
                    a.actions.append(" ".join(str(x) for x in (e.get("action"), e.get("detail"))
                                              if x))
            self.markers.append((ts, ev, f"{e.get('kind')}: {e.get('action')}"))
        elif ev == Event.RESTART:
            a = self.attempts.get(e.get("after_attempt"))
            if a is not None and not any(x.startswith("restart") for x in a.actions):
                a.actions.append(f"restart in {e.get('delay_s', 0):.3g} s")
        elif ev == Event.RUN_FAILED:
            a = self.attempts.get(e.get("last_attempt"))
            if a is not None:
                a.kind = e.get("kind") or a.kind or Kind.UNKNOWN
                a.actions.append("gave up: " + (e.get("reason") or ""))
        elif ev in (Event.FAULT_INJECTED, Event.HANG_DETECTED, Event.LOCK_TAKEN_OVER,
                    Event.ORPHAN_WORKER_KILLED, Event.PROCESS_LEFT_ALONE):
            detail = e.get("fault") or e.get("kind") or e.get("reason") or ""
            self.markers.append((ts, ev, str(detail)))

    def close(self, running: bool, now: float) -> None:
        """The last session live or closed; an attempt no end was journalled for ended with
        its session: stopped with the supervisor, or lost with it."""
        sessions = self.sessions
        if sessions and sessions[-1].how == "open":
            if running:
                sessions[-1].how, sessions[-1].ended = "running", max(now, sessions[-1].ended)
            else:
                _close(sessions[-1], self.current)
        for s in sessions:
            for a in s.attempts:
                if a.ended is None and s.how != "running":
                    a.ended = s.ended
                    if s.how == "stopped":
                        a.kind, a.how = a.kind or "stopped", "stopped with the supervisor"
                    else:
                        a.kind = a.kind or Kind.KILLED
                        a.how = "the supervisor vanished (VM recycled or killed)"
                        a.actions.append("resumed by the next `orchestrator run`"
                                         if s is not sessions[-1] else "none yet: run it again")


def _how(ended: dict) -> str:
    how = f"killed by {ended['signal']}" if ended.get("signal") else \
        f"exit code {ended.get('exit_code')}"
    return how + (f" [{ended['signature']}]" if ended.get("signature") else "")


def _close(s: Session, current: Attempt | None) -> None:
    s.how = "vanished" if current is not None and current.ended is None else "ended"


def segments(tl: Timeline) -> list[tuple[str, float, float]]:
    """Wall time cut into ``(cause, t0, t1)`` pieces, in order (see the module docstring)."""
    out: list[tuple[str, float, float]] = []

    def charge(cause: str, t0: float | None, t1: float | None) -> None:
        if t0 is not None and t1 is not None and t1 > t0:
            out.append((cause, t0, t1))

    previous_kind = None  # a restart's wait and start-up are charged to what caused it
    for s in tl.sessions:
        t = s.started
        for a in s.attempts:
            charge(previous_kind or "overhead", t, a.started)
            train0 = min(a.training_start, a.ended or a.training_start)
            charge(previous_kind or "startup", a.started, train0)
            end = a.ended if a.ended is not None else s.ended
            tail0 = train0
            if a.last_commit is not None and a.last_commit > train0:
                charge("useful", train0, a.last_commit)
                tail0 = a.last_commit
            charge("in_progress" if a.ended is None else a.kind or "overhead", tail0, end)
            t, previous_kind = end, a.kind
        charge(previous_kind or "overhead", t, s.ended)
    return out


BETWEEN_RUNTIMES = "between_runtimes"
DURABLE_LOST = Event.DURABLE_LOST  # a cause of lost time, named as its event


def account(tl: Timeline, span: tuple[float, float] | None = None) -> dict:
    """Seconds of wall time by cause (``useful`` and ``in_progress`` included), and goodput.
    ``span``: the outer loop's (core/hosts.span), when runtimes were carried by one: its time
    outside every supervisor session counts, as ``between_runtimes``."""
    by: dict[str, float] = {}
    for cause, t0, t1 in segments(tl):
        by[cause] = by.get(cause, 0.0) + (t1 - t0)
    wall = sum(s.ended - s.started for s in tl.sessions)
    away = sum(max(0.0, b.started - a.ended) for a, b in zip(tl.sessions, tl.sessions[1:]))
    if span is not None:
        inside = sum(max(0.0, min(s.ended, span[1]) - max(s.started, span[0]))
                     for s in tl.sessions)
        between = max(0.0, span[1] - span[0] - inside)
        by[BETWEEN_RUNTIMES] = between
        wall, away = wall + between, 0.0
    lost = min(lost_s(tl.events), by.get("useful", 0.0) + by.get(BETWEEN_RUNTIMES, 0.0))
    if lost > 0:
        from_useful = min(lost, by.get("useful", 0.0))
        by["useful"] = by.get("useful", 0.0) - from_useful
        if lost > from_useful:
            by[BETWEEN_RUNTIMES] -= lost - from_useful
        by[DURABLE_LOST] = lost
    lost = {k: v for k, v in by.items() if k not in NOT_LOST}
    faults_lost = sum(v for k, v in lost.items() if k not in NOT_FAULTS)
    return {
        "wall_s": round(wall, 3),
        "useful_s": round(by.get("useful", 0.0), 3),
        "goodput": round(by.get("useful", 0.0) / wall, 4) if wall > 0 else None,
        "lost_to_faults_s": round(faults_lost, 3),
        "by_cause_s": {k: round(v, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
        "away_s": round(away, 3),
    }


def restarts_by_kind(tl: Timeline) -> dict[str, int]:
    """How many restarts followed each kind of failure."""
    by_n = {a.n: a for a in tl.attempts}
    out: dict[str, int] = {}
    for e in tl.events:
        if e.get("event") == Event.RESTART:
            a = by_n.get(e.get("after_attempt"))
            k = (a.kind if a else None) or Kind.UNKNOWN
            out[k] = out.get(k, 0) + 1
    return out

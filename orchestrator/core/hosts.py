"""The runtimes a run was trained on, as the outer loop outside them saw them.

``orchestrator colab`` (orchestrator/colab/) runs on the user's machine and drives Colab
runtimes that come and go; inside each one a supervisor runs and journals to ``events.jsonl``
as always. What no supervisor can journal - that a runtime was asked for, refused, given, and
why it ended - the driver writes to its own journal, ``FILE``, kept locally and copied into the
run directory. Both sides read it here: the driver to count its budgets, ``status`` and the
report to show each runtime as a host on the timeline and to charge the time between them.
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core.events import Event

FILE = "runtimes.jsonl"


@dataclass
class Host:
    """One runtime's session: from the request that got it to its end."""

    n: int
    session: str
    kind: str
    requested: float
    allocated: float | None = None
    started: float | None = None   # when `orchestrator run` was started there
    ended: float | None = None
    why: str | None = None         # None while it runs
    host: str | None = None        # the runtime's host name, as its supervisor records it
    refusals: int = 0              # how often the request was refused before it was given
    step: int | None = None        # the run's last known step when it ended

    def record(self, until: float | None = None) -> dict:
        end = self.ended if self.ended is not None else until
        return {"n": self.n, "session": self.session, "kind": self.kind, "host": self.host,
                "requested": self.requested, "allocated": self.allocated,
                "started": self.started, "ended": self.ended, "why": self.why or "running",
                "refusals": self.refusals, "step": self.step,
                "lasted_s": None if end is None or self.allocated is None
                else round(end - self.allocated, 3)}


def hosts(events: list[dict]) -> list[Host]:
    """The runtimes of an outer journal, in order. A refused request belongs to the runtime
    that was finally given (its ``refusals``); requests never given make no host."""
    out: list[Host] = []
    pending: Host | None = None
    for e in events:
        ev, ts = e.get("event"), e.get("ts", 0.0)
        if ev == Event.RUNTIME_REQUESTED:
            refusals = pending.refusals if pending is not None and pending.allocated is None \
                else 0
            pending = Host(n=len(out) + 1, session=e.get("session", "?"),
                           kind=e.get("kind", "?"), requested=ts, refusals=refusals)
        elif ev == Event.RUNTIME_REFUSED and pending is not None:
            pending.refusals += 1
        elif ev == Event.RUNTIME_ALLOCATED and pending is not None:
            pending.allocated = ts
            out.append(pending)
        elif not out or out[-1].session != e.get("session"):
            continue
        elif ev == Event.RUNTIME_READY:
            out[-1].host = e.get("host")
        elif ev == Event.REMOTE_RUN_STARTED and out[-1].started is None:
            out[-1].started = ts
        elif ev == Event.RUNTIME_ENDED:
            out[-1].ended, out[-1].why, out[-1].step = ts, e.get("why"), e.get("step")
    return out


def span(events: list[dict], now: float) -> tuple[float, float] | None:
    """From the outer loop's first request to its end (or ``now`` while it runs): the wall
    time the user waited for the run, gaps between runtimes included."""
    first = next((e["ts"] for e in events if e.get("event") == Event.RUNTIME_REQUESTED), None)
    if first is None:
        return None
    ended = next((e["ts"] for e in reversed(events) if e.get("event") == Event.OUTER_ENDED),
                 None)
    return first, ended if ended is not None else max(now, events[-1].get("ts", first))

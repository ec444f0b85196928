"""The outer loop's decisions, apart from the loop: whether another runtime may be asked for
(the budgets), how long to wait after a refusal (the backoff), and what a probe of a runtime
means (``judge``). No process and no clock of its own: the loop passes the time in, so that a
test proves an hour's backoff or a spent budget in microseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from tenacity import wait_exponential

from orchestrator.colab import replies


@dataclass(frozen=True)
class Budgets:
    """What the user allows the outer loop to spend. ``None``: no limit."""

    #: runtimes given (a refused request costs none)
    max_sessions: int | None = 10
    #: wall-clock hours from the first request, waits and gaps included
    max_hours: float | None = None
    #: hours of runtimes held, summed (what a paid plan bills in compute units)
    max_runtime_hours: float | None = None
    #: refusals in a row that are no refusal we know (an error of the CLI) before giving up
    max_errors_in_row: int = 5


@dataclass(frozen=True)
class Backoff:
    """After a refusal: ``initial_s``, times ``multiplier`` per refusal in a row, at most
    ``max_s``. Colab gives runtimes back as others free them; asking more often than this
    would only be refused again (and is no use of Colab we would defend)."""

    initial_s: float = 60.0
    max_s: float = 1800.0
    multiplier: float = 2.0


@dataclass
class OuterPolicy:
    budgets: Budgets = field(default_factory=Budgets)
    backoff: Backoff = field(default_factory=Backoff)
    started: float = 0.0        # when the first runtime was asked for (the loop's clock)
    sessions: int = 0           # runtimes given so far
    runtime_s: float = 0.0      # seconds of runtimes held, ended ones
    refused_in_row: int = 0
    errors_in_row: int = 0

    def may_request(self, now: float) -> str | None:
        """None when another runtime may be asked for; else the budget spent, in words."""
        b = self.budgets
        if b.max_sessions is not None and self.sessions >= b.max_sessions:
            return f"the budget of {b.max_sessions} runtime(s) is spent (--max-sessions)"
        if b.max_hours is not None and now - self.started >= b.max_hours * 3600:
            return (f"the budget of {b.max_hours:g} hour(s) since the first request is spent "
                    f"(--max-hours)")
        if b.max_runtime_hours is not None and self.runtime_s >= b.max_runtime_hours * 3600:
            return (f"the budget of {b.max_runtime_hours:g} runtime hour(s) is spent "
                    f"(--max-runtime-hours)")
        return None

    def refused(self, reason: str) -> tuple[float | None, str | None]:
        """A request was refused: ``(seconds to wait, None)``, or ``(None, why we stop)``
        when errors we do not know came too often in a row (capacity and usage limits never
        stop the loop: only the budgets do)."""
        self.refused_in_row += 1
        if reason == replies.ERROR:
            self.errors_in_row += 1
            if self.errors_in_row >= self.budgets.max_errors_in_row:
                return None, (f"`colab new` failed {self.errors_in_row} times in a row with "
                              f"errors that are no capacity refusal")
        else:
            self.errors_in_row = 0
        b = self.backoff
        wait = wait_exponential(multiplier=b.initial_s, exp_base=b.multiplier, max=b.max_s)
        return float(wait(SimpleNamespace(attempt_number=self.refused_in_row))), None

    def allocated(self) -> None:
        self.sessions += 1
        self.refused_in_row = self.errors_in_row = 0

    def ended(self, held_s: float) -> None:
        self.runtime_s += max(0.0, held_s)


# What a runtime's state is, from one probe (``judge``)
RUNNING = "running"
COMPLETED = "completed"
FAILED = "failed"          # the run failed (its budget spent, a job error): no runtime helps
BAD_JOB = "bad_job"        # `orchestrator run` refused the job or its arguments (exit 2)
LOCKED = "locked"          # the run directory is another supervisor's still (exit 3)
LOST = "lost"              # the CLI says the session is no more
UNREACHABLE = "unreachable"  # no answer we can read, the session still listed
SUPERVISOR_DIED = "supervisor_died"  # the runtime answers, its supervisor is gone
STOPPED = "stopped"        # the supervisor stopped (a signal) with the run not finished

# `orchestrator run`'s exit statuses (cli.py, core/rundir.py)
_EXITS = {0: COMPLETED, 1: FAILED, 2: BAD_JOB, 3: LOCKED}


def judge(reply: replies.Reply, session: str) -> tuple[str, dict]:
    """``(state, what the probe found)`` from one ``colab exec`` of ``remote.probe``."""
    if replies.session_gone(reply, session):
        return LOST, {}
    found = replies.marked(reply)
    if found is None:
        return UNREACHABLE, {"line": replies.last_line(reply.text)}
    sup = found.get("supervisor")
    if sup == "running":
        return RUNNING, found
    if sup == "exited":
        rc = found.get("rc")
        if rc == 0 and (found.get("status") or {}).get("state") not in (None, "completed"):
            return SUPERVISOR_DIED, found  # a 0 that completed nothing: not believed
        return _EXITS.get(rc, STOPPED), found
    return SUPERVISOR_DIED, found


@dataclass
class Reachability:
    """How long a runtime may give no readable answer before it counts as lost: a probe can
    fail on the network between here and Colab while the runtime trains on."""

    grace_s: float = 300.0
    since: float | None = None

    def answered(self) -> None:
        self.since = None

    def silent(self, now: float) -> bool:
        """One more probe went unanswered; True when the grace is over."""
        if self.since is None:
            self.since = now
        return now - self.since >= self.grace_s

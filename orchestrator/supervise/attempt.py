"""One attempt's mechanics: spawn the worker, wait on its events, stop it, kill its group.

The supervisor decides *whether* and *when* to run an attempt; this module only runs it. An
attempt goes through named phases (``Phase``): spawned in its own process group (so a stop
reaches its data-loader children too), then waited on through one queue fed by a waiting
thread (the exit is noticed at once), watchdog events (committed checkpoints, heartbeats) and
periodic ``Every`` ticks; a worker that stays silent past the hang clock is dumped, stopped and
reported with its heartbeat age. What comes back is an ``Outcome``: exit status, duration, hang
age and the worker's own error record. Nothing here classifies or recovers.

The queue is the supervisor's, not the attempt's, so the standby (standby.py) feeds its exit
to the same queue: once promoted, its process is this attempt's (``adopt``).
"""
from __future__ import annotations

import enum
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from orchestrator.core import heartbeat
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import read_json
from orchestrator.core.procid import ProcessIdentity, is_running, signal_proven
from orchestrator.recovery import oom
from orchestrator.recovery.failures import signal_name
from orchestrator.supervise.hangs import HangClock, dump_stacks
from orchestrator.supervise.messages import Beat, Committed, Exited, Stop, Tick


class Stopped(Exception):
    """The supervisor was asked to stop (SIGTERM, SIGINT or KeyboardInterrupt)."""


class Phase(enum.Enum):
    NEW = "new"
    RUNNING = "running"        # spawned; its heartbeat and checkpoints are watched
    STOPPING = "stopping"      # hung: stacks dumped, SIGTERM sent, grace running
    EXITED = "exited"


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as the supervisor classifies it."""

    attempt: int
    exit_code: int
    duration_s: float
    hang_age_s: float | None   # heartbeat age when it was stopped as hung, else None
    error: dict | None         # the worker's error record for this attempt, if it wrote one
    log: str
    oom: str | None = None     # a SIGKILL with the kernel's OOM evidence (recovery/oom.py)

    def describe(self) -> str:
        if self.exit_code < 0:
            how = f"killed by {signal_name(-self.exit_code)}"
        else:
            how = f"exit code {self.exit_code}"
        if self.error:
            msg = str(self.error.get("message", "")).strip().splitlines()
            how += f": {self.error.get('type')}: {msg[0] if msg else ''}"
        return f"attempt {self.attempt} failed after {self.duration_s:.1f} s ({how})"


@dataclass
class Every:
    """A periodic duty while an attempt runs (lock refresh, accelerator probe)."""

    period: float
    run: Callable[[], None]
    due: float = 0.0

    def arm(self) -> None:
        self.due = time.monotonic() + self.period

    def maybe(self, now: float) -> None:
        if now >= self.due:
            self.run()
            self.due = time.monotonic() + self.period


class Attempt:
    def __init__(self, n: int, cmd: list[str], env: dict, cwd: str, log: str,
                 events: queue.Queue, hang: HangClock, journal: Journal, say,
                 error_record: str, stop_grace: float):
        self.n, self.cmd, self.env, self.cwd, self.log = n, cmd, env, cwd, log
        self.events, self.hang, self.journal, self.say = events, hang, journal, say
        self.error_record, self.stop_grace = error_record, stop_grace
        self.proc: subprocess.Popen | None = None
        self.phase = Phase.NEW
        self.t0 = 0.0

    def start(self, from_epoch: int, path: dict | None = None) -> None:
        """Spawn the worker. ``path``: how this attempt started, journaled with
        ``attempt_started`` (a cold start, and why it was not a promoted standby)."""
        self.t0 = time.time()
        self.proc = spawn(self.cmd, self.env, self.cwd, self.log)
        self._running(from_epoch, path)
        watch_exit(self.proc, self.events, self.proc, f"wait-attempt-{self.n}")

    def adopt(self, proc: subprocess.Popen, from_epoch: int, path: dict) -> None:
        """A promoted standby (supervise/standby.py) is this attempt: its process is already
        running, in its own group, its exit already fed to the same queue."""
        self.t0 = time.time()
        self.proc = proc
        self._running(from_epoch, path)

    def _running(self, from_epoch: int, path: dict | None) -> None:
        proc = self.proc
        self.phase = Phase.RUNNING
        self._cgroups = oom.memory_cgroups(proc.pid)
        self._oom_before = oom.snapshot(self._cgroups)
        self.hang.start(self.n)
        self.journal.append(Event.ATTEMPT_STARTED, attempt=self.n, pid=proc.pid,
                            host=os.uname().nodename, identity=identity_record(proc),
                            from_epoch=from_epoch, log=self.log, **(path or {}))

    def wait(self, on_checkpoint: Callable[[], None], duties: list[Every],
             on_training: Callable[[], None] | None = None,
             on_other_exit: Callable[[object, int], None] | None = None) -> Outcome:
        """Until the worker exits (or is stopped as hung). Raises ``Stopped`` on a stop.
        ``on_training``: once, at its first heartbeat after a training step (a standby may
        start then: the worker's start-up and first-step tracing are over);
        ``on_other_exit(proc, rc)``: another process on the queue exited (the standby)."""
        for d in duties:
            d.arm()
        hang_age = None
        while True:
            due = min([d.due for d in duties], default=time.monotonic() + 60.0)
            timeout = min(due - time.monotonic(), self.hang.remaining())
            try:
                item = self.events.get(timeout=max(0.0, timeout))
            except queue.Empty:
                item = Tick()
            rc = self._exited(item)
            if rc is not None:
                break
            if isinstance(item, Committed):
                on_checkpoint()
            elif isinstance(item, Beat):
                self.hang.beat()
                if self.hang.stepped and on_training is not None:
                    on_training()
                    on_training = None
            elif isinstance(item, Exited) and on_other_exit is not None:
                on_other_exit(item.key, item.code)
            elif isinstance(item, Stop):
                raise Stopped()
            if self.hang.remaining() <= 0:
                hang_age = self.hang.age()
                rc = self._stop_hung(hang_age)
                break
            now = time.monotonic()
            for d in duties:
                d.maybe(now)
        self.phase = Phase.EXITED
        error = read_json(self.error_record)
        if error is not None and error.get("attempt") != self.n:
            error = None  # an earlier attempt's record
        return Outcome(self.n, rc, time.time() - self.t0, hang_age, error, self.log,
                       self._oom_evidence(rc) if hang_age is None else None)

    def _exited(self, item) -> int | None:
        """The attempt's exit status when ``item`` ends it (a group waits for all, or the
        first that fails: supervise/group.py)."""
        return item.code if isinstance(item, Exited) and item.key is self.proc else None

    def _oom_evidence(self, rc: int) -> str | None:
        if rc != -signal.SIGKILL:
            return None
        beat = heartbeat.read(self.hang.run_dir) or {}
        rss = beat.get("rss") if beat.get("attempt") == self.n else None
        return oom.evidence(self._oom_before, oom.snapshot(self._cgroups), self.proc.pid, rss)

    def _stop_hung(self, age: float) -> int:
        """Stack dump of every thread into the attempt log, then SIGKILL the group at once.

        No SIGTERM grace: the worker answers SIGTERM at its next step boundary
        (train/preemption.py), which a hung main thread never reaches; measured, the grace
        added the whole ``stop_grace`` (10 s) to every hang recovery."""
        self.phase = Phase.STOPPING
        proc = self.proc
        self.journal.append(Event.HANG_DETECTED, attempt=self.n,
                            last_heartbeat_age_s=round(age, 3), timeout_s=self.hang.timeout,
                            pid=proc.pid)
        self.say(f"attempt {self.n}: no heartbeat for {age:.1f} s (limit {self.hang.timeout:g} s):"
                 f" dumping its stacks into {self.log} and stopping it")
        dump_stacks(proc.pid, self.log)
        self.stop(grace=0.0)
        return self._wait_stopped()

    def _wait_stopped(self) -> int:
        """After ``stop``: the exit status, once the process is gone."""
        while True:
            item = self.events.get()
            if isinstance(item, Exited) and item.key is self.proc:
                return item.code

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the worker's whole process group (SIGSTOP/SIGCONT: the lease)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass  # it has just exited: its exit is on the queue

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM the worker's process group, wait ``grace``, then SIGKILL what is left of it
        (data-loader processes that ignore SIGTERM too)."""
        if self.proc is not None:
            kill_group(self.proc, self.stop_grace if grace is None else grace)


# How long a spawn waits for the kernel to show the new program's command line (core/procid.py);
# it shows within a millisecond or two, the bound is for a machine under load.
SETTLE_S = 1.0


class Spawned(subprocess.Popen):
    """A process we started, with its identity taken at once (core/procid.py): journaled
    beside its pid, so that a later supervisor signals that pid only while it is still this
    process."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.identity = ProcessIdentity.of(self.pid, settle_s=SETTLE_S)


def identity_record(proc) -> dict | None:
    """What the journal keeps beside ``proc``'s pid to know it again (None: not provable)."""
    identity = getattr(proc, "identity", None)
    return identity.record() if identity is not None else None


def spawn(cmd: list[str], env: dict, cwd: str, log: str,
          stdin=subprocess.DEVNULL) -> Spawned:
    """A worker process in its own process group (so a stop reaches its data-loader children
    too), its output appended to ``log``: an attempt's, a standby's, a group's rank."""
    with open(log, "ab") as out:
        return Spawned(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=stdin,
                       start_new_session=True, env=env, cwd=cwd)


def watch_exit(proc: subprocess.Popen, events: queue.Queue, key, name: str) -> None:
    """Put ``Exited(key, status)`` on the supervisor's queue the moment ``proc`` exits."""
    threading.Thread(target=lambda: events.put(Exited(key, proc.wait())), name=name,
                     daemon=True).start()


def kill_group(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return  # the whole group is gone


def kill_orphans(events: list[dict], journal: Journal) -> None:
    """Stop what a dead supervisor left running before we start: the workers of its unfinished
    attempt (every rank of a group) and a standby it had not promoted or discarded. Each only
    if its pid is provably still the process that was started (core/procid.py): by now the pid
    may be anyone's. A pid that holds another process, or one we cannot prove, is left alone
    and journaled with why; a pid nobody holds (or a zombie) is passed
    over in silence."""
    here = os.uname().nodename
    for role, e in _left_running(events):
        pid, host = e.get("pid"), e.get("host", here)
        if not pid or (host == here and not is_running(pid)):
            continue
        where = dict(role, pid=pid)
        if host != here:
            journal.append(Event.PROCESS_LEFT_ALONE, **where, host=host,
                           reason=f"it ran on host {host}, not this one ({here})")
            continue
        why = signal_proven(ProcessIdentity.from_record(pid, e.get("identity")), signal.SIGKILL)
        if why is None:
            journal.append(Event.ORPHAN_WORKER_KILLED, **where)
        else:
            journal.append(Event.PROCESS_LEFT_ALONE, **where, reason=why)


def _left_running(events: list[dict]):
    """(what it was, its journaled record) for each process a dead supervisor may have left:
    ranks and single workers of attempts with no ``attempt_ended``, standbys with no end."""
    ended = {e["attempt"] for e in events if e["event"] == Event.ATTEMPT_ENDED}
    done = {Event.STANDBY_PROMOTED, Event.STANDBY_DISCARDED, Event.STANDBY_LOST}
    standby_done = {e.get("pid") for e in events if e["event"] in done}
    for e in events:
        if e["event"] == Event.ATTEMPT_STARTED and e["attempt"] not in ended:
            for w in e.get("workers") or [e]:
                yield {"attempt": e["attempt"], "rank": w.get("rank", 0)}, w
        elif e["event"] == Event.STANDBY_STARTED and e.get("pid") not in standby_done:
            yield {"standby_for_attempt": e.get("for_attempt")}, e

"""One attempt's mechanics: spawn its workers, wait on their events, stop them, kill their groups.

The supervisor decides *whether* and *when* to run an attempt; this module only runs it. As
torch elastic's ``WorkerGroup``, an attempt is a group of workers whether it holds one or many:
each a ``Member`` (group.py), each spawned in its own process group (so a stop reaches its
data-loader children too), waited on through one queue fed by a thread per process (the exit
is noticed at once), watchdog events (committed checkpoints, heartbeats) and periodic
``Every`` ticks. A worker that stays silent past the hang clock is dumped, stopped and
reported with its heartbeat age. What comes back is an ``Outcome``: exit status, duration,
hang age and the worker's own error record. Nothing here classifies or recovers.

Several workers fail as one (MultiWorkerMirroredStrategy cannot go on without a peer: its
health check aborts the collectives, or a survivor stays blocked in an all-reduce):

- the first rank that exits non-zero (or is lost with its Ray node) names the failure: its exit
  status, error record and log are the attempt's, classified as a single worker's would be;
- every other rank is stopped at once (its whole process group), so no survivor stays blocked;
- a hang is the slowest rank's heartbeat going silent past its timeout (hangs.py): a rank stuck
  in a collective holds the others; every rank's beat counts, heard from its file here or relayed
  through Ray from whatever node it runs on (rayengine.py), and the rank that went silent first
  is the one named;
- the group succeeds when every rank exits 0.

A group is placed by an engine (group.LocalEngine, rayengine.RayEngine) and journaled rank by
rank; one worker is spawned here, without placement, and is the one whose memory cgroup the
OOM evidence reads. The standby (standby.py) is the attempt's companion: at the start its
process may be this attempt (promoted: its exit is already on the same queue), once the worker
trains the next one is started behind it, and its own exit is told to it.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
from dataclasses import dataclass
from typing import Callable, Protocol

from orchestrator.core import heartbeat
from orchestrator.core.events import Event
from orchestrator.core.osutil import read_json
from orchestrator.core.rundir import RunDir, rank_dir
from orchestrator.core.spec import JobSpec
from orchestrator.recovery import oom
from orchestrator.recovery.failures import signal_name
from orchestrator.supervise.group import (STACK_DUMP_WAIT_S, Engine, EngineUnavailable,
                                         Member, first_failed)
from orchestrator.supervise.hangs import dump_stacks
from orchestrator.supervise.messages import Beat, Committed, Exited, Stop, Tick

log = logging.getLogger(__name__)


class Stopped(Exception):
    """The supervisor was asked to stop (SIGTERM, SIGINT or KeyboardInterrupt)."""


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

    def arm(self, now: float) -> None:
        self.due = now + self.period

    def maybe(self, now: float) -> None:
        if now >= self.due:
            self.run()
            self.due = now + self.period


class AttemptListener(Protocol):
    """Who hears an attempt's life besides the supervisor (the standby keeper, standby.py):
    told, never asked, so that the attempt's wait holds no one else's rules."""

    def promote(self, n: int, env: dict):
        """(a process that may be attempt ``n``, how it started) or (None, why it is cold)."""

    def on_training(self, n: int) -> None:
        """Attempt ``n`` made its first training step (its start-up is over)."""

    def on_commit(self, n: int) -> None:
        """A checkpoint was committed while attempt ``n`` trains."""

    def on_exit(self, key, code: int, n: int) -> None:
        """A process on the queue that is none of attempt ``n``'s members exited."""


class Attempt:
    def __init__(self, n: int, cmd: list[str], env: dict, *, spec: JobSpec, rd: RunDir, slot,
                 journal, standby: AttemptListener, engine: Engine, group: bool = False):
        """Attempt ``n`` of ``spec``'s run: ``cmd`` in ``env`` for each worker. ``slot``: the
        worker slot (its queue, its hang clock, its clock); ``engine``: who runs the workers;
        ``group``: several ranks placed by it (else one worker, not placed); ``standby``: the
        listener told of the attempt's life, whose process may be it."""
        self.n, self.cmd, self.env, self.rd = n, cmd, env, rd
        self.cwd, self.stop_grace = spec.job_dir, spec.stop_grace
        self.events, self.hang, self.journal = slot.events, slot.hang, journal
        self.clock = slot.clock
        self.group, self.engine = group, engine
        self.size = spec.workers if self.group else 1
        self.standby = standby
        self.log, self.error_record = rd.attempt_log(n), rd.error_record(n)
        self.members: list[Member] = []
        self.failed: Member | None = None
        self.proc: subprocess.Popen | None = None  # rank 0's process, where it runs here
        self.t0 = 0.0
        self._cgroups: list = []
        self._oom_before: dict = {}
        self._training = False  # a training step done: the listener was told

    # ------------------------------------------------------------------ start
    def start(self, from_epoch: Callable[[], int]) -> None:
        """Its workers running: the standby's process when it may be this attempt, else new
        ones (a group's placed by its engine). ``attempt_started`` says which (``path``: the
        promoted standby's mode, or ``cold`` and why) and, asked once they run, the epoch they
        resume from."""
        self.t0 = self.clock.time()
        promoted, path = self.standby.promote(self.n, self.env)
        if promoted is not None:  # its exit is on the queue already, keyed by it
            promoted.log, promoted.error_record = self.log, self.error_record
            self.members = [promoted]
        elif self.group:
            places = self._place()
            cluster = {"worker": [addr for _, addr in places]}
            for rank, (host, _) in enumerate(places):
                m = Member(rank, host, self.rd.attempt_log(self.n, rank),
                           self.rd.error_record(self.n, rank), control=self.rd.for_rank(rank))
                env = dict(self.env, TF_CONFIG=json.dumps(
                    {"cluster": cluster, "task": {"type": "worker", "index": rank}}))
                self.engine.spawn(m, self.cmd, env, self.cwd, self.events)
                self.members.append(m)
        else:
            m = Member(0, os.uname().nodename, self.log, self.error_record)
            self.engine.spawn(m, self.cmd, self.env, self.cwd, self.events)
            self.members = [m]
        self._running(from_epoch, path)

    def _place(self) -> list[tuple[str, str]]:
        """The engine places the ranks; the wait is journaled before (with its bound) and
        after (how long it took, or why it failed), so that a wait for resources is seen."""
        where = dict(attempt=self.n, engine=self.engine.name, workers=self.size)
        self.journal.append(Event.GROUP_PLACING, **where,
                            timeout_s=self.engine.placement_timeout())
        t0 = self.clock.monotonic()
        try:
            places = self.engine.open(self.size)
        except EngineUnavailable as exc:
            self.journal.append(Event.GROUP_PLACED, **where, placed=False,
                                wait_s=round(self.clock.monotonic() - t0, 3), reason=str(exc))
            raise
        self.journal.append(Event.GROUP_PLACED, **where, placed=True,
                            wait_s=round(self.clock.monotonic() - t0, 3),
                            hosts=[host for host, _ in places],
                            addresses=[address for _, address in places])
        return places

    def _running(self, from_epoch: Callable[[], int], path: dict | None) -> None:
        chief = self.members[0]
        self.proc = chief.handle if isinstance(chief.handle, subprocess.Popen) else None
        if not self.group and chief.pid is not None:  # a rank's is its node's: not read here
            self._cgroups = oom.memory_cgroups(chief.pid)
            self._oom_before = oom.snapshot(self._cgroups)
        self.hang.start(self.n, len(self.members))
        ranks = dict(engine=self.engine.name,
                     workers=[m.describe(identity=True) for m in self.members]) \
            if self.group else {}
        self.journal.append(Event.ATTEMPT_STARTED, attempt=self.n, pid=chief.pid,
                            host=chief.host, identity=chief.identity, from_epoch=from_epoch(),
                            log=self.log, **ranks, **(path or {}))

    # ------------------------------------------------------------------ wait
    def wait(self, on_checkpoint: Callable[[], None], duties: list[Every],
             on_commits: Callable[[list], None] | None = None) -> Outcome:
        """Until the workers exit (or are stopped as hung). Raises ``Stopped`` on a stop.
        The listener (``standby``) hears the first heartbeat after a training step (the
        worker's start-up and first-step tracing are over), each commit after it, and the exit
        of any process on the queue that is not a member. ``on_checkpoint``: a watched folder
        saw a commit; ``on_commits(commits)``: a beat of this attempt, with the commits its
        rank told of (core/heartbeat.py; none, often: the ledger tries what still waits)."""
        for d in duties:
            d.arm(self.clock.monotonic())
        hang_age, self._training = None, False
        while True:
            item = self._next(duties)
            rc = self._exited(item)
            if rc is not None:
                break
            self._hear(item, on_checkpoint, on_commits)
            if self.hang.remaining() <= 0:
                hang_age = self.hang.age()
                rc = self._stop_hung(hang_age)
                break
            now = self.clock.monotonic()
            for d in duties:
                d.maybe(now)
        return self._outcome(rc, hang_age)

    def _next(self, duties: list[Every]):
        """The next item on the queue, or a ``Tick`` when a duty or the hang clock is due."""
        now = self.clock.monotonic()
        due = min([d.due for d in duties], default=now + 60.0)
        try:
            return self.events.get(timeout=max(0.0, min(due - now, self.hang.remaining())))
        except queue.Empty:
            return Tick()

    def _hear(self, item, on_checkpoint: Callable[[], None],
              on_commits: Callable[[list], None] | None) -> None:
        """What an item that does not end the attempt means: a commit, a beat, a stranger's
        exit (the listener's to hear), a stop."""
        if isinstance(item, Committed):
            on_checkpoint()
            if self._training:
                self.standby.on_commit(self.n)
        elif isinstance(item, Beat):
            record = item.record if item.record is not None else \
                heartbeat.read(rank_dir(self.hang.run_dir, item.rank))
            self.hang.beat(item.rank, record)
            if on_commits is not None and record and record.get("attempt") == self.n:
                on_commits(record.get("commits") or [])
            if self.hang.stepped and not self._training:
                self._training = True
                self.standby.on_training(self.n)
        elif isinstance(item, Exited):
            self.standby.on_exit(item.key, item.code, self.n)
        elif isinstance(item, Stop):
            raise Stopped()

    def _outcome(self, rc: int, hang_age: float | None) -> Outcome:
        error = read_json(self.error_record)
        if error is not None and error.get("attempt") != self.n:
            error = None  # an earlier attempt's record
        return Outcome(self.n, rc, self.clock.time() - self.t0, hang_age, error, self.log,
                       self._oom_evidence(rc) if hang_age is None else None)

    def _member(self, item) -> Member | None:
        """The member whose exit ``item`` is (a promoted standby's is keyed by its process)."""
        if isinstance(item, Exited):
            return next((m for m in self.members if item.key is m or item.key is m.handle),
                        None)
        return None

    def _exited(self, item) -> int | None:
        """The attempt's exit status when ``item`` ends it: the first member that fails (the
        others are stopped), or the last to exit."""
        m = self._member(item)
        if m is None:
            return None
        m.exit_code, m.exited_at = item.code, item.at
        if m.exit_code != 0 and self.failed is None:
            running = [x for x in self.members if x.exit_code is None]
            stopped_at = self.clock.time()
            self.stop(grace=0.0)
            self._wait_stopped()
            self.failed = f = first_failed(m, running, stopped_at)
            self.log, self.error_record = f.log, f.error_record  # the group's failure
            if self.group:
                more = {"lost": f.info["lost"]} if f.info.get("lost") else {}
                also = [x.rank for x in [m, *running] if x is not f and x.exit_code and (
                    x is m or x.exited_at is not None and x.exited_at < stopped_at)]
                if also:  # ranks whose own failure came after f's (a collective it broke)
                    more["also_failed"] = also
                self.journal.append(Event.GROUP_MEMBER_FAILED, attempt=self.n, rank=f.rank,
                                    exit_code=f.exit_code, host=f.host, node=f.node,
                                    stopping=[x.rank for x in running if x is not f], **more)
                self._node_lost(f)
            return f.exit_code
        if all(x.exit_code is not None for x in self.members):
            return next((x.exit_code for x in self.members if x.exit_code), 0)
        return None

    def _node_lost(self, m: Member) -> None:
        """A rank whose node left the cluster (the engine says so: ``info['node_lost']``):
        journal the node and every rank it took; the group restarts as after any failure, and
        its next placement waits for capacity within the engine's bound."""
        lost = m.info.get("node_lost")
        if not lost:
            return
        ranks = [x.rank for x in self.members if x.node == m.node]
        self.journal.append(Event.NODE_LOST, attempt=self.n, engine=self.engine.name,
                            ranks=ranks, reason=m.info.get("lost"), **lost)
        bound = self.engine.placement_timeout()
        log.info(f"attempt {self.n}: node {lost['node']} left the cluster with rank(s) "
                 f"{', '.join(map(str, ranks))}: stopping the group; the next one waits for "
                 f"capacity" + (f" up to {bound:.0f} s" if bound is not None else ""))

    def _wait_stopped(self) -> int:
        """After ``stop``: the exit status, once every member is gone."""
        while any(x.exit_code is None for x in self.members):
            item = self.events.get()
            m = self._member(item)
            if m is not None:
                m.exit_code, m.exited_at = item.code, item.at
        rcs = [m.exit_code for m in self.members]
        return self.failed.exit_code if self.failed else next((rc for rc in rcs if rc), 0)

    def _oom_evidence(self, rc: int) -> str | None:
        if self.group or rc != -signal.SIGKILL:
            return None
        beat = heartbeat.read(self.hang.run_dir) or {}
        rss = beat.get("rss") if beat.get("attempt") == self.n else None
        pid = self.members[0].pid
        return oom.evidence(self._oom_before, oom.snapshot(self._cgroups), pid, rss)

    def _stop_hung(self, age: float) -> int:
        """Stack dumps into the logs, then SIGKILL every group at once: one worker's dump is
        awaited in its log; a group's ranks (rank 0 silent) each dump into their own log,
        which shows the rank that is stuck.

        No SIGTERM grace: the worker answers SIGTERM at its next step boundary
        (train/preemption.py), which a hung main thread never reaches; measured, the grace
        added the whole ``stop_grace`` (10 s) to every hang recovery."""
        silent = self.hang.silent()
        chief = next((m for m in self.members if m.rank == silent), self.members[0])
        self.log, self.error_record = chief.log, chief.error_record
        ranks = dict(workers=[m.describe() for m in self.members], rank=silent,
                     heartbeat_ages_s=self.hang.ages()) if self.group else {}
        self.journal.append(Event.HANG_DETECTED, attempt=self.n,
                            last_heartbeat_age_s=round(age, 3), timeout_s=self.hang.timeout,
                            pid=chief.pid, **ranks)
        if self.group:
            log.info(f"attempt {self.n}: no heartbeat from rank {silent} "
                     f"({chief.node or chief.host}) for {age:.1f} s (limit "
                     f"{self.hang.timeout:g} s): dumping every rank's stacks into its log and "
                     f"stopping the group")
            self.signal(heartbeat.STACK_DUMP_SIGNAL)
            self.clock.sleep(STACK_DUMP_WAIT_S)
        else:
            log.info(f"attempt {self.n}: no heartbeat for {age:.1f} s (limit "
                     f"{self.hang.timeout:g} s): dumping its stacks into {self.log} and "
                     f"stopping it")
            dump_stacks(chief.pid, self.log, clock=self.clock)
        self.stop(grace=0.0)
        return self._wait_stopped()

    # ------------------------------------------------------------------ signals
    def signal(self, sig: int) -> None:
        """Send ``sig`` to every live worker's process group (SIGSTOP/SIGCONT: the lease)."""
        for m in self.members:
            if m.exit_code is None:
                self.engine.signal(m, sig)

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every live worker's process group, wait ``grace``, then SIGKILL what is
        left of it (data-loader processes that ignore SIGTERM too)."""
        g = self.stop_grace if grace is None else grace
        for m in self.members:
            if m.exit_code is None:
                self.engine.kill(m, g)

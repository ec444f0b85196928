"""Several workers as one attempt: placed, given ``TF_CONFIG``, watched and stopped together.

MultiWorkerMirroredStrategy cannot go on without a peer: its health check aborts the
collectives with ``UnavailableError`` ("required to restart in order to recover"), and a
survivor may instead stay blocked in an all-reduce. So the group fails as one:

- the first rank that exits non-zero (or is lost with its Ray node) names the failure: its exit
  status, error record and log are the attempt's, and the policy classifies it as it would a
  single worker's (the failed worker's kind becomes the group's);
- every other rank is stopped at once (its whole process group), so no survivor stays blocked;
- a hang is rank 0's heartbeat going silent: a rank stuck in a collective stalls rank 0's step
  too, and a stuck rank 0 is itself silent;
- the group succeeds when every rank exits 0.

Placement is an engine's: ``LocalEngine`` runs the ranks as processes here with a loopback
``TF_CONFIG`` (tests, one large host); ``rayengine.RayEngine`` has Ray place them. Every rank
restores the step the supervisor names (``ENV_RESTORE_STEP``): it must be in a tier every rank
can read, which for ranks on other nodes means the run directory (the worker says so clearly
when it cannot see it).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field

from orchestrator.core import heartbeat
from orchestrator.core.events import Event
from orchestrator.core.rundir import RunDir
from orchestrator.supervise.attempt import (Attempt, Phase, identity_record, kill_group, spawn,
                                             watch_exit)
from orchestrator.supervise.messages import Exited


class EngineUnavailable(RuntimeError):
    """The engine that places a group's workers cannot be used (not installed, unreachable,
    not enough resources)."""


# faulthandler writes a dump in milliseconds; the wait bounds it for ranks on other nodes too
STACK_DUMP_WAIT_S = 1.0


@dataclass(eq=False)
class Member:
    """One rank of a group: where it runs and how to reach it."""

    rank: int
    host: str
    log: str
    error_record: str
    pid: int | None = None
    handle: object = None       # a Popen (local) or a Ray actor handle (ray)
    exit_code: int | None = None
    info: dict = field(default_factory=dict)
    identity: dict | None = None  # taken where it was spawned (core/procid.py), as journaled

    def describe(self, identity: bool = False) -> dict:
        """Where it runs; with ``identity``, what a later supervisor needs to know its pid
        again (``attempt_started``)."""
        d = {"rank": self.rank, "pid": self.pid, "host": self.host}
        return dict(d, identity=self.identity) if identity else d


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the worker binds it a second later; on loopback in tests
    and on a dedicated host nothing else takes it in between)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalEngine:
    """The ranks as processes on this machine, each in its own process group."""

    name = "local"

    @staticmethod
    def placement_timeout() -> None:
        """Placing processes here does not wait for anything."""
        return None

    def open(self, size: int) -> list[tuple[str, str]]:
        """(host name, host:port for TF_CONFIG) of each rank."""
        return [(os.uname().nodename, f"127.0.0.1:{free_port()}") for _ in range(size)]

    def spawn(self, m: Member, cmd: list[str], env: dict, cwd: str, events) -> None:
        proc = spawn(cmd, env, cwd, m.log)
        m.handle, m.pid, m.identity = proc, proc.pid, identity_record(proc)
        watch_exit(proc, events, m, f"wait-rank-{m.rank}")

    def signal(self, m: Member, sig: int) -> None:
        try:
            os.killpg(m.pid, sig)
        except ProcessLookupError:
            pass  # already gone: its exit is on the queue

    def kill(self, m: Member, grace: float) -> None:
        kill_group(m.handle, grace)

    def close(self) -> None:
        """Nothing is held between attempts."""


class GroupAttempt(Attempt):
    def __init__(self, *args, engine, size: int, rd: RunDir, **kw):
        super().__init__(*args, **kw)
        self.engine, self.size, self.rd = engine, size, rd
        self.members: list[Member] = []
        self.failed: Member | None = None

    def start(self, from_epoch: int, path: dict | None = None) -> None:
        self.t0 = time.time()
        places = self._place()
        cluster = {"worker": [addr for _, addr in places]}
        for rank, (host, _) in enumerate(places):
            m = Member(rank, host, self.rd.attempt_log(self.n, rank),
                       self.rd.error_record(self.n, rank))
            env = dict(self.env, TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": rank}}))
            self.engine.spawn(m, self.cmd, env, self.cwd, self.events)
            self.members.append(m)
        chief = self.members[0]
        self.proc = chief.handle if isinstance(chief.handle, subprocess.Popen) else None
        self._cgroups, self._oom_before = [], {}
        self.phase = Phase.RUNNING
        self.hang.start(self.n)
        self.journal.append(Event.ATTEMPT_STARTED, attempt=self.n, pid=chief.pid,
                            host=chief.host, from_epoch=from_epoch, log=self.log,
                            engine=self.engine.name, identity=chief.identity,
                            workers=[m.describe(identity=True) for m in self.members],
                            **(path or {}))

    def _place(self) -> list[tuple[str, str]]:
        """The engine places the ranks; the wait is journaled before (with its bound) and
        after (how long it took, or why it failed), so that a wait for resources is seen."""
        where = dict(attempt=self.n, engine=self.engine.name, workers=self.size)
        self.journal.append(Event.GROUP_PLACING, **where,
                            timeout_s=self.engine.placement_timeout())
        t0 = time.monotonic()
        try:
            places = self.engine.open(self.size)
        except EngineUnavailable as exc:
            self.journal.append(Event.GROUP_PLACED, **where, placed=False,
                                wait_s=round(time.monotonic() - t0, 3), reason=str(exc))
            raise
        self.journal.append(Event.GROUP_PLACED, **where, placed=True,
                            wait_s=round(time.monotonic() - t0, 3),
                            hosts=[host for host, _ in places],
                            addresses=[address for _, address in places])
        return places

    def _exited(self, item) -> int | None:
        if not isinstance(item, Exited) or item.key not in self.members:
            return None
        m, rc = item.key, item.code
        m.exit_code = rc
        if rc != 0 and self.failed is None:
            self.failed = m
            self.log, self.error_record = m.log, m.error_record  # the group's failure
            self.journal.append(Event.GROUP_MEMBER_FAILED, attempt=self.n, rank=m.rank,
                                exit_code=rc, host=m.host,
                                stopping=[x.rank for x in self.members if x.exit_code is None])
            self.stop(grace=0.0)
            self._wait_stopped()
            return rc
        if all(x.exit_code is not None for x in self.members):
            return next((x.exit_code for x in self.members if x.exit_code), 0)
        return None

    def _wait_stopped(self) -> int:
        while any(x.exit_code is None for x in self.members):
            item = self.events.get()
            if isinstance(item, Exited) and item.key in self.members:
                item.key.exit_code = item.code
        rcs = [m.exit_code for m in self.members]
        return self.failed.exit_code if self.failed else next((rc for rc in rcs if rc), 0)

    def _stop_hung(self, age: float) -> int:
        """Rank 0 silent: every rank dumps its stacks into its own log (which rank is stuck
        shows there), then the whole group is killed."""
        self.phase = Phase.STOPPING
        chief = self.members[0]
        self.log, self.error_record = chief.log, chief.error_record
        self.journal.append(Event.HANG_DETECTED, attempt=self.n,
                            last_heartbeat_age_s=round(age, 3), timeout_s=self.hang.timeout,
                            pid=chief.pid, workers=[m.describe() for m in self.members])
        self.say(f"attempt {self.n}: no heartbeat from rank 0 for {age:.1f} s (limit "
                 f"{self.hang.timeout:g} s): dumping every rank's stacks into its log and "
                 f"stopping the group")
        self.signal(heartbeat.STACK_DUMP_SIGNAL)
        time.sleep(STACK_DUMP_WAIT_S)
        self.stop(grace=0.0)
        return self._wait_stopped()

    def _oom_evidence(self, rc: int) -> str | None:
        return None  # a rank's memory cgroup is its node's: not read from here

    def stop(self, grace: float | None = None) -> None:
        g = self.stop_grace if grace is None else grace
        for m in self.members:
            if m.exit_code is None:
                self.engine.kill(m, g)

    def signal(self, sig: int) -> None:
        for m in self.members:
            if m.exit_code is None:
                self.engine.signal(m, sig)

"""Where an attempt's workers run: a member per worker, and the engines that place a group.

An attempt (attempt.py) is a group of ``Member``s, one or many. One worker is spawned here by
``LocalEngine`` without placement. Several are placed by an engine: ``LocalEngine`` runs the
ranks as processes here with a loopback ``TF_CONFIG`` (tests, one large host);
``rayengine.RayEngine`` has Ray place them. An engine spawns, signals and kills a member; how
a group fails as one is the attempt's. Every rank restores the step the supervisor names
(``ENV_RESTORE_STEP``): it must be in a tier every rank can read, which for ranks on other
nodes means the run directory (the worker says so clearly when it cannot see it).
"""
from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Protocol

from orchestrator.core.osutil import read_json
from orchestrator.supervise.procs import identity_record, kill_group, spawn, watch_exit


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
    exited_at: float | None = None  # when, where it ran (messages.Exited.at)
    info: dict = field(default_factory=dict)
    identity: dict | None = None  # taken where it was spawned (core/procid.py), as journaled
    control: str | None = None  # its control folder here (RunDir.for_rank): relayed state
    node: str | None = None     # the engine's name for its node (Ray: the node's address)
    pipe: bool = False          # a standby's: its promotion line comes on its stdin

    def describe(self, identity: bool = False) -> dict:
        """Where it runs; with ``identity``, what a later supervisor needs to know its pid
        again (``attempt_started``)."""
        d = {"rank": self.rank, "pid": self.pid, "host": self.host}
        if self.node:
            d["node"] = self.node
        return dict(d, identity=self.identity) if identity else d


def first_failed(heard: Member, running: list[Member], stopped_at: float) -> Member:
    """The rank whose failure is the group's: of those that exited non-zero on their own, the
    first to exit where it ran. ``heard`` is the first failure the supervisor heard of;
    ``running``, the ranks not heard of then, which it stopped at ``stopped_at``. One of those
    that had exited non-zero before the stop (by its node's clock) failed on its own, and the
    earlier exit is the cause: a rank that leaves breaks its peers' collectives (JAX's gloo
    raises in them within milliseconds), and Ray tells the exits of ranks on different nodes in
    its own order, not theirs. An exit of unknown time (an actor dead with its node) keeps the
    order heard."""
    if heard.exited_at is None:
        return heard
    before = [x for x in running if x.exit_code and x.exited_at is not None
              and x.exited_at < stopped_at]
    return min([heard, *before], key=failed_at)


def failed_at(m: Member) -> float:
    """When a rank's failure happened: its error record's time, written as it raised, else its
    exit. Beside two busy loops a JAX rank that raised took longer to exit (its record, its
    teardown) than the peer whose collective it broke: by exits, the peer's error came first."""
    record = read_json(m.error_record) if m.error_record else None
    t = record.get("time") if isinstance(record, dict) else None
    return float(t) if isinstance(t, (int, float)) else m.exited_at


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the worker binds it a second later; on loopback in tests
    and on a dedicated host nothing else takes it in between)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Engine(Protocol):
    """Who runs an attempt's workers: the supervisor is given one (``LocalEngine`` here,
    ``rayengine.RayEngine``, the tests' ``FakeEngine``) and never starts a worker itself. Each
    member's exit reaches the attempt as ``messages.Exited(member, code, at)`` on ``events``;
    its beats and commits come as ``Beat`` and ``Committed`` on the same queue."""

    name: str

    def placement_timeout(self) -> float | None:
        """How long ``open`` may wait for resources (None: it never waits)."""

    def open(self, size: int) -> list[tuple[str, str]]:
        """Place ``size`` ranks: (host name, host:port for TF_CONFIG) of each."""

    def spawn(self, m: Member, cmd: list[str], env: dict, cwd: str, events) -> None:
        """Start ``m``'s worker; fill in its pid, handle and identity."""

    def signal(self, m: Member, sig: int) -> None:
        """``sig`` to ``m``'s process group (the lease's SIGSTOP/SIGCONT, a stack dump)."""

    def kill(self, m: Member, grace: float) -> None:
        """SIGTERM, ``grace`` seconds, then SIGKILL to ``m``'s process group."""

    def gather(self, timeout: float) -> dict | None:
        """Before a group is placed again: what only the last chief's node held, made
        readable here (None: nothing to gather)."""

    def close(self) -> None:
        """Release what is held between attempts."""


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
        proc = spawn(cmd, env, cwd, m.log,
                     stdin=subprocess.PIPE if m.pipe else subprocess.DEVNULL)
        m.handle, m.pid, m.identity = proc, proc.pid, identity_record(proc)
        watch_exit(proc, events, m, "wait-standby" if m.pipe else f"wait-rank-{m.rank}")

    def signal(self, m: Member, sig: int) -> None:
        try:
            os.killpg(m.pid, sig)
        except ProcessLookupError:
            pass  # already gone: its exit is on the queue

    def kill(self, m: Member, grace: float) -> None:
        kill_group(m.handle, grace)

    @staticmethod
    def gather(timeout: float) -> None:
        """Every rank's checkpoints are in this machine's tiers already."""
        return None

    def close(self) -> None:
        """Nothing is held between attempts."""

"""Ownership of a run directory: one supervisor at a time.

A ``lock`` file names the owner (host, pid and its identity, start, last refresh). It is
created with ``O_EXCL``. A lock whose owner is dead (same host and boot, and the pid no longer
the process that wrote it: core/procid.py, as a pid alone may be reused by anyone) or silent for
longer than ``stale_after`` seconds (another host or boot, e.g. a recycled Colab VM that left it
on Drive) is stale and is taken over: it is first renamed aside, which only one contender can
do, then created anew.

The takeover rule when the run directory (Drive) goes away while a supervisor trains: the lock
is refreshed every ``Lease.refresh_s``; a supervisor that could not refresh it for
``Lease.lease_s`` (three quarters of ``stale_after``) pauses its worker, because from
``stale_after`` on another VM may take the lock over and start training from the durable
checkpoints - two trainers must never write one run. When the run directory answers again the
lock is read before it is written: still ours, the worker goes on; someone else's
(``LockLost``), this supervisor stops and writes nothing more to the run directory.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid

from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.core.osutil import pid_alive, read_json, write_json_atomic
from orchestrator.core.procid import ProcessIdentity, boot_id

log = logging.getLogger(__name__)

FILE = "lock"


class LockedError(Exception):
    """Another live supervisor owns the run directory."""


class LockLost(Exception):
    """Another supervisor holds the lock now: ours went stale while we could not refresh it."""

    def __init__(self, current: dict):
        super().__init__(f"the run directory was taken over by pid {current.get('pid')} on "
                         f"host {current.get('host')}")
        self.current = current


class Lease:
    """How long an unrefreshed lock may still be trusted (see the module's takeover rule)."""

    def __init__(self, stale_after: float, clock: Clock = SYSTEM):
        self.stale_after, self.clock = stale_after, clock
        self.refresh_s = min(5.0, stale_after / 8)
        self.lease_s = 0.75 * stale_after  # leaves a quarter for a paused worker to stop
        self.refreshed = clock.monotonic()

    def renewed(self) -> None:
        self.refreshed = self.clock.monotonic()

    def due(self) -> bool:
        return self.clock.monotonic() - self.refreshed >= self.refresh_s

    def expired(self) -> bool:
        return self.clock.monotonic() - self.refreshed >= self.lease_s


class RunLock:
    def __init__(self, run_dir: str, stale_after: float = 120.0):
        self.path = os.path.join(run_dir, FILE)
        self.stale_after = stale_after
        me = ProcessIdentity.of(os.getpid())
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(),
                      "identity": me.record() if me else None,
                      "started": round(time.time(), 3), "token": uuid.uuid4().hex}
        self.held = False

    def acquire(self) -> dict | None:
        """Take the lock; return the stale owner taken over from, or None. Raises LockedError."""
        taken_from = None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                current = read_json(self.path)
                reason = self.stale_reason(current)
                if reason is None:
                    o = current or {}
                    age = time.time() - float(o.get("refreshed", o.get("started", 0)) or 0)
                    raise LockedError(
                        f"{os.path.dirname(self.path)} is in use by another supervisor "
                        f"(pid {o.get('pid')} on host {o.get('host')}, last seen {age:.0f} s "
                        f"ago). Stop it first, or wait {self.stale_after:.0f} s after it died "
                        f"for the lock to go stale.") from None
                aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(self.path, aside)
                except FileNotFoundError:
                    continue  # someone else moved it; try again
                os.remove(aside)
                taken_from = dict(current or {}, reason=reason)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(dict(self.owner, refreshed=self.owner["started"]), f)
            self.held = True
            return taken_from
        raise LockedError(f"{self.path}: could not take the lock (contended)")

    def refresh(self) -> OSError | None:
        """Renew the lock; the error when the run directory cannot be written (a Drive mount
        gone for a while must not kill the supervisor: the caller reports it, once). Raises
        ``LockLost`` when another supervisor's token is in the file; a missing file (a run
        directory restored without it) is written anew."""
        if self.held:
            current = read_json(self.path)
            if current and current.get("token") != self.owner["token"]:
                self.held = False
                raise LockLost(current)
            try:
                write_json_atomic(self.path, dict(self.owner, refreshed=round(time.time(), 3)),
                                  durable=False)
            except OSError as exc:
                return exc
        return None

    def release(self) -> None:
        if not self.held:
            return
        current = read_json(self.path) or {}
        self.held = False
        if current.get("token") == self.owner["token"]:
            try:
                os.remove(self.path)
            except OSError as exc:  # the run directory is down: the lock goes stale by itself
                log.warning(f"could not remove the lock {self.path} ({exc}); it is stale "
                            f"{self.stale_after:.0f} s after this supervisor's last refresh")

    def stale_reason(self, current: dict | None) -> str | None:
        """Why the lock ``current`` may be taken over, or None while its owner lives."""
        if not current:
            try:  # an owner may be between creating the file and writing it
                fresh = time.time() - os.path.getmtime(self.path) < 5
            except OSError:
                fresh = False
            return None if fresh else "lock file unreadable"
        pid = int(current.get("pid", 0) or 0)
        owner = ProcessIdentity.from_record(pid, current.get("identity"))
        same_host = current.get("host") == socket.gethostname()
        if same_host and (owner is None or owner.boot_id == boot_id()):
            if owner is not None:  # this machine, this boot: the pid decides, if it is his
                why = owner.differs()
                return None if why is None else f"owner {why}"
            if pid and not pid_alive(pid):  # a lock of an older version: the pid alone
                return f"owner pid {pid} is not running"
            return None
        age = time.time() - float(current.get("refreshed", 0) or 0)
        if age > self.stale_after:
            other = " (another boot, or another machine of that name)" if same_host else ""
            return f"owner on host {current.get('host')}{other} silent for {age:.0f} s"
        return None

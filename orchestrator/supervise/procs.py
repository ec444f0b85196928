"""The supervisor's processes: spawned in a group of their own, their exit on the queue, killed
as a group, and what a dead supervisor left running, stopped only when provably still ours.

Shared by an attempt's workers (attempt.py), a group's ranks on this machine (group.py) and on
Ray's nodes (rayengine.py), and the standby (standby.py): one way to start a process here.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time

from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.procid import ProcessIdentity, is_running, signal_proven
from orchestrator.supervise.messages import Exited

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
    def wait() -> None:
        code = proc.wait()
        events.put(Exited(key, code, time.time()))

    threading.Thread(target=wait, name=name, daemon=True).start()


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

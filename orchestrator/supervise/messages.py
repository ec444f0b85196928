"""What the supervisor's threads tell its loop, on its one queue, each a type of its own.

The loop waits on one queue (never polling): a worker's exit (a thread per process,
attempt.watch_exit; Ray's in rayengine.py), a heartbeat written (a watchdog event, hangs.py, or
relayed; a commit rides on it), a checkpoint committed (the checkpoint folder's watchdog event,
or a durable copy relayed from a rank's node) and a stop (a signal, or a lock
lost). A type per message, matched with ``isinstance``, instead of tuples read by position: a
message that gains a field, or a misspelt kind, is then an error where it is made, not an item
that no branch of the loop matches.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class Exited:
    """A process the supervisor started exited: ``key`` is what it was started as (the
    attempt's Popen, a group's Member, a standby's Popen), ``code`` its exit status, ``at``
    when it exited, seen where it ran (None: not known, its Ray actor died with it). The exits
    of a group reach the queue in the order their engine tells them, which on Ray is not the
    order the ranks exited in (attempt.py orders a group's failures by ``at``)."""

    key: object
    code: int
    at: float | None = None


@dataclass(frozen=True, eq=False)
class Beat:
    """Rank ``rank``'s heartbeat: its ``heartbeat.json`` was replaced here (``record`` None:
    the hang clock reads the file), or its beat was relayed through Ray from the node it runs on
    (``record``: the beat itself, read there)."""

    rank: int = 0
    record: dict | None = None


@dataclass(frozen=True)
class Committed:
    """A checkpoint's commit marker appeared at ``path`` (a watched folder's event), or a
    durable copy was made on a rank's node (relayed, relay.py): the ledger scans the store."""

    path: str


@dataclass(frozen=True)
class Stop:
    """Stop the run: the supervisor's own SIGTERM/SIGINT, or its lock lost."""


@dataclass(frozen=True)
class Tick:
    """Nothing arrived before the wait's timeout: a duty is due, or the hang clock ran out."""

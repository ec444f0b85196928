"""The journal's epoch and checkpoint events, derived from committed checkpoints.

The worker commits checkpoints to the local tier and the durable mirror (a thread of the
supervisor, or of the chief's Ray actor on its node) copies them to the run directory; either
process may die at any moment. So the supervisor journals ``epoch_completed`` and
``checkpoint_committed`` from what is committed in a tier it reads and verifies, not from what
the worker says, and each exactly once: the ledger remembers what the journal already holds
(``recall``, ``steps``).

It hears of a commit two ways. The rank that committed says so with its heartbeat, wherever it
runs (``heard``: step, epoch, path and the commit's digest, relayed through Ray from another
node): the commit is journaled as soon as a copy the supervisor reads verifies and has that
digest (the chief's local tier on another node is not readable here: its durable copy is, once
made; until then the commit waits in ``pending``, tried again at every beat and every scan). A
copy with another digest is not that commit (a stale copy of the same step) and is refused.
And the tiers are scanned (``scan``) on a watched folder's event, before a group is placed and
at each attempt's end: the safety net for a beat that never came. A new checkpoint is the run's
progress: ``on_progress`` tells the recovery policy.
"""
from __future__ import annotations

import logging
from typing import Callable

from orchestrator.checkpoint.store import Checkpoint
from orchestrator.checkpoint.tiers import TieredStore
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal

log = logging.getLogger(__name__)
_UNREAD = object()  # the ledger's newest checkpoint, not read from the tiers yet


class CheckpointLedger:
    def __init__(self, store: TieredStore, journal: Journal, console,
                 on_progress: Callable[[], None], on_scanned: Callable[[], None]):
        self.store, self.journal, self.console = store, journal, console
        self.on_progress, self.on_scanned = on_progress, on_scanned
        self.epochs: set[int] = set()
        self.steps: set[int] = set()
        self.pending: dict[int, dict] = {}  # step -> a commit heard of, no verified copy yet
        self._refused: set[tuple[int, str]] = set()  # (step, digest of the copy) said once
        self._newest: Checkpoint | None | object = _UNREAD  # the newest verified: _known()
        self._read = False  # _newest is as last read from the tiers (not from a commit)
        self._recheck = False  # an attempt ended since _newest was verified

    def recall(self, events: list[dict]) -> None:
        """What earlier sessions journaled already."""
        self.epochs = {e["epoch"] for e in events if e["event"] == Event.EPOCH_COMPLETED}
        self.steps = {e["step"] for e in events if e["event"] == Event.CHECKPOINT_COMMITTED}

    def scan(self) -> None:
        """Journal every committed checkpoint (either tier) and the epochs it covers, each
        exactly once, then wake the durable mirror."""
        copies = self.store.copies()
        self._settle(copies)
        for step, cs in sorted(copies.items()):
            if step in self.steps:
                continue
            c = next((c for c in cs if self.store.local.verify(c.path, cached=True) is None),
                     None)
            if c is None:
                continue  # not (yet) intact; a later scan or the restore will judge it
            self._journal(c)
            self.on_progress()  # the run moves: failures before this are not a loop
        self.on_scanned()

    def attempt_ended(self) -> None:
        """The safety net at an attempt's end: ``scan``; what was heard of and never proven
        here is the scans' from now on (the group's restore gathers it, if it can)."""
        self.scan()
        self.pending.clear()
        self._recheck = True

    def heard(self, commits: list[dict]) -> None:
        """Commits a rank told of with its beat (core/heartbeat.py: each ``{step, epoch,
        path, digest}``; the beat carries its last few, most already journaled). Each new one
        is journaled once a copy here verifies with its digest; until then it waits."""
        for m in commits:
            step = m.get("step") if isinstance(m, dict) else None
            if isinstance(step, int) and step not in self.steps and m.get("digest"):
                self.pending[step] = m
        if self.pending:
            copies = self.store.copies()
            if self._settle(copies):
                self.on_scanned()

    def _settle(self, copies: dict) -> bool:
        """Journal the pending commits that a copy here now proves; True if any."""
        journaled = False
        for step, m in sorted(self.pending.items()):
            if step in self.steps:
                del self.pending[step]
                continue
            c = self._proven(copies.get(step, []), m)
            if c is not None:
                del self.pending[step]
                self._journal(c)
                self.on_progress()
                journaled = True
        return journaled

    def _proven(self, copies: list[Checkpoint], m: dict) -> Checkpoint | None:
        """The copy that is the commit ``m`` told of: intact (the store's verify: manifest,
        marker, checksums) and with its digest. None: none yet."""
        for c in copies:
            if self.store.local.verify(c.path, cached=True) is not None:
                continue
            digest = self.store.local.digest(c.path)
            if digest == m["digest"]:
                return c
            if (c.step, digest) not in self._refused:
                self._refused.add((c.step, digest))
                log.warning(f"checkpoint step {c.step}: the copy at {c.path} is not the commit "
                            f"its rank told of (digest {str(digest)[:12]}, told "
                            f"{str(m['digest'])[:12]}): not journaled from it")
        return None

    def _journal(self, c: Checkpoint) -> None:
        for h in c.manifest.get("history", []):
            e = h.get("epoch")
            if e is None or e in self.epochs or e > c.epoch:
                continue
            metrics = {k: v for k, v in h.items() if k != "epoch"}
            self.journal.append(Event.EPOCH_COMPLETED, epoch=e, metrics=metrics,
                                attempt=c.manifest.get("attempt"))
            self.epochs.add(e)
            self.console.epoch_completed(e, metrics, c.manifest.get("attempt"),
                                         c.step if e == c.epoch else None,
                                         c.manifest.get("committed_at"))
        self.journal.append(Event.CHECKPOINT_COMMITTED, epoch=c.epoch,
                            batch=c.manifest.get("batch", 0), step=c.step, path=c.path,
                            weights_sha256=c.manifest.get("weights_sha256"),
                            state_sha256=c.manifest.get("state_sha256"),
                            state_bytes=c.nbytes,  # the standby's memory rule counts it
                            bytes_written=c.manifest.get("bytes_written"))
        self.steps.add(c.step)
        if self._newest is not _UNREAD and (self._newest is None or c.step > self._newest.step):
            self._newest, self._read = c, False  # verified as it was journaled

    def latest(self) -> Checkpoint | None:
        """The newest intact checkpoint, read from the tiers now (its path is used: the run's
        end exports it). A copy this process hashed already and whose files are unchanged is
        not hashed again; the worker that restores it hashes it itself."""
        return self.store.latest_valid(cached=True)

    def _known(self) -> Checkpoint | None:
        """The newest checkpoint as the ledger knows it, for the epoch reached: read from the
        tiers once, then each copy it journals (verified just before) if newer. Not read again
        after each scan: between a worker's death and the next spawn that hashed the last
        commit's blobs again (racily clean, blobset.py), on the cold path (BENCHMARKS.md)."""
        if self._newest is _UNREAD:
            self._newest, self._read = self.latest(), True
        return self._newest

    def latest_epoch(self) -> int:
        c = self._known()
        return c.epoch if c else 0

    def resumable_epoch(self) -> int:
        """The epoch the next attempt resumes from: after an attempt ended, the newest known
        copy is verified again (a worker, or anything beside it, may have changed it since it
        was journaled); cached, so only what changed or is racily clean is hashed. Asked once
        the next attempt's workers are spawned, beside their start rather than before it."""
        c = self._known()
        if self._recheck and c is not None:
            if (c.tier or self.store.local).verify(c.path, cached=True) is not None:
                self._newest, self._read = self.latest(), True
        self._recheck = False
        return self.latest_epoch()

    def completed(self, epochs: int) -> bool:
        """The last epoch is done, or the job's callbacks ended training (EarlyStopping): the
        newest known says so, and so does the newest read afresh (the run ends on it)."""
        c = self._known()
        if c is None or not c.ends_run(epochs):
            return False
        if not self._read:  # the tiers confirm it once
            self._newest, self._read = self.latest(), True
            c = self._newest
        return c is not None and c.ends_run(epochs)

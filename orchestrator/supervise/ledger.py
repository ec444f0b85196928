"""The journal's epoch and checkpoint events, derived from committed checkpoints.

The worker commits checkpoints to the local tier and the durable mirror (a thread of the
supervisor) copies them to the run directory; either process may die at any moment. So the
supervisor journals ``epoch_completed`` and ``checkpoint_committed`` from what is committed in
either tier, not from what the worker says, and each exactly once: the ledger remembers what the
journal already holds (``recall``) and scans the tiers on every commit event (``scan``). A new
checkpoint is the run's progress: ``on_progress`` tells the recovery policy.
"""
from __future__ import annotations

from typing import Callable

from orchestrator.checkpoint.store import Checkpoint
from orchestrator.checkpoint.tiers import TieredStore
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal


class CheckpointLedger:
    def __init__(self, store: TieredStore, journal: Journal, console,
                 on_progress: Callable[[], None], on_scanned: Callable[[], None]):
        self.store, self.journal, self.console = store, journal, console
        self.on_progress, self.on_scanned = on_progress, on_scanned
        self.epochs: set[int] = set()
        self.steps: set[int] = set()

    def recall(self, events: list[dict]) -> None:
        """What earlier sessions journaled already."""
        self.epochs = {e["epoch"] for e in events if e["event"] == Event.EPOCH_COMPLETED}
        self.steps = {e["step"] for e in events if e["event"] == Event.CHECKPOINT_COMMITTED}

    def scan(self) -> None:
        """Journal every committed checkpoint (either tier) and the epochs it covers, each
        exactly once, then wake the durable mirror."""
        for step, copies in sorted(self.store.copies().items()):
            if step in self.steps:
                continue
            c = next((c for c in copies if self.store.local.verify(c.path, cached=True) is None),
                     None)
            if c is None:
                continue  # not (yet) intact; a later scan or the restore will judge it
            self._journal(c)
            self.on_progress()  # the run moves: failures before this are not a loop
        self.on_scanned()

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
                            state_sha256=c.manifest.get("state_sha256"))
        self.steps.add(c.step)

    def latest(self) -> Checkpoint | None:
        """The newest intact checkpoint, for the supervisor's bookkeeping (the epoch reached,
        whether the run is complete). Asked four times between a worker's death and the next
        one's start: a copy this process hashed already and whose files are unchanged is not
        hashed again (the seconds of a large checkpoint's sha256, each time, on the cold
        path); the worker that restores it hashes it itself."""
        return self.store.latest_valid(cached=True)

    def latest_epoch(self) -> int:
        c = self.latest()
        return c.epoch if c else 0

    def completed(self, epochs: int) -> bool:
        """The last epoch is done, or the job's callbacks ended training (EarlyStopping)."""
        c = self.latest()
        return c is not None and c.ends_run(epochs)

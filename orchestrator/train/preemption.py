"""SIGTERM is a preemption notice: finish the step, commit, exit ``EXIT_PREEMPTED``.

GCE spot VMs and TPU maintenance give about 30 s between SIGTERM and the kill, ``docker stop``
10 s, a Colab runtime restart sends one too; the supervisor forwards its own SIGTERM/SIGINT and
waits ``preempt_grace`` (20 s by default). Without a handler Python dies at once and everything
since the last checkpoint is lost (an epoch, in a job that checkpoints at epoch ends).

While training, the handler only takes note: the checkpoint callback sees it at the next step
boundary (or at the epoch's end, after the job's callbacks had their say), commits the state in
the middle of the epoch and raises ``Preempted``; a commit under way finishes first, so the
previous checkpoint is never touched. Outside training (imports, model build, restore, export)
there is nothing new to save, so the handler raises ``Preempted`` at once. TensorFlow's own
PreemptionCheckpointHandler does the same for its strategies; this one works with the worker's
checkpoint store and its exact mid-epoch resume.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import time
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal

log = logging.getLogger(__name__)


class Preempted(BaseException):
    """SIGTERM arrived; ``step`` is the checkpoint saved for it (None: nothing new to save).

    A BaseException, as KeyboardInterrupt: the job's and Keras's ``except Exception`` must not
    swallow it."""

    def __init__(self, step: int | None, received_at: float):
        super().__init__(f"preempted (SIGTERM); saved step {step}" if step is not None
                         else "preempted (SIGTERM) outside training; nothing new to save")
        self.step, self.received_at = step, received_at

    def journal(self, path: str, attempt: int, progress) -> None:
        """``preempted`` in the journal at ``path``, and the line; the run directory may be
        what is going away (a runtime being recycled): then the line only."""
        try:
            Journal(path).append(Event.PREEMPTED, source="worker", attempt=attempt,
                                 step=self.step, epoch=progress.epoch, batch=progress.batch,
                                 seconds=round(time.time() - self.received_at, 3))
        except OSError as exc:
            log.warning(f"could not journal the preemption: {exc}")
        log.warning(str(self))


class PreemptionNotice:
    def __init__(self):
        self.received_at: float | None = None
        self._in_training = False

    def install(self) -> "PreemptionNotice":
        signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def _on_sigterm(self, signum, frame) -> None:
        if self.received_at is None:
            self.received_at = time.time()
        if not self._in_training:
            raise Preempted(None, self.received_at)

    @contextlib.contextmanager
    def training(self):
        """While this holds, a SIGTERM waits for the next step boundary."""
        if self.requested:
            raise Preempted(None, self.received_at)
        with self.deferred():
            yield

    @contextlib.contextmanager
    def deferred(self):
        """While this holds, a SIGTERM is only noted (the caller reads ``requested`` after):
        the worker's first moments, before it knows where to journal it."""
        self._in_training = True
        try:
            yield
        finally:
            self._in_training = False

    def stop(self, step: int | None) -> None:
        """Called at a step boundary once the state is saved."""
        raise Preempted(step, self.received_at)

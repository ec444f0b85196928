"""Where a resumed attempt starts, and what keeps it from being exact (no TensorFlow).

A checkpoint says how many epochs were completed and how many batches of the next one were
trained. The attempt continues at the next batch, over data whose order is a function of
(seed, epoch). When the global batch changed (another number of replicas), the position is
translated by examples seen, and the run goes on, but not as an uninterrupted one would: the
reasons are journaled as ``resume_not_exact``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from orchestrator.core.rundir import ENV_RESTORE_STEP
from orchestrator.train.errors import JobError

NOT_DETERMINISTIC = (
    "the job does not set 'deterministic: true': TensorFlow may choose nondeterministic kernels "
    "(e.g. GPU convolution backprop, scatter and segment reductions with atomic adds), so "
    "the resumed steps may differ in the last bits")


@dataclass
class ResumePoint:
    epoch: int = 0       # epochs completed
    batch: int = 0       # batches of the next epoch already trained
    step: int = 0        # training batches run in the whole run
    history: list = field(default_factory=list)
    stopped_early: bool = False  # a callback (EarlyStopping) ended the training
    not_exact: list = field(default_factory=list)

    @property
    def mid_epoch(self) -> bool:
        return self.batch > 0

    def segments(self, epochs: int) -> list[tuple[int, int, int]]:
        """``fit`` calls as (first epoch, end epoch, batches to skip): the rest of an
        interrupted epoch is a call of its own (Keras starts every epoch at batch 0), then the
        remaining epochs are one more."""
        out = [(self.epoch, self.epoch + 1, self.batch)] if self.mid_epoch else []
        first_full = self.epoch + 1 if self.mid_epoch else self.epoch
        if first_full < epochs:
            out.append((first_full, epochs, 0))
        return out


def plan(manifest: dict | None, *, global_batch: int, steps_per_epoch: int,
         deterministic: bool) -> ResumePoint:
    """The resume point for ``manifest`` (None: a fresh start) under the current strategy."""
    if manifest is None:
        return ResumePoint()
    p = ResumePoint(epoch=int(manifest.get("epoch", 0)), batch=int(manifest.get("batch", 0)),
                    step=int(manifest.get("step", 0)), history=list(manifest.get("history", [])),
                    stopped_early=bool(manifest.get("stopped_early", False)))
    if not deterministic:
        p.not_exact.append(NOT_DETERMINISTIC)
    old = manifest.get("global_batch")
    if old and old != global_batch:
        p.not_exact.append(
            f"the global batch changed from {old} ({manifest.get('replicas')} replica(s)) to "
            f"{global_batch}: the steps after the resume differ from an uninterrupted run's")
        if p.batch:
            seen = p.batch * old
            p.batch = seen // global_batch
            if seen % global_batch:
                p.not_exact.append(
                    f"epoch {p.epoch + 1} resumes at example {p.batch * global_batch}, not at "
                    f"{seen}: {seen % global_batch} example(s) are trained on twice")
    if p.batch >= steps_per_epoch:
        p.batch = steps_per_epoch - 1
    return p


def restore_point(store, rank: int, skipped: list):
    """The checkpoint to restore and its arrays (None, {}: none): the newest that reads back
    intact (``TieredStore.latest_read``); in a group, exactly the step the supervisor names
    for every rank (ENV_RESTORE_STEP; empty: start afresh)."""
    import os

    step = os.environ.get(ENV_RESTORE_STEP)
    on_skip = lambda c, why: skipped.append((c, why))  # noqa: E731
    if step is None:
        return store.latest_read(on_skip=on_skip)
    if not step:
        return None, {}
    found = store.latest_read(on_skip=on_skip, step=int(step))
    if found[0] is None:
        raise JobError(
            f"rank {rank} on host {os.uname().nodename} cannot see checkpoint step {step} in "
            f"{store.local.root} or {store.durable.root}: every worker of a group must reach "
            f"the run directory (a shared path: NFS, gcsfuse, a Drive mount)")
    return found

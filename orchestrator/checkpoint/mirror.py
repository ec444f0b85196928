"""The durable mirror: copy local checkpoints to the durable tier in the background.

It runs as a thread of the supervisor (which never imports TensorFlow and outlives workers), so
a worker's training step never waits for Google Drive and a worker's death never interrupts an
upload. Each copy uses the commit protocol of ``CheckpointStore`` and counts only once it has
been read back and verified; then the local copy is marked durable and may be retired. While the
durable tier fails (``Transport endpoint is not connected``, ``Input/output error``, no space,
the folder gone), tenacity retries with exponential backoff, the backlog is journaled, the
remount hook is called for a lost mount, and everything due is flushed once the tier is back.

An error that is no outage (not an OSError) must not end the thread either: the uploads would
stop unseen while training goes on. It is journaled and logged with its traceback, and the
pass is tried again after the same backoff.

Journal events: ``checkpoint_durable``, ``durable_unreachable``, ``durable_backlog``,
``durable_restored``, ``durable_mirror_failed``, ``remount``, ``checkpoint_skipped`` (source
mirror), ``checkpoints_retired``.
"""
from __future__ import annotations

import errno
import importlib
import logging
import sys
import threading
from typing import Callable

from tenacity import Retrying, retry_if_exception_type, wait_exponential

from orchestrator.checkpoint.settle import Immediate, Settling, durable_to_retire, written_here
from orchestrator.checkpoint.store import Checkpoint, Retention
from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.core.journal import Journal
from orchestrator.checkpoint.tiers import TieredStore, is_durable, mark_durable, unmark_durable
from orchestrator.core.events import CHECKPOINTS, Event
from orchestrator.core.outage import Outage
from orchestrator.core.procid import boot_id

log = logging.getLogger(__name__)

REMOUNT_EVERY_S = 60.0
COLAB_MOUNTPOINT = "/content/drive"


class _Stopped(Exception):
    """The mirror is stopping; an upload in progress is abandoned (it resumes next session)."""


class _SourceGone(Exception):
    """The local copy no longer verifies: nothing to upload."""


class DurableMirror:
    def __init__(self, store: TieredStore, journal: Journal, retention: Retention,
                 backoff_initial: float = 1.0, backoff_max: float = 60.0,
                 remount: Callable[[str], object] | None = None,
                 remount_every_s: float = REMOUNT_EVERY_S,
                 hold: Callable[[], bool] = lambda: True, outage: Outage | None = None,
                 clock: Clock = SYSTEM, settling: Settling | None = None,
                 max_bytes: int | None = None):
        """``hold()`` is asked before each pass: False means the run directory is not ours to
        write now (the lock's lease, core/lock.py); the pass waits for the next one.
        ``outage``: the run directory's one (core/outage.py), whose ``CHECKPOINTS`` part this
        mirror's failures and successes move (by default one of its own). ``clock`` times the
        remounts and runs the backoff's waits. ``settling``: when a copy counts as in the cloud
        and what retention may delete (checkpoint/settle.py; by default at fsync);
        ``max_bytes``: the durable tier's space cap."""
        self.hold, self.clock = hold, clock
        self.store, self.journal, self.retention = store, journal, retention
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.remount, self.remount_every_s = remount, remount_every_s
        self.outage = outage or Outage(journal, store.durable.root, clock)
        self._cond = threading.Condition()
        self._wanted = 0      # bumped by notify(): a pass must start after it
        self._passes = 0      # passes started
        self._clean_pass = -1  # the last pass that ended with an empty backlog
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._durable_ok: dict[int, Checkpoint] = {}  # durable copies read back and verified
        self._durable_failed: list[Checkpoint] = []  # listed there at the last look, not verified
        self._bad_local: set[tuple] = set()  # local copies that failed to verify (journaled once)
        self._last_remount = float("-inf")
        self._journaled_backlog: tuple | None = None
        self._swept = False  # partial uploads of earlier sessions removed
        self.settling = settling or Settling(Immediate(), journal, store.durable.root, clock)
        self.max_bytes = max_bytes
        self._capped: tuple | None = None  # the last durable_cap journaled
        self._failed_passes = 0  # passes in a row that raised an error that is no outage
        self._journaled_failure: str | None = None

    # ---------------------------------------------------------------- control
    def start(self) -> "DurableMirror":
        """Start the thread; the first pass also flushes what an earlier session left."""
        self.notify()
        self._thread = threading.Thread(target=self._loop, name="durable-mirror", daemon=True)
        self._thread.start()
        return self

    def notify(self) -> None:
        """A checkpoint was committed locally (or the tier may be back): run a pass."""
        with self._cond:
            self._wanted += 1
            self._cond.notify_all()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def flush(self, timeout: float) -> list[int]:
        """Wait until everything due is durable; return the steps still pending."""
        with self._cond:
            self._wanted += 1
            target = self._wanted
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._clean_pass >= target or self._stop.is_set(),
                                timeout=timeout)
        return [c.step for c in self.backlog()]

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def unreachable(self) -> bool:
        return self.outage.is_down(CHECKPOINTS)

    # ---------------------------------------------------------------- what is due
    def _refresh_durable(self) -> None:
        """Learn which durable copies verify. Each is read back once, then re-read only when its
        files' size or mtime changed. A local copy whose durable copy vanished loses its
        ``durable.json`` marker, so it is uploaded again and not retired meanwhile."""
        listed = self.store.durable_list()
        if self.store.durable_error is not None:
            raise self.store.durable_error  # unreachable: keep what we knew, retry
        self._durable_ok = {c.step: c for c in listed
                            if self.store.durable.verify(c.path, cached=True) is None}
        self._durable_failed = [c for c in listed if c.step not in self._durable_ok]
        self.settling.seen(self._durable_ok, lambda: written_here(self.store.local.list()))
        for c in self.store.local.list():
            if c.step not in self._durable_ok:
                unmark_durable(c)
        self._reachable()

    def _verified(self) -> dict[int, Checkpoint]:
        """step -> a verified copy (local preferred), without touching the durable tier."""
        out = dict(self._durable_ok)
        for c in self.store.local.list():
            if _identity(c) in self._bad_local:
                # a recommit of the step wrote its bad blobs again: the same directory verifies
                if self.store.local.verify(c.path) is not None:
                    continue
                self._bad_local.discard(_identity(c))
            if self.store.local.verify(c.path, cached=True) is None:
                out[c.step] = c
        return out

    def backlog(self) -> list[Checkpoint]:
        """Local checkpoints that retention keeps and that have no verified durable copy yet,
        newest first (the newest progress is the most valuable one to save)."""
        verified = self._verified()
        if not verified:
            return []
        due = self.retention.select(list(verified.values())) | {max(verified)}
        return [verified[s] for s in sorted(due, reverse=True)
                if s not in self._durable_ok and s not in self.settling.evicted]

    # ---------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._wanted > self._passes or self._stop.is_set(),
                                    timeout=self.settling.next_due_s(30.0))
                if self._stop.is_set():
                    return
                self._passes = max(self._passes, self._wanted)
                this_pass = self._passes
            try:
                pending = self._pass()
            except _Stopped:
                return
            except Exception as exc:  # noqa: BLE001 - journaled, logged, and the pass retried
                self._unexpected(exc)
                continue
            self._failed_passes = 0
            with self._cond:
                if not pending:
                    self._clean_pass = this_pass
                    self._cond.notify_all()

    def _unexpected(self, exc: Exception) -> None:
        """A pass raised an error that is no outage: say so (once per error text), then wait
        the backoff before the next pass (sooner when told to stop)."""
        self._failed_passes += 1
        delay = min(self.backoff_max, self.backoff_initial * 2 ** (self._failed_passes - 1))
        error = f"{type(exc).__name__}: {exc}"
        if error != self._journaled_failure:
            self._journaled_failure = error
            log.error(f"durable mirror: a pass failed ({error}); checkpoints stay in "
                      f"{self.store.local.root}, retrying in {delay:.1f} s", exc_info=exc)
            self.journal.append(Event.DURABLE_MIRROR_FAILED, error=error,
                                retry_in_s=round(delay, 3))
        with self._cond:
            self._wanted += 1  # the next pass is due after the backoff, asked or not
        self.clock.wait(self._stop, delay)

    def _pass(self) -> list[Checkpoint]:
        """One pass: learn the durable tier, upload the backlog, apply retention. Every step
        that touches the durable tier is retried with backoff on an OSError: a mount that
        fails between two calls must never end the mirror."""
        self.settling.tick()
        if not self.hold():
            return self.backlog()
        if not self._swept:
            self._swept = True
            try:
                self.store.durable.remove_partial()  # uploads cut short by a killed supervisor
            except OSError as exc:
                self.store.durable_error = exc
        self._with_retries(self._refresh_durable, None)
        for c in self.backlog():
            if self._stop.is_set():
                raise _Stopped()
            try:
                self._with_retries(lambda: self._upload(c), c)
            except _SourceGone as exc:
                self._bad_local.add(_identity(c))
                self.journal.append(Event.CHECKPOINT_SKIPPED, source="mirror", tier="local",
                                    step=c.step, reason=str(exc))
        self._with_retries(self._retire, None)
        return self.backlog()

    def _with_retries(self, fn: Callable[[], None], c: Checkpoint | None) -> None:
        retrying = Retrying(
            retry=retry_if_exception_type(OSError),
            wait=wait_exponential(multiplier=self.backoff_initial, max=self.backoff_max),
            stop=lambda rs: self._stop.is_set(),
            sleep=self._sleep,
            before_sleep=lambda rs: self._failed(c, rs.outcome.exception(),
                                                 rs.next_action.sleep),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    fn()
        except OSError:
            if self._stop.is_set():
                raise _Stopped() from None
            raise

    def _sleep(self, seconds: float) -> None:
        """Back off, but come back early when told to stop."""
        if self.clock.wait(self._stop, seconds):
            raise _Stopped()

    def _upload(self, c: Checkpoint) -> None:
        t0 = self.clock.time()
        reason = self.store.local.verify(c.path, cached=True)  # what this process hashed once
        if reason is not None:
            raise _SourceGone(f"local copy {c.path} does not verify: {reason}")
        try:
            d = self.store.durable.commit_copy(c)
            copied = self.store.durable.last_copy
            # read back: only a verified copy counts (the blobs it had already were read back
            # when they were uploaded; their sizes are checked)
            reason = self.store.durable.verify(d.path, rehash=copied["uploaded"])
        except OSError:
            if self.store.local.verify(c.path) is not None:
                raise _SourceGone(f"local copy {c.path} changed during the upload") from None
            raise
        if reason is not None:
            # never verified, so nothing counts on it: left there, a restore would meet it and
            # skip it (seen: a local copy that changed during its upload)
            self.store.durable.remove(d)
            if self.store.local.verify(c.path) is not None:
                raise _SourceGone(f"local copy {c.path} changed during the upload")
            raise OSError(errno.EIO, f"the durable copy does not verify after the copy: {reason}",
                          d.path)
        self._durable_ok[c.step] = d
        mark_durable(c, d.path, verified_at=round(self.clock.time(), 3), boot=boot_id())
        self.settling.wrote(c, d.path, copied["bytes_uploaded"])
        self.journal.append(Event.CHECKPOINT_DURABLE, step=c.step, epoch=c.epoch, path=d.path,
                            upload_s=round(self.clock.time() - t0, 3),
                            bytes_uploaded=copied["bytes_uploaded"],
                            blobs_uploaded=copied["blobs_uploaded"],
                            blobs_reused=copied["blobs_reused"],
                            manifest_bytes=copied.get("manifest_bytes"))
        self._reachable()

    def _reachable(self) -> None:
        """A durable operation succeeded: if the tier was down, say it is back."""
        if not self.unreachable:
            return
        left = [x.step for x in self.backlog()]
        if self.outage.came_back(
                CHECKPOINTS, lambda down: f"durable tier is back after {down:.0f} s; flushing "
                                          f"{len(left)} more checkpoint(s)",
                lambda since, down: dict(down_s=round(down, 3), backlog=left)):
            self._journaled_backlog = None

    def _failed(self, c: Checkpoint | None, exc: BaseException, delay: float) -> None:
        err = {"errno": getattr(exc, "errno", None), "error": str(exc)}
        self.outage.went_down(
            CHECKPOINTS, f"durable tier {self.store.durable.root} unreachable ({exc}); training "
                         f"goes on, checkpoints stay in {self.store.local.root} until it is back",
            step=c.step if c else None, root=self.store.durable.root, **err)
        backlog = tuple(x.step for x in self.backlog())
        if backlog != self._journaled_backlog:
            self._journaled_backlog = backlog
            self.journal.append(Event.DURABLE_BACKLOG, steps=list(backlog), retry_in_s=round(delay, 3),
                                **err)
        if (self.remount is not None and getattr(exc, "errno", None) == errno.ENOTCONN
                and self.clock.time() - self._last_remount >= self.remount_every_s):
            self._last_remount = self.clock.time()
            self._call_remount()

    def _call_remount(self) -> None:
        try:
            self.remount(self.store.durable.root)
        except Exception as exc:  # noqa: BLE001 - a failed remount is journaled; retries go on
            self.journal.append(Event.REMOUNT, ok=False, error=f"{type(exc).__name__}: {exc}")
            return
        self.journal.append(Event.REMOUNT, ok=True)

    # ---------------------------------------------------------------- retention of both tiers
    def _retire(self) -> None:
        """Apply retention to the durable tier, and retire local copies that are durable (or
        not due at all) beyond the local last-K. Never the newest verified checkpoint, never a
        durable copy that was not verified, never a local copy that is due and not durable."""
        verified = self._verified()
        if not verified:
            return
        newest = max(verified)
        due = self.retention.select(list(verified.values())) | {newest}
        removed: dict[str, list[int]] = {"durable": [], "local": []}
        if self.store.durable_error is None:
            plan = durable_to_retire(self._durable_ok, due, newest,
                                     self.settling.settled_steps()
                                     if self.settling.policy.writeback else None, self.max_bytes)
            for step in plan.steps:
                self.store.durable.remove(self._durable_ok.pop(step))
                self.settling.forget(step)
                removed["durable"].append(step)
            self._journal_cap(plan)
            removed["durable"] += self._remove_cut_short()
        local = [c for c in self.store.local.list() if c.step in verified]
        recent = {c.step for c in local[-self.retention.keep:]}
        for c in local:
            if c.step in recent or c.step >= newest:
                continue
            if is_durable(c) or c.step not in due:
                self.store.local.remove(c)
                removed["local"].append(c.step)
        for tier, steps in removed.items():
            if steps:
                # the blobs no kept checkpoint names (a commit in flight keeps its own)
                getattr(self.store, tier).collect_blobs()
                self.journal.append(Event.CHECKPOINTS_RETIRED, tier=tier, steps=steps)

    def _remove_cut_short(self) -> list[int]:
        """Remove the durable copies whose commit stopped before its marker (the supervisor of
        an earlier session killed, or its mount lost, mid-copy) once a newer copy verifies
        there: left, they stay in a completed run's directory for ever. Only this thread
        writes the durable tier, so none of them is a copy under way; a copy that fails to
        verify for another reason stays, for whoever looks into it."""
        if not self._durable_ok:
            return []
        newest = max(self._durable_ok)
        cut = [c for c in self._durable_failed
               if c.step < newest and self.store.durable.cut_short(c.path)]
        for c in cut:
            self.store.durable.remove(c)
        self._durable_failed = [c for c in self._durable_failed if c not in cut]
        return [c.step for c in cut]

    def _journal_cap(self, plan) -> None:
        """Say once when the space cap forced retention's hand (checkpoint/settle.py)."""
        self.settling.evicted.update(plan.forced)
        said = (tuple(plan.forced), plan.over_cap > 0)
        if (plan.forced or plan.over_cap) and said != self._capped:
            self._capped = said
            self.journal.append(Event.DURABLE_CAP, max_bytes=self.max_bytes,
                                removed=plan.forced, over_bytes=plan.over_cap)
            log.warning(f"durable tier over its cap of {self.max_bytes} bytes: "
                        + (f"removed steps {plan.forced} retention would have kept"
                           if plan.forced else f"{plan.over_cap} bytes over, kept: the newest "
                           f"settled and the newest written copy are never removed"))


def _identity(c: Checkpoint) -> tuple:
    """A step may be committed again (after a corrupt copy was skipped): tell the two apart."""
    return (c.step, c.manifest.get("committed_at"))


def remount_hook(spec) -> Callable[[str], object] | None:
    """The job's remount hook: ``colab`` (Google Drive's force_remount) or ``module:function``
    from the job's folder, called with the durable directory; None when there is none."""
    name = spec.checkpoint.remount
    if name is None:
        return None
    if name == "colab":
        def colab(_root: str):
            from google.colab import drive  # only on Colab; the ImportError is journaled

            return drive.mount(COLAB_MOUNTPOINT, force_remount=True)

        return colab
    module_name, func_name = name.split(":")
    if spec.job_dir not in sys.path:
        sys.path.insert(0, spec.job_dir)
    return getattr(importlib.import_module(module_name), func_name)


"""What "durable" means for the durable tier, and when a copy there counts as safe.

Why: Colab's Drive mount is a write-back cache. "Data written to Google Drive is first written
to the disk attached to the VM" (colabtools#659) and uploaded later, on DriveFS's schedule; a
copy that reads back through the mount proves nothing about the cloud, and a recycle loses what
was not uploaded (colabtools#287, #2607), while a deletion reaches the cloud at once. So each
durable tier has a policy:

- ``Immediate`` (a local disk, NFS): a copy is safe once fsync'd and read back, as always.
- ``WriteBack`` (a mounted folder with a write-back cache; the default under ``/content/drive``):
  a copy is *written* once it reads back and *settled* only when
  - ``mount``: a later runtime's mount shows it (at start, every copy present that this machine
    did not write is the cloud's);
  - ``flush``: a flush said so (``google.colab.drive.flush_and_unmount``);
  - ``estimate``: margin x (quiet period + the bytes written before it and not settled / the
    upload rate) has passed since it was last written. The rate is the one measured by this
    runtime's flushes, else the policy's estimate.

``Settling`` keeps that ledger for the durable mirror (checkpoint/mirror.py calls its hooks) and
journals ``checkpoint_settled`` with how it was decided. ``durable_to_retire`` is retention on
such a tier: never delete a settled copy unless a newer one has settled, and a space cap that
says when it forces a choice. Next to each durable copy a small state file (step, epoch,
metrics, time) lets a new runtime read the run's progress up to its last settled point even
when the journal's newest lines never left the cache.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import ClassVar

from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.core.events import Event
from orchestrator.core.osutil import read_json, write_json_atomic
from orchestrator.core.procid import boot_id

log = logging.getLogger(__name__)

DRIVE_ROOT = "/content/drive"
STATE_SUFFIX = ".state.json"
MOUNT, FLUSH, ESTIMATE = "mount", "flush", "estimate"
_STATE_RE = re.compile(r"^(\d{10})\.state\.json$")


@dataclass(frozen=True)
class Immediate:
    """Settled when written: fsync'd and read back is in the tier."""

    kind: ClassVar[str] = "immediate"
    writeback: ClassVar[bool] = False

    def settle_after_s(self, pending_bytes: int, rate: float | None = None) -> float:
        return 0.0


@dataclass(frozen=True)
class WriteBack:
    """A mounted folder whose writes are uploaded later: settled after a flush, a new mount, or
    ``margin`` x (``quiet_s`` + pending bytes / rate) from the copy's last write."""

    quiet_s: float = 15.0
    bytes_per_s_estimate: float = 10e6
    margin: float = 2.0
    kind: ClassVar[str] = "writeback"
    writeback: ClassVar[bool] = True

    def settle_after_s(self, pending_bytes: int, rate: float | None = None) -> float:
        return self.margin * (self.quiet_s + pending_bytes / (rate or self.bytes_per_s_estimate))


def policy_for(ck, durable_root: str) -> Immediate | WriteBack:
    """The tier's policy from the job's ``checkpoint`` section (``durable_cache``: auto |
    writeback | none; ``writeback: {quiet_s, bytes_per_s, margin}``)."""
    mode = getattr(ck, "durable_cache", "auto")
    under_drive = os.path.abspath(durable_root).startswith(DRIVE_ROOT + "/")
    if mode == "none" or (mode == "auto" and not under_drive):
        return Immediate()
    return WriteBack(quiet_s=ck.writeback_quiet_s, bytes_per_s_estimate=ck.writeback_bytes_per_s,
                     margin=ck.writeback_margin)


def copy_bytes(c) -> int:
    """A checkpoint's bytes as its manifest states them (blobs it shares counted too: the cap
    and a copy found at mount err on the side of more)."""
    return c.nbytes


def state_path(durable_root: str, step: int) -> str:
    return os.path.join(durable_root, f"{step:010d}{STATE_SUFFIX}")


def write_state(durable_root: str, c, written_at: float) -> None:
    """The small closed file next to a durable copy: where the run stood at it."""
    m = c.manifest
    write_json_atomic(state_path(durable_root, c.step), {
        "step": c.step, "epoch": c.epoch, "batch": m.get("batch", 0), "metrics": m.get("metrics"),
        "committed_at": m.get("committed_at"), "written_at": round(written_at, 3)})


def history(durable_root: str) -> list[dict]:
    """The state files of the durable tier, oldest first: the run's progress as the tier has it
    (a checkpoint deleted by retention leaves none)."""
    out = []
    for p in sorted(glob.glob(os.path.join(durable_root, "*" + STATE_SUFFIX))):
        if _STATE_RE.match(os.path.basename(p)):
            rec = read_json(p)
            if isinstance(rec, dict) and "step" in rec:
                out.append(rec)
    return out


def written_here(local_checkpoints) -> dict[int, float]:
    """step -> when this machine's mirror wrote its durable copy (the local copy's durable
    marker, from this boot): such a copy may still be in this machine's cache, not the cloud."""
    from orchestrator.checkpoint.tiers import DURABLE_MARKER

    me, out = boot_id(), {}
    for c in local_checkpoints:
        marker = read_json(os.path.join(c.path, DURABLE_MARKER)) or {}
        if me is not None and marker.get("boot") == me and "verified_at" in marker:
            out[c.step] = float(marker["verified_at"])
    return out


@dataclass
class _Written:
    at: float
    nbytes: int
    due_at: float


class Settling:
    """The written and settled copies of the durable tier, kept by the mirror's thread (and
    read by the end of a run); journals ``checkpoint_settled``."""

    def __init__(self, policy: Immediate | WriteBack, journal, durable_root: str,
                 clock: Clock = SYSTEM):
        self.policy, self.journal, self.root, self.clock = policy, journal, durable_root, clock
        self.written: dict[int, _Written] = {}   # written, not settled
        self.settled: dict[int, str] = {}        # step -> how
        self.evicted: set[int] = set()           # removed by the space cap: not uploaded again
        self.rate: float | None = None           # bytes/s measured by a flush here
        self._started = False
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- the mirror's hooks
    def seen(self, present: dict, here=None) -> None:
        """The tier as listed now (step -> copy). The first listing settles what this machine
        did not write (``here()``: step -> when it wrote it, asked once); copies gone are
        forgotten."""
        with self._lock:
            for step in set(self.written) | set(self.settled):
                if step not in present:
                    self.written.pop(step, None)
                    self.settled.pop(step, None)
            if self._started:
                return
            self._started = True
            here = here() if callable(here) else here
            found = []
            for step, c in sorted(present.items()):
                if here and step in here and self.policy.writeback:
                    self._add(step, here[step], copy_bytes(c))
                else:
                    self.settled[step] = MOUNT
                    found.append(step)
        if found and self.policy.writeback:
            self.journal.append(Event.CHECKPOINT_SETTLED, steps=found, how=MOUNT)

    def wrote(self, c, durable_path: str, nbytes: int | None = None) -> None:
        """A copy was written and read back (``c``: its source, ``durable_path``: the copy;
        ``nbytes``: what the copy put in the cache, its new blobs, else its whole state)."""
        now = self.clock.time()
        if self.policy.writeback:
            try:
                write_state(self.root, c, now)
            except OSError as exc:  # the copy itself is what counts; this is a help
                log.info(f"no state file next to step {c.step} in {self.root} ({exc})")
        with self._lock:
            self.settled.pop(c.step, None)
            if self.policy.writeback:
                self._add(c.step, now, copy_bytes(c) if nbytes is None else nbytes)
            else:
                self.settled[c.step] = "fsync"

    def _add(self, step: int, at: float, nbytes: int) -> None:
        pending = nbytes + sum(w.nbytes for s, w in self.written.items() if s != step)
        self.written[step] = _Written(at, nbytes,
                                      at + self.policy.settle_after_s(pending, self.rate))

    def tick(self) -> list[int]:
        """Settle the copies whose estimate has passed; the steps settled now."""
        now = self.clock.time()
        with self._lock:
            due = sorted(s for s, w in self.written.items() if w.due_at <= now)
            facts = [(s, self.written.pop(s)) for s in due]
            for s in due:
                self.settled[s] = ESTIMATE
        for s, w in facts:
            self.journal.append(Event.CHECKPOINT_SETTLED, steps=[s], how=ESTIMATE,
                                after_s=round(now - w.at, 3), bytes=w.nbytes,
                                rate=self.rate or self.policy.bytes_per_s_estimate)
        return due

    def next_due_s(self, cap: float) -> float:
        """Seconds until the next estimate falls due (at most ``cap``): the mirror's wait."""
        with self._lock:
            first = min((w.due_at for w in self.written.values()), default=None)
        return cap if first is None else max(0.05, min(cap, first - self.clock.time()))

    def flushed(self, seconds: float | None = None, how: str = FLUSH) -> list[int]:
        """A flush reported everything uploaded: settle what was written; ``seconds`` it took
        measures the upload rate for later estimates."""
        with self._lock:
            steps = sorted(self.written)
            nbytes = sum(w.nbytes for w in self.written.values())
            self.written.clear()
            for s in steps:
                self.settled[s] = how
            if seconds and nbytes and seconds > 0:
                self.rate = nbytes / seconds
        if steps:
            self.journal.append(Event.CHECKPOINT_SETTLED, steps=steps, how=how,
                                bytes=nbytes, seconds=seconds)
        return steps

    # ---------------------------------------------------------------- questions
    def settled_steps(self) -> set[int]:
        with self._lock:
            return set(self.settled)

    def pending(self) -> list[int]:
        """Written, not settled, oldest first."""
        with self._lock:
            return sorted(self.written)

    def forget(self, step: int) -> None:
        """Retention removed the copy (and its state file)."""
        with self._lock:
            self.written.pop(step, None)
            self.settled.pop(step, None)
        try:
            os.remove(state_path(self.root, step))
        except FileNotFoundError:
            return  # an immediate tier writes none
        except OSError as exc:  # the tier is down: an orphan state file is harmless
            log.info(f"state file of step {step} left in {self.root} ({exc})")


@dataclass(frozen=True)
class Retire:
    """What retention removes from the durable tier, and what the space cap forced."""

    steps: list
    forced: list        # steps retention wanted kept that the cap removed
    over_cap: int       # bytes still over the cap after removing all that may go


def durable_to_retire(copies: dict, due: set[int], newest: int, settled: set[int] | None,
                      max_bytes: int | None = None) -> Retire:
    """Which durable copies go. ``copies``: step -> verified copy; ``due``: what retention
    keeps; ``newest``: the newest verified step of either tier; ``settled``: the settled steps
    (None on an immediate tier: every copy). The tier keeps its newest settled copy and removes
    an older one only once a newer copy has settled, so the cloud always holds a complete
    checkpoint: newer local ones are not in it yet (a machine lost just after the newest copy
    was retired for them left the bucket with none); the cap never removes that copy nor the
    newest written one."""
    anchor = max((s for s in copies if settled is None or s in settled), default=None)
    go = [s for s in sorted(copies) if s not in due and s < newest
          and anchor is not None and s < anchor]
    forced: list[int] = []
    over = 0
    if max_bytes is not None:
        kept = [s for s in sorted(copies) if s not in go]
        total = sum(copy_bytes(copies[s]) for s in kept)
        protected = {anchor, max(copies, default=None)}
        for s in kept:
            if total <= max_bytes:
                break
            if s in protected or (settled is not None and (anchor is None or s > anchor)):
                continue  # an unsettled copy newer than the anchor is the next anchor
            go.append(s)
            forced.append(s)
            total -= copy_bytes(copies[s])
        over = max(0, total - max_bytes)
    return Retire(sorted(go), forced, over)


def standing(events: list[dict], writeback: bool, newest: int | None) -> dict:
    """The newest durable copy (``newest``: the tier's, else the journal's last written) and
    whether it is only written or settled, with the newest settled step, from the journal
    (``status``). On an immediate tier a written copy is settled."""
    settled: dict[int, str] = {}
    written: list[int] = []
    for e in events:
        ev = e.get("event")
        if ev == Event.CHECKPOINT_SETTLED:
            settled.update({int(s): e.get("how") for s in e.get("steps") or []})
        elif ev == Event.CHECKPOINT_DURABLE and e.get("step") is not None:
            written.append(int(e["step"]))
            settled.pop(int(e["step"]), None)  # written again: settles again
        elif ev == Event.CHECKPOINTS_RETIRED and e.get("tier") == "durable":
            for s in e.get("steps") or []:
                settled.pop(int(s), None)
    if newest is None:
        newest = max(written, default=None)
    writeback = writeback or any(e.get("event") == Event.CHECKPOINT_SETTLED for e in events)
    if not writeback:
        return {"policy": Immediate.kind, "step": newest, "settled": newest is not None,
                "how": "fsync", "newest_settled": newest}
    return {"policy": WriteBack.kind, "step": newest, "settled": newest in settled,
            "how": settled.get(newest), "newest_settled": max(settled, default=None)}

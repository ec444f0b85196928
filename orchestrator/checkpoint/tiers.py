"""Two checkpoint tiers seen as one store: a fast local tier and the durable run directory.

The worker commits to the local tier only (a local disk never makes a training step wait for
Google Drive); the supervisor's ``DurableMirror`` copies each checkpoint to the durable tier
(``<run_dir>/checkpoints``) in the background and, once the copy has been read back and
verified, drops a ``durable.json`` marker into the local checkpoint. Local retention removes only
marked checkpoints, so the only verified copy is never deleted. ``TieredStore`` has the
``CheckpointStore`` API (``commit``, ``list``, ``verify``, ``latest_valid``, ``retain``), so the
worker's code does not know there are two tiers. No TensorFlow here.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from orchestrator.checkpoint.blobs import BlobError
from orchestrator.checkpoint.objectstore import FsspecPlace, is_object_store
from orchestrator.checkpoint.store import Checkpoint, CheckpointStore, Retention, as_retention
from orchestrator.core.osutil import write_json_atomic
from orchestrator.core.rundir import RunDir

DURABLE_MARKER = "durable.json"


def is_durable(c: Checkpoint) -> bool:
    """The mirror has verified a durable copy of this local checkpoint."""
    return os.path.isfile(os.path.join(c.path, DURABLE_MARKER))


def mark_durable(local: Checkpoint, durable_path: str, **facts) -> None:
    write_json_atomic(os.path.join(local.path, DURABLE_MARKER),
                      {"durable_path": durable_path, **facts})


def unmark_durable(local: Checkpoint) -> bool:
    """Its durable copy is gone: protect the local copy again. False if it was not marked."""
    try:
        os.remove(os.path.join(local.path, DURABLE_MARKER))
    except FileNotFoundError:
        return False
    return True


def durable_store(root: str) -> CheckpointStore:
    """The durable tier at ``root``: a folder, or a bucket (``gs://``, ``s3://``) whose writes
    count once the server acknowledged our checksum (objectstore.py)."""
    if is_object_store(root):
        return CheckpointStore(root, place=FsspecPlace(root))
    return CheckpointStore(root)


def durable_root(spec) -> str:
    """``checkpoint.durable`` (a bucket) or else the run directory's ``checkpoints/``."""
    return spec.checkpoint.durable or RunDir(spec.run_dir).checkpoints


class TieredStore:
    def __init__(self, local_root: str, durable_root: str):
        self.local = CheckpointStore(local_root, may_delete=is_durable)
        self.durable = durable_store(durable_root)
        self.durable_error: OSError | None = None  # why the last durable listing failed

    @property
    def root(self) -> str:
        return self.local.root

    # ---------------------------------------------------------------- write side (worker)
    def commit(self, step: int, write_payload: Callable[[str], None] | None, manifest: dict,
               keep: "int | Retention | None" = None, **arrays) -> Checkpoint:
        """Commit to the local tier (``arrays``, ``refs``: CheckpointStore.commit's); the
        supervisor's mirror makes it durable."""
        c = self.local.commit(step, write_payload, manifest, **arrays)
        if keep:
            self.local.retain(as_retention(keep))
        return c

    def retain(self, keep: "int | Retention") -> list[str]:
        return self.local.retain(keep)

    def remove_partial(self) -> list[str]:
        return self.local.remove_partial()

    def path_for(self, step: int) -> str:
        return self.local.path_for(step)

    # ---------------------------------------------------------------- read side (both)
    def durable_list(self) -> list[Checkpoint]:
        """Committed durable checkpoints; [] (and ``durable_error`` set) when unreachable."""
        try:
            out = self.durable.list()
        except OSError as exc:
            self.durable_error = exc
            return []
        self.durable_error = None
        return out

    def copies(self) -> dict[int, list[Checkpoint]]:
        """step -> its copies, local first."""
        out: dict[int, list[Checkpoint]] = {}
        for c in self.local.list() + self.durable_list():
            out.setdefault(c.step, []).append(c)
        return out

    def list(self) -> list[Checkpoint]:
        """Every committed step once (its local copy where there is one), oldest first."""
        return [cs[0] for _, cs in sorted(self.copies().items())]

    def verify(self, path: str) -> str | None:
        return self.local.verify(path)

    def digest(self, path: str) -> str | None:
        return self.local.digest(path)

    def read_arrays(self, c: Checkpoint):
        """The arrays of ``c``, from the tier that holds it."""
        return (c.tier or self.local).read_arrays(c.path)

    def latest_valid(self, on_skip: Callable[[Checkpoint, str], None] | None = None,
                     step: int | None = None, cached: bool = False) -> Checkpoint | None:
        """The newest checkpoint with a copy that verifies in either tier (only ``step``'s,
        when given); ``on_skip`` hears of each copy passed over (corrupt, partial,
        unreadable). ``cached``: trust this store's earlier verification of a copy whose
        files are unchanged (``CheckpointStore.verify``); a restore never passes it."""
        for c in self._newest_first(step):
            reason = (c.tier or self.local).verify(c.path, cached=cached)
            if reason is None:
                return c
            if on_skip:
                on_skip(c, reason)
        return None

    def _newest_first(self, step: int | None):
        """Every copy, newest step first, local before durable (only ``step``'s, when given)."""
        for s, cs in sorted(self.copies().items(), reverse=True):
            if step is None or s == step:
                yield from cs

    def latest_read(self, on_skip: Callable[[Checkpoint, str], None] | None = None,
                    step: int | None = None) -> tuple[Checkpoint | None, dict]:
        """As ``latest_valid``, with the checkpoint's arrays: the copy's manifest, marker and
        blob sizes are checked, then its arrays read, each blob hashed as it is read; a blob
        that does not match skips that copy as ``latest_valid`` would. A restore reads and
        hashes the state once, where verifying and then reading did it twice. (None, {}):
        no copy reads back."""
        for c in self._newest_first(step):
            tier = c.tier or self.local
            reason = tier.verify(c.path, rehash=set())  # no blob hashed: read_arrays does
            if reason is None:
                try:
                    return c, tier.read_arrays(c.path)
                except (BlobError, OSError, ValueError) as exc:
                    reason = str(exc).removeprefix(f"{c.path}: ")
            if on_skip:
                on_skip(c, reason)
        return None, {}


def set_aside_local(store: TieredStore) -> tuple[str, int] | None:
    """Move the local tier's checkpoints out of the way (renamed, not deleted) when they belong
    to an earlier run: the run directory was deleted and a new run starts at the same path, so
    the same local folder. Resuming from them would continue a run the user threw away.
    Returns (where they went, how many) or None when there was nothing."""
    root = store.local.root
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return None
    if not entries:
        return None
    dest = f"{root}.earlier-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    os.rename(root, dest)
    return dest, len(entries)




def for_spec(spec) -> TieredStore:
    return TieredStore(spec.checkpoint.local_dir, durable_root(spec))

"""The checkpoint store: atomic commit, manifest with checksums, newest-valid restore.

This module never imports TensorFlow, so the supervisor, ``status`` and the tests can read and
verify checkpoints. A checkpoint is a directory ``checkpoints/<step:010d>/`` (the global training
step, so mid-epoch checkpoints sort too) holding the payload files and ``manifest.json`` (which
says the epochs completed and the batch reached within the next one). It is written under a
temporary name, every file fsynced, then renamed into place, and then a commit marker
(``COMMITTED``, holding the manifest's sha256) is written inside it: on a POSIX disk the rename
alone is atomic, on a FUSE mount such as Google Drive it may not be, and a directory without a
matching marker is never taken for a checkpoint. Restore takes the newest checkpoint whose files
match their checksums and falls back past the others, because a checkpoint that fails to load
must never turn into a crash loop. Retention keeps the last K, one every N epochs and the best
by a metric, counting only checkpoints that verify.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from orchestrator.core.osutil import (fsync_dir, pid_alive, read_json, sha256_file, write_atomic,
                     write_json_atomic)
# defined below the store (the spec builds it), imported from here by its users too
from orchestrator.core.retention import Retention

MANIFEST = "manifest.json"
STATE_FILE = "state.npz"
COMMIT_MARKER = "COMMITTED"
_COMMITTED = re.compile(r"^\d{10}$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    manifest: dict

    @property
    def epoch(self) -> int:
        """Epochs completed when this checkpoint was taken."""
        return int(self.manifest.get("epoch", 0))

    def ends_run(self, epochs: int) -> bool:
        """The run is complete at this checkpoint: the last epoch is done, or the job's
        callbacks ended training (EarlyStopping)."""
        return self.epoch >= epochs or bool(self.manifest.get("stopped_early"))


def as_retention(keep) -> Retention | None:
    """``commit``/``retain`` take a plain count (the last K) or a full ``Retention``."""
    if keep is None or isinstance(keep, Retention):
        return keep
    return Retention(keep=int(keep))


class CheckpointStore:
    """One tier: a directory of committed checkpoints.

    ``may_delete(checkpoint)`` says whether retention may remove a checkpoint (the local tier
    keeps what has no verified durable copy yet); by default it may.
    """

    def __init__(self, root: str, may_delete: Callable[[Checkpoint], bool] | None = None):
        self.root = root
        self.may_delete = may_delete
        self._verified: dict[str, tuple] = {}  # path -> stat key of the files that verified

    # ---------------------------------------------------------------- write side
    def commit(self, step: int, write_payload: Callable[[str], None], manifest: dict,
               keep: "int | Retention | None" = None) -> Checkpoint:
        """Write the checkpoint of global ``step`` atomically and apply retention.

        ``write_payload(dir)`` writes the payload files into a fresh temporary directory.
        """
        def fill(tmp: str) -> None:
            write_payload(tmp)
            files = {}
            for name in sorted(os.listdir(tmp)):
                p = os.path.join(tmp, name)
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
                files[name] = {"sha256": sha256_file(p), "size": os.path.getsize(p)}
            full = dict(manifest, step=step, files=files, committed_at=round(time.time(), 3),
                        pid=os.getpid())
            write_json_atomic(os.path.join(tmp, MANIFEST), full)

        final = self._commit_dir(step, fill)
        if keep:
            self.retain(keep)
        return self._info(final)

    def commit_copy(self, source: Checkpoint) -> Checkpoint:
        """Copy a committed checkpoint of another tier here, byte for byte (manifest included),
        with the same commit protocol. The caller verifies the copy by reading it back."""
        names = list(source.manifest.get("files", {})) + [MANIFEST]

        def fill(tmp: str) -> None:
            for name in names:
                dst = os.path.join(tmp, name)
                shutil.copyfile(os.path.join(source.path, name), dst)
                with open(dst, "rb") as f:
                    os.fsync(f.fileno())

        return self._info(self._commit_dir(source.step, fill))

    def _commit_dir(self, step: int, fill: Callable[[str], None]) -> str:
        """tmp dir -> fill -> fsync -> rename -> commit marker. Returns the final path."""
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, f".tmp-{step:010d}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        final = self.path_for(step)
        try:
            fill(tmp)
            fsync_dir(tmp)
            if os.path.exists(final):
                if self.verify(final) is None:
                    shutil.rmtree(tmp)
                    return final
                trash = os.path.join(self.root, f".trash-{uuid.uuid4().hex[:8]}")
                os.rename(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, final)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_atomic(os.path.join(final, COMMIT_MARKER),
                     sha256_file(os.path.join(final, MANIFEST)).encode())
        return final

    def retain(self, keep: "int | Retention") -> list[str]:
        """Delete the checkpoints ``keep`` does not select. Never the newest verified one,
        nothing newer than it (it may be mid-commit), nothing ``may_delete`` protects."""
        policy = as_retention(keep)
        committed = self.list()
        verified = [c for c in committed if self.verify(c.path, cached=True) is None]
        if not verified:
            return []
        kept = policy.select(verified) | {verified[-1].step}
        removed = []
        for c in committed:
            if c.step in kept or c.step > verified[-1].step:
                continue
            if self.may_delete is not None and not self.may_delete(c):
                continue
            shutil.rmtree(c.path, ignore_errors=True)
            self._verified.pop(c.path, None)
            removed.append(c.path)
        return removed

    def remove_partial(self) -> list[str]:
        """Remove temporary directories left by writers that died mid-commit."""
        removed = []
        if not os.path.isdir(self.root):
            return removed
        for name in os.listdir(self.root):
            if name.startswith((".tmp-", ".trash-")):
                parts = name.split("-")
                pid = int(parts[2]) if name.startswith(".tmp-") and len(parts) > 2 else None
                if pid is not None and pid != os.getpid() and pid_alive(pid):
                    continue
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                removed.append(name)
        return removed

    # ---------------------------------------------------------------- read side
    def path_for(self, step: int) -> str:
        return os.path.join(self.root, f"{step:010d}")

    def list(self) -> list[Checkpoint]:
        """Committed checkpoints, oldest first (not yet verified). A missing root is empty;
        any other error (a lost mount, a file in its place) is raised, not taken for empty."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = []
        for name in sorted(names):
            if _COMMITTED.match(name):
                out.append(self._info(os.path.join(self.root, name)))
        return out

    def verify(self, path: str, cached: bool = False) -> str | None:
        """None when the checkpoint at ``path`` is complete and intact, else the reason.

        ``cached``: trust an earlier verification of this store when size, mtime and inode are
        unchanged (retention re-checks the same checkpoints at every commit); restore and the
        read-back of a durable copy always hash again.
        """
        mpath = os.path.join(path, MANIFEST)
        manifest = read_json(mpath)
        if not isinstance(manifest, dict) or "files" not in manifest:
            return "manifest missing or unreadable"
        try:
            with open(os.path.join(path, COMMIT_MARKER), "rb") as f:
                marker = f.read().decode(errors="replace").strip()
        except OSError as exc:
            return f"commit marker {COMMIT_MARKER} missing ({exc.strerror or exc})"
        try:
            key = tuple(_stat_key(os.path.join(path, n)) for n in [MANIFEST, *manifest["files"]])
        except OSError:
            key = None
        if cached and key is not None and self._verified.get(path) == key:
            return None
        try:
            if marker != sha256_file(mpath):
                return "commit marker does not match the manifest"
        except OSError as exc:
            return f"{MANIFEST}: {exc.strerror or exc}"
        for name, meta in manifest["files"].items():
            p = os.path.join(path, name)
            try:
                if os.path.getsize(p) != meta["size"]:
                    return f"{name}: size {os.path.getsize(p)} != {meta['size']}"
                if sha256_file(p) != meta["sha256"]:
                    return f"{name}: checksum mismatch"
            except OSError as exc:
                return f"{name}: {exc.strerror or exc}"
        if key is not None:
            self._verified[path] = key
        return None

    def digest(self, path: str) -> str | None:
        """What names the commit at ``path`` wherever a copy of it is: its commit marker (the
        manifest's sha256; a copy to another tier is byte for byte). A rank tells the
        supervisor of a commit with it, and the supervisor's copy must match it (ledger.py).
        None: not committed (yet)."""
        try:
            with open(os.path.join(path, COMMIT_MARKER), "rb") as f:
                return f.read().decode(errors="replace").strip() or None
        except OSError:
            return None

    def latest_valid(self, on_skip: Callable[[Checkpoint, str], None] | None = None
                     ) -> Checkpoint | None:
        """The newest checkpoint that verifies; ``on_skip`` hears of each one passed over."""
        for c in reversed(self.list()):
            reason = self.verify(c.path)
            if reason is None:
                return c
            if on_skip:
                on_skip(c, reason)
        return None

    def _info(self, path: str) -> Checkpoint:
        manifest = read_json(os.path.join(path, MANIFEST)) or {}
        return Checkpoint(int(os.path.basename(path)), path, manifest)


def _stat_key(path: str) -> tuple:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def weights_fingerprint(arrays) -> str:
    """sha256 over model weights (dtype, shape and bytes, in order): equal models, equal hash."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes(order="C"))
    return h.hexdigest()


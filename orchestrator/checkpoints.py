"""The checkpoint store: atomic commit, manifest with checksums, newest-valid restore.

This module never imports TensorFlow, so the supervisor, ``status`` and the tests can read and
verify checkpoints. A checkpoint is a directory ``checkpoints/<step:010d>/`` (the global training
step, so mid-epoch checkpoints sort too) holding the payload files and ``manifest.json`` (which
says the epochs completed and the batch reached within the next one). It is written under a
temporary name, every file fsynced, then renamed into place: the rename is the commit, so a
reader never sees half a checkpoint. Restore takes the newest checkpoint whose files match their
checksums and falls back past the others, because a checkpoint that fails to load must never
turn into a crash loop.
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

from .osutil import fsync_dir, pid_alive, read_json, sha256_file, write_json_atomic

MANIFEST = "manifest.json"
STATE_FILE = "state.npz"
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


class CheckpointStore:
    def __init__(self, root: str):
        self.root = root

    # ---------------------------------------------------------------- write side
    def commit(self, step: int, write_payload: Callable[[str], None], manifest: dict,
               keep: int | None = None) -> Checkpoint:
        """Write the checkpoint of global ``step`` atomically and apply retention.

        ``write_payload(dir)`` writes the payload files into a fresh temporary directory.
        """
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, f".tmp-{step:010d}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        try:
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
            fsync_dir(tmp)
            final = self.path_for(step)
            if os.path.exists(final):
                if self.verify(final) is None:
                    shutil.rmtree(tmp)
                    return self._info(final)
                trash = os.path.join(self.root, f".trash-{uuid.uuid4().hex[:8]}")
                os.rename(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, final)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if keep:
            self.retain(keep)
        return self._info(final)

    def retain(self, keep: int) -> list[str]:
        """Delete all but the newest ``keep`` checkpoints; never the newest verified one."""
        committed = self.list()
        newest_valid = self.latest_valid()
        removed = []
        for c in committed[:-keep] if keep < len(committed) else []:
            if newest_valid and c.path == newest_valid.path:
                continue
            shutil.rmtree(c.path, ignore_errors=True)
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
        """Committed checkpoints, oldest first (not yet verified)."""
        if not os.path.isdir(self.root):
            return []
        out = []
        for name in sorted(os.listdir(self.root)):
            if _COMMITTED.match(name):
                out.append(self._info(os.path.join(self.root, name)))
        return out

    def verify(self, path: str) -> str | None:
        """None when the checkpoint at ``path`` is complete and intact, else the reason."""
        manifest = read_json(os.path.join(path, MANIFEST))
        if not isinstance(manifest, dict) or "files" not in manifest:
            return "manifest missing or unreadable"
        for name, meta in manifest["files"].items():
            p = os.path.join(path, name)
            try:
                if os.path.getsize(p) != meta["size"]:
                    return f"{name}: size {os.path.getsize(p)} != {meta['size']}"
                if sha256_file(p) != meta["sha256"]:
                    return f"{name}: checksum mismatch"
            except OSError as exc:
                return f"{name}: {exc.strerror or exc}"
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


def weights_fingerprint(arrays) -> str:
    """sha256 over model weights (dtype, shape and bytes, in order): equal models, equal hash."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes(order="C"))
    return h.hexdigest()


"""Where a checkpoint tier keeps its files: every file operation of a tier goes through a Place.

A tier is a flat set of keys ('/'-separated relative paths: ``blobs/ab/<hash>``,
``0000000040/manifest.json``), so that a filesystem folder and an object store (gs://, s3://,
a later Place) serve alike. The store (store.py) needs no more than this protocol:

- ``url``: where it is, for messages;
- ``write_file(key, local_path)``, ``write_bytes(key, data)``, ``open_write(key)``: atomic
  (a reader sees the whole object or none) and durable on return by the place's own meaning
  (a filesystem: fsync, rename, fsync of the folder);
- ``read_bytes(key)``, ``open_read(key)`` (a binary file object), ``exists(key)``,
  ``size(key)`` (None when absent);
- ``mtime(key)`` (seconds since the epoch, None when absent: a blob younger than a collection
  is never collected);
- ``list(prefix)``: every key under a prefix, sorted, [] when there is none;
  ``children(prefix)``: the names directly under it (a folder's entries), sorted, [] when none;
  other errors (a lost mount) are raised, never taken for empty;
- optional ``stat_key(key)`` ((size, mtime, inode), None when absent): lets a blob hashed once
  be trusted while it is unchanged (blobset.py); without it, a blob is trusted by its size
  once this process has hashed it;
- ``delete(key)`` (absent is fine), ``delete_prefix(prefix)``,
  ``move_prefix(src, dst)`` (a folder's rename on a filesystem, atomic there; elsewhere a copy
  then a delete: the commit marker written after it is what commits a checkpoint).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import BinaryIO, Iterator

from orchestrator.core.osutil import fsync_dir


class LocalPlace:
    """A folder of a filesystem (a local disk, an NFS or Drive mount)."""

    def __init__(self, root: str):
        self.root = root
        self.url = root

    def path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    # ---------------------------------------------------------------- write
    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        """A file to write ``key`` through: a temporary name, fsynced and renamed into place
        when the block ends without an error, removed when it raises."""
        dst = self.path(key)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = f"{dst}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dst)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise
        fsync_dir(os.path.dirname(dst))

    def write_bytes(self, key: str, data: bytes) -> None:
        with self.open_write(key) as f:
            f.write(data)

    def write_file(self, key: str, local_path: str) -> None:
        with self.open_write(key) as f, open(local_path, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)

    # ---------------------------------------------------------------- read
    def read_bytes(self, key: str) -> bytes:
        with open(self.path(key), "rb") as f:
            return f.read()

    def open_read(self, key: str) -> BinaryIO:
        return open(self.path(key), "rb")

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def size(self, key: str) -> int | None:
        try:
            return os.path.getsize(self.path(key))
        except FileNotFoundError:
            return None

    def mtime(self, key: str) -> float | None:
        try:
            return os.path.getmtime(self.path(key))
        except FileNotFoundError:
            return None

    def stat_key(self, key: str) -> tuple | None:
        """(size, mtime, inode): unchanged means the bytes verified before are still there."""
        try:
            st = os.stat(self.path(key))
        except FileNotFoundError:
            return None
        return (st.st_size, st.st_mtime_ns, st.st_ino)

    def children(self, prefix: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.path(prefix)))
        except FileNotFoundError:
            return []

    def list(self, prefix: str = "") -> list[str]:
        base = self.path(prefix)
        if not os.path.isdir(base):
            if os.path.isfile(base):
                return [prefix]
            self.children(prefix)  # raises what is not "absent" (a lost mount)
            return []
        out = []
        for dirpath, _dirs, files in os.walk(base, onerror=_raise):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            out.extend(f"{rel}/{f}" if rel != "." else f for f in files)
        return sorted(out)

    # ---------------------------------------------------------------- delete, move
    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path(key))

    def delete_prefix(self, prefix: str) -> None:
        p = self.path(prefix)
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            self.delete(prefix)

    def move_prefix(self, src: str, dst: str) -> None:
        os.rename(self.path(src), self.path(dst))
        fsync_dir(os.path.dirname(self.path(dst)))


def _raise(exc: OSError) -> None:
    if not isinstance(exc, FileNotFoundError):
        raise exc

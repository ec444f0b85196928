"""The blobs of one tier: write what is missing, reuse what is there and right, collect what
nothing names (checkpoint format 2; store.py commits and verifies the checkpoints naming them).

A blob this process wrote or hashed is vouched for while its size, mtime and inode stay the
same, so a frozen layer is hashed once per process, not at every checkpoint, retention or pass
of the mirror; a blob it has not vouched for is hashed before it is reused, so a corrupt blob
is written again rather than named by every later checkpoint.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from orchestrator.checkpoint.blobs import (BLOBS, ArrayRef, array_chunks, blob_key, empty_for,
                                           hash_stream, is_blob_name, read_chunk, write_chunk)
from orchestrator.core.osutil import pid_alive

# a blob no directory names is deleted only once it is older than this: the margin between
# this host's clock and the storage's modification times
BLOB_GRACE_S = 60.0


class BlobSet:
    def __init__(self, place, grace_s: float = BLOB_GRACE_S):
        self.place, self.grace_s = place, grace_s
        self._good: dict[str, tuple] = {}  # hash -> (its stat when it hashed right, when)

    def write(self, arrays: dict, refs: dict) -> tuple[int, int]:
        """Write each chunk this tier lacks (or holds corrupt). (bytes written, blobs reused)."""
        written, reused, done = 0, 0, set()
        for k, a in arrays.items():
            for h, data in array_chunks(a, refs[k]):
                if h in done:
                    continue
                done.add(h)
                if self.reuse(h, len(data)):
                    reused += 1
                    continue
                with self.place.open_write(blob_key(h)) as f:
                    write_chunk(f, data)
                self.vouch(h)
                written += len(data)
        return written, reused

    def stat(self, h: str):
        stat = getattr(self.place, "stat_key", None)
        key = blob_key(h)
        return stat(key) if stat else self.place.size(key)

    def vouch(self, h: str) -> None:
        """This process wrote or hashed blob ``h``: trust it while its stat is unchanged."""
        self._good[h] = (self.stat(h), time.time_ns())

    def vouched(self, h: str) -> bool:
        """Vouched for, unchanged since, and not racily: a stat taken within a second of its
        mtime could miss a change made in the same clock tick (git's "racily clean")."""
        seen = self._good.get(h)
        if seen is None or seen[0] is None or seen[0] != self.stat(h):
            return False
        stat, at = seen
        return not isinstance(stat, tuple) or stat[1] < at - 1_000_000_000

    def reuse(self, h: str, n: int) -> bool:
        """Blob ``h`` is here, whole and right: reuse it. One this process has not vouched for
        is hashed first (a corrupt blob is written again, never reused into every later
        checkpoint). The reference list written first keeps it from a collection."""
        key = blob_key(h)
        if self.place.size(key) != n:
            return False
        if not self.vouched(h):
            try:
                return self.hashes_right(h)
            except FileNotFoundError:
                return False
        return True

    def hashes_right(self, h: str) -> bool:
        """Read blob ``h`` and check its hash (vouching for it when right)."""
        with self.place.open_read(blob_key(h)) as f:
            if hash_stream(f)[0] != h:
                return False
        self.vouch(h)
        return True

    def read(self, ref: ArrayRef, what: str) -> np.ndarray:
        """The array ``ref`` names, its blobs read straight into it and hashed in the same
        pass (``what.format(hash)`` names a blob that does not match in the BlobError)."""
        a = empty_for(ref)
        mv, at = memoryview(a.reshape(-1).view(np.uint8)), 0
        for h, n in ref.chunks:
            with self.place.open_read(blob_key(h)) as f:
                read_chunk(f, mv[at:at + n], h, what.format(h))
            self.vouch(h)
            at += n
        return a

    def recheck(self, arrays: dict, refs: dict) -> None:
        for k, a in arrays.items():
            for h, data in array_chunks(a, refs[k]):
                if self.place.size(blob_key(h)) != len(data):
                    with self.place.open_write(blob_key(h)) as f:
                        write_chunk(f, data)
                    self.vouch(h)

    def collect(self, named_blobs: Callable[[], set[str]],
                grace_s: float | None = None) -> list[str]:
        """Delete the blobs no directory names, written before this collection began (less
        the grace: ``grace_s``, else the set's). A commit in flight names its blobs (``refs``)
        before it writes or reuses any, the names are read again just before the deletions,
        and the commit checks its blobs again before its rename: a concurrent commit never
        loses one. Returns the hashes deleted."""
        grace = self.grace_s if grace_s is None else grace_s
        began = time.time()
        named = named_blobs()
        unnamed = []
        for shard in self.place.children(BLOBS):
            for name in self.place.children(f"{BLOBS}/{shard}"):
                key = f"{BLOBS}/{shard}/{name}"
                if not is_blob_name(name):
                    _remove_if_dead_writer(self.place, key, name)
                    continue
                mtime = self.place.mtime(key)
                if name not in named and mtime is not None and mtime < began - grace:
                    unnamed.append(name)
        named = named_blobs()  # a commit that began meanwhile
        removed = [h for h in unnamed if h not in named]
        for h in removed:
            self.place.delete(blob_key(h))
            self._good.pop(h, None)
        return removed


def _remove_if_dead_writer(place, key: str, name: str) -> None:
    """A blob's temporary file (``<hash>.tmp-<pid>-<id>``) whose writer died."""
    parts = name.split(".tmp-")
    if len(parts) == 2 and parts[1].split("-")[0].isdigit():
        pid = int(parts[1].split("-")[0])
        if pid != os.getpid() and not pid_alive(pid):
            place.delete(key)

"""Drive's write-back cache, for the Colab simulator (colab_sim.py).

On Colab, Drive is a FUSE mount over a cache on the VM's disk: a write returns once it is in
the cache and DriveFS uploads it later, on its own schedule (colabtools#659, #287, #2607). What
a new runtime sees at mount is the cloud's. This module gives each simulated runtime that:

- ``make_cache``: at ``drivemount``, a copy of the cloud (``$COLAB_SIM_HOME/drive``) made into
  ``$COLAB_SIM_HOME/caches/NAME``, which the runtime sees at ``/content/drive``;
- ``Sync``: one process per runtime (``colab_sim.py _sync``, carrying the runtime's token, so a
  recycle kills it) that uploads a file once it has been left alone (unchanged size and mtime)
  for ``quiet_s``, at ``bytes_per_s``, one file at a time; a file that changes while in upload
  is started again once quiet. Deletions, renames and new directories reach the cloud at once
  (metadata); a rename of a file not yet uploaded reaches it with its content, under the new
  name. A rename over an existing file deletes that file in the cloud at once. A flush request
  uploads everything pending without waiting for quiet, then the process exits (unmount).
- its state in ``$COLAB_SIM_HOME/drive_sync/NAME.json`` (``alive``, ``pending``, ``uploading``,
  ``uploads``, ``flushed``, ``lost``): for the tests, never for the product.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

SETTINGS_KEY = "writeback"   # control.json: {"quiet_s": Q, "bytes_per_s": B}, or absent/null
TICK_S = 0.1


def settings(control: dict, where: str = "control.json") -> dict | None:
    """The write-back settings in control.json, checked; None: Drive shared directly."""
    wb = control.get(SETTINGS_KEY)
    if wb is None:
        return None
    if not isinstance(wb, dict):
        raise ValueError(f"{where}: '{SETTINGS_KEY}' must be an object "
                         f"{{quiet_s, bytes_per_s}} or null, not {wb!r}")
    for key in ("quiet_s", "bytes_per_s"):
        v = wb.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or \
                (key == "bytes_per_s" and v == 0):
            raise ValueError(f"{where}: '{SETTINGS_KEY}.{key}' must be a number "
                             f"{'> 0' if key == 'bytes_per_s' else '>= 0'}, not {v!r}")
    return {"quiet_s": float(wb["quiet_s"]), "bytes_per_s": float(wb["bytes_per_s"])}


def cache_dir(home: str, name: str) -> str:
    return os.path.join(home, "caches", name)


def state_path(home: str, name: str) -> str:
    return os.path.join(home, "drive_sync", f"{name}.json")


def flush_request_path(home: str, name: str) -> str:
    return os.path.join(home, "drive_sync", f"{name}.flush")


def read_state(home: str, name: str) -> dict | None:
    try:
        with open(state_path(home, name)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def make_cache(home: str, name: str) -> str:
    """The runtime's cache of Drive, a copy of the cloud (copies, never hard links: the
    runtime writes into it); an earlier cache of this runtime is dropped first."""
    cache = cache_dir(home, name)
    shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    os.makedirs(os.path.join(home, "drive_sync"), exist_ok=True)
    shutil.copytree(os.path.join(home, "drive"), cache, symlinks=False)
    for stale in (state_path(home, name), flush_request_path(home, name)):
        if os.path.exists(stale):
            os.remove(stale)
    return cache


def mark_lost(home: str, name: str) -> None:
    """A recycle took the runtime's disk: its cache and what it had not uploaded."""
    state = read_state(home, name)
    if state is not None:
        write_json(state_path(home, name), dict(state, alive=False, lost=True))
    shutil.rmtree(cache_dir(home, name), ignore_errors=True)
    for leftover in (flush_request_path(home, name), partial_path(home, name)):
        if os.path.exists(leftover):
            os.remove(leftover)


def partial_path(home: str, name: str) -> str:
    return os.path.join(home, "drive_sync", f"{name}.partial")


@dataclass
class Entry:
    """One file or directory of the cache, known by its inode."""

    path: str                      # where it is in the cache now (relative)
    is_dir: bool
    size: int = 0
    mtime_ns: int = 0
    changed_at: float = 0.0        # when its size or mtime last changed (or it appeared)
    uploaded: tuple | None = None  # (size, mtime_ns) of the content the cloud has
    cloud_path: str | None = None  # where the cloud has it (relative), None: not there

    @property
    def pending(self) -> bool:
        return not self.is_dir and self.uploaded != (self.size, self.mtime_ns)


class Sync:
    """The upload loop of one runtime's cache (``run``), one ``tick`` at a time."""

    def __init__(self, home: str, name: str, quiet_s: float, bytes_per_s: float):
        self.home, self.name = home, name
        self.quiet_s, self.bytes_per_s = quiet_s, bytes_per_s
        self.cache, self.cloud = cache_dir(home, name), os.path.join(home, "drive")
        self.entries: dict[int, Entry] = {}
        self.upload: dict | None = None      # {ino, done, size, mtime_ns, file}
        self.uploads = 0
        self.flush_id: str | None = None     # a flush in progress
        self.flushed: str | None = None
        self.last_tick = time.monotonic()
        now = time.monotonic()
        for ino, (rel, is_dir, size, mtime) in self.scan().items():  # the cache is the cloud
            self.entries[ino] = Entry(rel, is_dir, size, mtime, now,
                                      None if is_dir else (size, mtime), rel)

    # ------------------------------------------------------------------ the cache as it is
    def scan(self) -> dict:
        found = {}
        for root, dirs, files in os.walk(self.cache):
            for n in dirs + files:
                full = os.path.join(root, n)
                try:
                    st = os.lstat(full)
                except FileNotFoundError:
                    continue
                is_dir = os.path.isdir(full) and not os.path.islink(full)
                if not is_dir and not os.path.isfile(full):
                    continue
                found[st.st_ino] = (os.path.relpath(full, self.cache), is_dir, st.st_size,
                                    st.st_mtime_ns)
        return found

    def cloud_of(self, rel: str) -> str:
        return os.path.join(self.cloud, rel)

    # ------------------------------------------------------------------ metadata, at once
    def apply_metadata(self, cur: dict, now: float) -> None:
        gone = [ino for ino, e in self.entries.items() if ino not in cur
                or cur[ino][1] != e.is_dir
                or (not e.is_dir and cur[ino][0] != e.path and cur[ino][3] != e.mtime_ns)]
        # deletions first (a rename over a file deletes it), files before their folders
        for ino in sorted(gone, key=lambda i: self.entries[i].is_dir):
            e = self.entries.pop(ino)
            if e.cloud_path is None:
                continue
            target = self.cloud_of(e.cloud_path)
            if e.is_dir:
                shutil.rmtree(target, ignore_errors=True)
            elif os.path.isfile(target):
                os.remove(target)
            if self.upload and self.upload["ino"] == ino:
                self.abort_upload()
        # renames: folders from the shallowest, then files
        moved = sorted((ino for ino, e in self.entries.items() if cur[ino][0] != e.path),
                       key=lambda i: (not self.entries[i].is_dir, cur[i][0].count(os.sep)))
        for ino in moved:
            e, new = self.entries[ino], cur[ino][0]
            old_cloud = e.cloud_path
            e.path = new
            if old_cloud is None or old_cloud == new:
                continue
            src, dst = self.cloud_of(old_cloud), self.cloud_of(new)
            if not os.path.lexists(src):
                e.cloud_path, e.uploaded = None, None
                continue
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if e.is_dir and os.path.isdir(dst):
                shutil.rmtree(dst)
            os.replace(src, dst)
            e.cloud_path = new
            if e.is_dir:  # what the cloud held under it moved with it
                for other in self.entries.values():
                    if other.cloud_path and other.cloud_path.startswith(old_cloud + os.sep):
                        other.cloud_path = new + other.cloud_path[len(old_cloud):]
        # new entries: folders reach the cloud at once, files wait for quiet
        for ino, (rel, is_dir, size, mtime) in sorted(cur.items(), key=lambda kv: kv[1][0]):
            e = self.entries.get(ino)
            if e is None:
                e = self.entries[ino] = Entry(rel, is_dir, size, mtime, now)
                if is_dir:
                    os.makedirs(self.cloud_of(rel), exist_ok=True)
                    e.cloud_path = rel
            elif (size, mtime) != (e.size, e.mtime_ns):
                e.size, e.mtime_ns, e.changed_at = size, mtime, now

    # ------------------------------------------------------------------ contents, when quiet
    def abort_upload(self) -> None:
        if self.upload:
            self.upload["file"].close()
            self.upload = None
        if os.path.exists(partial_path(self.home, self.name)):
            os.remove(partial_path(self.home, self.name))

    def next_upload(self, now: float, tried: set) -> None:
        due = [(e.changed_at, ino) for ino, e in self.entries.items() if e.pending and
               ino not in tried and (self.flush_id is not None or now - e.changed_at >= self.quiet_s)]
        if due:
            ino = min(due)[1]
            e = self.entries[ino]
            self.upload = {"ino": ino, "done": 0, "size": e.size, "mtime_ns": e.mtime_ns,
                           "file": open(partial_path(self.home, self.name), "wb")}

    def progress_upload(self, budget: float) -> int:
        """Send up to ``budget`` bytes of the file in upload; the bytes sent. The upload ends
        (``self.upload`` None) once its last byte is in the cloud, or when it is aborted."""
        up = self.upload
        e = self.entries.get(up["ino"])
        if e is None or (e.size, e.mtime_ns) != (up["size"], up["mtime_ns"]):
            self.abort_upload()  # changed: uploaded again once quiet
            return 0
        want = min(int(budget), up["size"] - up["done"])
        try:
            with open(os.path.join(self.cache, e.path), "rb") as f:
                f.seek(up["done"])
                chunk = f.read(want)
        except OSError:
            self.abort_upload()
            return 0
        up["file"].write(chunk)
        up["done"] += len(chunk)
        if up["done"] < up["size"]:
            return len(chunk)
        up["file"].close()
        st = os.stat(os.path.join(self.cache, e.path))
        if (st.st_size, st.st_mtime_ns) != (up["size"], up["mtime_ns"]):
            self.abort_upload()
            return len(chunk)
        dst = self.cloud_of(e.path)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(partial_path(self.home, self.name), dst)
        e.uploaded, e.cloud_path = (up["size"], up["mtime_ns"]), e.path
        self.upload = None
        self.uploads += 1
        return len(chunk)

    def tick(self) -> bool:
        """One pass: metadata, then up to the bandwidth's worth of bytes since the last
        pass. False once a flush that unmounts is done (the process then ends)."""
        now = time.monotonic()
        budget, self.last_tick = self.bytes_per_s * (now - self.last_tick), now
        self.read_flush_request()
        self.apply_metadata(self.scan(), now)
        tried = set()
        while True:
            if self.upload is None:
                self.next_upload(now, tried)
                if self.upload is None:
                    break
                tried.add(self.upload["ino"])
            budget -= self.progress_upload(budget)
            if self.upload is not None:  # the budget is spent
                break
        done = self.flush_id is not None and self.upload is None and \
            not any(e.pending for e in self.entries.values())
        if done:
            self.flushed, self.flush_id = self.flush_id, None
        self.write_state(now, alive=not done)
        return not done

    def read_flush_request(self) -> None:
        try:
            with open(flush_request_path(self.home, self.name)) as f:
                rid = f.read().strip()
        except FileNotFoundError:
            self.flush_id = None  # none asked, or called off
            return
        if rid and rid != self.flushed:
            self.flush_id = rid

    def write_state(self, now: float, alive: bool = True) -> None:
        up = self.upload
        write_json(state_path(self.home, self.name), {
            "runtime": self.name, "alive": alive, "lost": False, "ts": time.time(),
            "quiet_s": self.quiet_s, "bytes_per_s": self.bytes_per_s,
            "pending": sorted(({"path": e.path, "bytes": e.size,
                                "quiet_for_s": round(now - e.changed_at, 3)}
                               for e in self.entries.values() if e.pending),
                              key=lambda p: p["path"]),
            "uploading": None if up is None else {
                "path": self.entries[up["ino"]].path, "done": up["done"], "bytes": up["size"]},
            "uploads": self.uploads, "flushing": self.flush_id, "flushed": self.flushed})

    def run(self) -> int:
        while os.path.isdir(self.cache):
            if not self.tick():
                return 0
            time.sleep(TICK_S)
        return 1

"""The run's control state, written on the local disk first and mirrored to the run directory.

Why: the run directory is often Google Drive, whose mount drops for seconds or minutes
("Transport endpoint is not connected"). Measured before this module: the whole run directory
gone for 6 s killed the supervisor (a lock refresh), and a worker printing to an attempt log on
Drive would die of EIO. So the journal, the heartbeat, the attempt logs and error records and
the fault marks live in ``RunDir.control`` on the local disk; this thread copies them to the run
directory every ``CONTROL_SYNC_S`` (``orchestrator status`` on another machine sees them that
late) and, after an outage, delivers the backlog in order.

- Append-only files (the journal, attempt logs) are mirrored by appending the new complete lines;
  if the durable copy is not the size the last append left (another VM wrote to it, or it was
  replaced), the journal is merged line by line instead and a log is copied whole.
- Other files (heartbeat, error records, fault marks) are replaced when they changed.
- ``segment_s`` (a run directory on a write-back cache, checkpoint/settle.py): the run
  directory's journal is closed into segments (core/journal.py) every ``segment_s`` seconds and
  at the end, so that what must outlive the runtime is in files the cache is left alone to
  upload; the live file holds the lines since the last segment.
- ``merge_on_start``: a new VM has only the durable journal; a VM that survived an outage may
  hold events the run directory never received. Lines either side lacks are added to it, so both
  journals hold the same events in the same order (a line is one event, with its timestamp: two
  equal lines are one event).

Every failure is an ``OSError`` from the run directory: it goes to the run's one ``Outage``
(core/outage.py), which journals ``run_dir_unreachable`` once and ``run_dir_restored`` (with
what was held back) once.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable

from tenacity import wait_exponential

from orchestrator.core import heartbeat
from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.core.journal import append_lines, raw_lines, segment_paths, segments_dir
from orchestrator.core.osutil import complete_lines, file_size, is_missing, write_atomic
from orchestrator.core.outage import Outage
from orchestrator.core.rundir import ATTEMPTS_DIR, FAULTS_DIR, JOURNAL_FILE, RunDir, rank_of

log = logging.getLogger(__name__)

CONTROL_SYNC_S = 0.5
# On a write-back cache, the run directory's journal is closed into a segment once its oldest
# line is this old: a recycle loses at most this much history plus the cache's upload delay.
SEGMENT_S = 15.0
# While the run directory is down, retry every 0.5 s growing to 5 s: a returning mount is seen
# within 5 s, and a dead one costs one failing call every 5 s.
RETRY_WAIT = wait_exponential(multiplier=CONTROL_SYNC_S, max=5.0)


def journal_lines(path: str, segments: bool = False) -> tuple[list[bytes], int]:
    """The journal's complete, parseable lines (a torn line of a killed writer is dropped) and
    the bytes they span (of the live file). ``segments``: its closed segments' lines first.
    Raises OSError when it cannot be read; a missing file has none."""
    try:
        with open(path, "rb") as f:
            data = complete_lines(f.read())
    except FileNotFoundError:
        data = b""
    if segments and segment_paths(path):
        lines = [x for x in raw_lines(path) if x.endswith(b"\n")]
        return [x for x in lines if _parses(x)], len(data)
    return [x for x in data.splitlines(keepends=True) if _parses(x)], len(data)


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


class ControlMirror:
    def __init__(self, rd: RunDir, outage: Outage, hold: Callable[[], bool] = lambda: True,
                 clock: Clock = SYSTEM, segment_s: float | None = None):
        """``hold()`` is asked before each pass: False means write nothing to the run directory
        now (the lock is not ours, or not confirmed since an outage). ``segment_s``: close the
        run directory's journal into a segment this often (None: one growing file)."""
        self.rd, self.outage, self.hold, self.clock = rd, outage, hold, clock
        self.segment_s = segment_s
        self._live_since: float | None = None  # when the live file's oldest line was appended
        self._appended: dict[str, tuple[int, int | None]] = {}  # rel -> (local, durable) sizes
        self._copied: dict[str, tuple] = {}                     # rel -> local (size, mtime_ns)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._clean = threading.Event()  # the last pass mirrored everything
        self._thread: threading.Thread | None = None
        self._sync_lock = threading.Lock()

    @property
    def mirrored(self) -> bool:
        return self.rd.local is not None and os.path.normpath(self.rd.local) != \
            os.path.normpath(self.rd.root)

    # ---------------------------------------------------------------- start
    def merge_on_start(self, rewrite_local: bool = True) -> dict:
        """Make the local and the durable journal hold the same events; bring the durable
        fault marks here (an injected fault fires once per run, on any VM). Raises OSError
        when the run directory cannot be read (the caller cannot start without it anyway).
        ``rewrite_local`` is False while workers append to the local journal: then only the
        durable one gains what it lacks."""
        if not self.mirrored:
            return {}
        local, durable = self.rd.journal, os.path.join(self.rd.root, JOURNAL_FILE)
        (mine, read), (theirs, _) = journal_lines(local), journal_lines(durable, segments=True)
        if mine and (is_missing(self.rd.run_info) or (theirs and theirs[0] != mine[0])):
            # Another run's state: the run directory was deleted (or replaced) and this is a
            # new run. Kept aside, not merged, not deleted.
            aside = f"{self.rd.control}.set-aside-{int(time.time())}"
            os.rename(self.rd.control, aside)
            self.rd.make()
            (mine, read), set_aside = ([], 0), aside
        else:
            set_aside = None
        have_mine, have_theirs = set(mine), set(theirs)
        to_durable = [x for x in mine if x not in have_theirs]
        from_durable = [x for x in theirs if x not in have_mine]
        if to_durable:
            _makedirs_for(durable)
            append_lines(durable, b"".join(to_durable))
        if rewrite_local and (from_durable or len(mine) != len(have_mine)):
            os.makedirs(self.rd.control, exist_ok=True)
            merged = b"".join(theirs + to_durable)
            write_atomic(local, merged)
            read = len(merged)
        self._appended[JOURNAL_FILE] = (read, file_size(durable))
        src = os.path.join(self.rd.root, FAULTS_DIR)
        if os.path.isdir(src):
            os.makedirs(self.rd.faults, exist_ok=True)
            for name in os.listdir(src):
                dest = os.path.join(self.rd.faults, name)
                if not os.path.exists(dest) and ".tmp-" not in name:
                    with open(os.path.join(src, name), "rb") as f:
                        write_atomic(dest, f.read())
        return {"to_run_dir": len(to_durable), "from_run_dir": len(from_durable),
                "set_aside": set_aside}

    # ---------------------------------------------------------------- the thread
    def start(self) -> "ControlMirror":
        if self.mirrored:
            self._thread = threading.Thread(target=self._loop, name="control-mirror",
                                            daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        failed = 0
        while not self._stop.is_set():
            failed = 0 if self.sync() else failed + 1
            delay = CONTROL_SYNC_S if not failed else RETRY_WAIT(_Retry(failed))
            self.clock.wait(self._wake, delay)
            self._wake.clear()

    def flush(self, timeout: float) -> bool:
        """Mirror everything now, retrying until ``timeout``; True when nothing is held back."""
        deadline = self.clock.monotonic() + timeout
        while True:
            if self.sync():
                return True
            left = deadline - self.clock.monotonic()
            if left <= 0:
                return False
            self.clock.sleep(min(0.5, left))

    def stop(self, flush_timeout: float | None) -> bool:
        """Stop the thread after a last flush (none when ``flush_timeout`` is None); False (and
        a message) when something stays on the local disk only."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        if not self.mirrored or flush_timeout is None:
            return True
        done = self.flush(flush_timeout)
        if done and self.segment_s is not None:
            try:
                self._rotate()  # the whole journal in closed files
            except OSError as exc:
                log.warning(f"could not close the journal's last segment ({exc})")
        if not done:
            log.warning(f"the run directory {self.rd.root} is still unreachable: "
                        f"{self.held_back()} are kept in {self.rd.control}; starting the run "
                        f"again on this machine delivers them")
        return done

    # ---------------------------------------------------------------- one pass
    def sync(self) -> bool:
        """Mirror what changed; True when everything is in the run directory."""
        if not self.mirrored:
            return True
        with self._sync_lock:
            if not self.hold():
                return False
            held = self.held_back() if self.outage.down else None
            try:
                for rel, append in self._files():
                    (self._append_new if append else self._copy_changed)(rel)
                if self.outage.ok(held):
                    self._append_new(JOURNAL_FILE)  # run_dir_restored itself
            except OSError as exc:
                self.outage.failed(exc, during="mirroring the control state")
                return False
            return True

    def _files(self) -> list[tuple[str, bool]]:
        """(path relative to control, append-only?) of everything mirrored, journal last so
        that an event naming a log or record arrives after it."""
        out = [(heartbeat.FILE, False)]
        for sub in (ATTEMPTS_DIR, FAULTS_DIR):
            try:
                names = sorted(os.listdir(os.path.join(self.rd.control, sub)))
            except FileNotFoundError:
                continue
            out += [(os.path.join(sub, n), n.endswith(".log")) for n in names if ".tmp-" not in n]
        try:  # each other rank's heartbeat (`status` shows every rank's): rundir.rank_dir
            ranks = sorted(n for n in os.listdir(self.rd.control)
                           if rank_of(self.rd.control, os.path.join(self.rd.control, n)))
        except FileNotFoundError:
            ranks = []
        out += [(os.path.join(n, heartbeat.FILE), False) for n in ranks]
        return out + [(JOURNAL_FILE, True)]

    def _append_new(self, rel: str) -> None:
        src, dest = os.path.join(self.rd.control, rel), os.path.join(self.rd.root, rel)
        local_off, durable_size = self._appended.get(rel, (0, None))
        with open(src, "rb") as f:
            f.seek(local_off)
            data = f.read()
        if rel == JOURNAL_FILE:
            data = complete_lines(data)
        if durable_size is None or file_size(dest) != durable_size:
            self._resync(rel, src, dest)
            return
        if data:
            self._appended[rel] = (local_off + len(data), append_lines(dest, data))
            if rel == JOURNAL_FILE and self.segment_s is not None:
                now = self.clock.time()
                if self._live_since is None:
                    self._live_since = now
                elif now - self._live_since >= self.segment_s:
                    self._rotate()

    def _rotate(self) -> None:
        """Close the run directory's live journal into the next segment (written whole, once)
        and empty it. Cut short between the two, a line is in both: readers take it once."""
        live = os.path.join(self.rd.root, JOURNAL_FILE)
        with open(live, "rb") as f:
            data = complete_lines(f.read())
        if not data:
            return
        done = segment_paths(live)
        n = int(os.path.basename(done[-1])[:-6]) + 1 if done else 1
        os.makedirs(segments_dir(live), exist_ok=True)
        write_atomic(os.path.join(segments_dir(live), f"{n:06d}.jsonl"), data)
        write_atomic(live, b"")
        self._appended[JOURNAL_FILE] = (self._appended[JOURNAL_FILE][0], 0)
        self._live_since = None

    def _resync(self, rel: str, src: str, dest: str) -> None:
        """The durable copy is not what our last append left: merge (journal) or copy (log)."""
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if rel == JOURNAL_FILE:
            self.merge_on_start(rewrite_local=False)
            return
        with open(src, "rb") as f:
            data = f.read()
        write_atomic(dest, data, durable=False)
        self._appended[rel] = (len(data), len(data))

    def _copy_changed(self, rel: str) -> None:
        src, dest = os.path.join(self.rd.control, rel), os.path.join(self.rd.root, rel)
        try:
            st = os.stat(src)
            key = (st.st_size, st.st_mtime_ns)
            if self._copied.get(rel) == key:
                return
            with open(src, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return  # replaced between the listing and the read: the next pass has it
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        write_atomic(dest, data, durable=os.path.basename(rel) != heartbeat.FILE)  # liveness
        self._copied[rel] = key

    # ---------------------------------------------------------------- what is held back
    def held_back(self) -> dict:
        """What the run directory lacks now: journal events, log bytes, other files."""
        events = log_bytes = files = 0
        for rel, append in self._files() if self.mirrored else []:
            src = os.path.join(self.rd.control, rel)
            if append:
                behind = max(0, file_size(src) - self._appended.get(rel, (0, None))[0])
                if rel == JOURNAL_FILE:
                    try:
                        with open(src, "rb") as f:
                            f.seek(self._appended.get(rel, (0, None))[0])
                            events = f.read().count(b"\n")
                    except OSError:
                        events = -1
                else:
                    log_bytes += behind
            else:
                try:
                    st = os.stat(src)
                except FileNotFoundError:
                    continue
                files += self._copied.get(rel) != (st.st_size, st.st_mtime_ns)
        return {"events": events, "log_bytes": log_bytes, "files": files}


class _Retry:
    """The one field of tenacity's RetryCallState that ``wait_exponential`` reads."""

    def __init__(self, attempt_number: int):
        self.attempt_number = attempt_number



def _makedirs_for(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)

"""The run journal: an append-only ``events.jsonl`` in the run directory.

One JSON object a line, each written with a single ``write`` on an ``O_APPEND`` descriptor and
fsynced, so that a process killed mid-write leaves at most one torn last line, which the reader
skips. The journal is the history the status command, the report and the tests read.

The run directory may be a Google Drive mount that comes and goes: an append that fails with an
``OSError`` is held in memory and written, in order, before the next append that succeeds, so
losing Drive for a while neither kills the writer nor loses events (unless the process dies
before Drive is back).

In a run directory on a write-back cache (Drive on Colab, checkpoint/settle.py), a file appended
without pause may never be left alone long enough to be uploaded: there the control mirror
closes the journal into segments, ``events/000001.jsonl``, ... (each written once, whole), and
the live file holds only the lines since the last one. Readers read the segments in order, then
the live file; a line in both (a rotation cut short) is one event.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Iterator

log = logging.getLogger(__name__)

def segments_dir(path: str) -> str:
    """Where the closed segments of the journal at ``path`` are: a folder named as the file
    without its suffix (``events.jsonl`` -> ``events/``), so that another journal in the same
    folder (the outer loop's ``runtimes.jsonl``) never reads them as its own."""
    return os.path.splitext(path)[0]


def segment_paths(path: str) -> list[str]:
    """The closed segments of the journal at ``path``, in order (none: a plain journal)."""
    d = segments_dir(path)
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [os.path.join(d, n) for n in sorted(names)
            if n.endswith(".jsonl") and n[:-6].isdigit()]


def raw_lines(path: str) -> Iterator[bytes]:
    """Every line of a journal, its segments first, each line once, in order; a missing file
    has none. Lines are not parsed here."""
    seen: set[bytes] = set()
    segs = segment_paths(path)
    for p in segs + [path]:
        try:
            with open(p, "rb") as f:
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):
            continue
        for line in data.splitlines(keepends=True):
            if segs:
                key = line.rstrip(b"\n")
                if key in seen:
                    continue
                seen.add(key)
            yield line


def append_lines(path: str, data: bytes) -> int:
    """Append whole lines with one ``write`` on an ``O_APPEND`` descriptor, fsynced; a torn
    line left by a killed writer is ended first. Returns the file's size after the write."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
        return size + len(data)
    finally:
        os.close(fd)


class Journal:
    def __init__(self, path: str):
        self.path = path
        self.held: list[str] = []  # lines not yet written: the journal's folder was failing
        self._lock = threading.Lock()

    def append(self, event: str, **fields) -> dict:
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        line = json.dumps(record, sort_keys=False, default=str) + "\n"
        with self._lock:
            self.held.append(line)
            try:
                self._write("".join(self.held))
            except OSError as exc:
                if len(self.held) == 1:
                    log.warning(f"cannot write the journal {self.path} ({exc}); "
                                f"holding events until it is writable")
                return record
            self.held.clear()
        return record

    def relay(self, text: str) -> None:
        """Whole lines journaled by another process where this file cannot be seen (a rank on
        another node, supervise/relay.py), appended as they were written, held as ours are."""
        if not text:
            return
        with self._lock:
            self.held.append(text if text.endswith("\n") else text + "\n")
            try:
                self._write("".join(self.held))
            except OSError:
                return
            self.held.clear()

    def _write(self, text: str) -> None:
        append_lines(self.path, text.encode())

    def events(self, kind: str | None = None) -> list[dict]:
        return list(self.iter(kind))

    def iter(self, kind: str | None = None) -> Iterator[dict]:
        """Its events in order, closed segments first; a missing journal (or its folder gone
        a while: events are held) has none."""
        for line in raw_lines(self.path):
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # a torn last line from a killed writer
            if kind is None or record.get("event") == kind:
                yield record


class JournalTail:
    """A journal read as it grows: ``events()`` parses only the whole lines appended since the
    last call and returns every record so far. For a watcher polling a long run many times a
    second (the benchmark's), where rereading the whole file each time costs in proportion to
    its length: more CPU taken from the worker it measures late in a run than at its start."""

    def __init__(self, path: str):
        self.path = path
        self._offset = 0
        self._records: list[dict] = []

    def events(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:  # replaced: read it afresh
                    self._offset, self._records = 0, []
                f.seek(self._offset)
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return self._records
        end = data.rfind(b"\n") + 1  # a line still being written waits for its end
        for line in data[:end].splitlines():
            try:
                self._records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn line a killed writer left (the next append ended it)
        self._offset += end
        return self._records

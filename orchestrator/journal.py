"""The run journal: an append-only ``events.jsonl`` in the run directory.

One JSON object a line, each written with a single ``write`` on an ``O_APPEND`` descriptor and
fsynced, so that a process killed mid-write leaves at most one torn last line, which the reader
skips. The journal is the history the status command, the report and the tests read.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Iterator


class Journal:
    def __init__(self, path: str):
        self.path = path

    def append(self, event: str, **fields) -> dict:
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        line = json.dumps(record, sort_keys=False, default=str) + "\n"
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = "\n" + line  # end a torn line left by a killed writer
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return record

    def events(self, kind: str | None = None) -> list[dict]:
        return list(self.iter(kind))

    def iter(self, kind: str | None = None) -> Iterator[dict]:
        try:
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a torn last line from a killed writer
                    if kind is None or record.get("event") == kind:
                        yield record
        except FileNotFoundError:
            return


def host() -> str:
    return socket.gethostname()

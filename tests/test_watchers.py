"""The supervisor's folder watchers (supervise/slot.py ``watch``), on real inotify: a commit and a
heartbeat replaced reach the loop's queue, and the writes and reads around them (a checkpoint's
blobs written piece by piece and read back by the mirror, a log appended to) are not even
delivered to this process. Real waiting for the kernel's events: the integration tier."""
import os
import queue
import time
from types import SimpleNamespace

import pytest
from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from orchestrator.core import heartbeat
from orchestrator.core.osutil import write_json_atomic
from orchestrator.supervise.messages import Beat, Committed
from orchestrator.supervise.slot import watch

pytestmark = pytest.mark.integration


def _drain(q: queue.Queue, settle_s: float = 1.0) -> list:
    """What reached the queue until it has been quiet for ``settle_s``."""
    got, deadline = [], time.monotonic() + settle_s
    while time.monotonic() < deadline:
        try:
            got.append(q.get(timeout=0.05))
            deadline = time.monotonic() + settle_s
        except queue.Empty:
            pass
    return got


def test_a_commit_and_a_beat_reach_the_queue_and_the_writes_around_them_are_not_delivered(
        tmp_path, monkeypatch):
    delivered = []
    real = FileSystemEventHandler.dispatch
    monkeypatch.setattr(FileSystemEventHandler, "dispatch",
                        lambda self, event: (delivered.append(event), real(self, event)))
    local, durable, control = (tmp_path / n for n in ("local", "durable", "control"))
    for d in (local / "blobs" / "ab", durable, control / "attempts"):
        d.mkdir(parents=True)
    slot = SimpleNamespace(events=queue.Queue())
    observer = Observer()
    watch(observer, slot, SimpleNamespace(local=SimpleNamespace(root=str(local))),
          SimpleNamespace(checkpoints=str(durable), control=str(control)))
    try:
        time.sleep(0.2)  # the recursive watches are in place
        blob = local / "blobs" / "ab" / "abcdef"
        with open(blob, "wb") as f:  # a blob in 200 pieces, then read back 50 times
            for _ in range(200):
                f.write(b"x" * 4096)
                f.flush()
        for _ in range(50):
            blob.read_bytes()
        with open(control / "attempts" / "1.log", "a") as log:
            for i in range(200):
                log.write(f"line {i}\n")
                log.flush()
        _drain(slot.events, 0.5)
        around = [(e.event_type, os.path.basename(e.src_path)) for e in delivered]
        delivered.clear()
        tmp = local / ".tmp-0000000010"  # a commit: a folder renamed into place, its marker
        tmp.mkdir()
        os.rename(tmp, local / "0000000010")
        (local / "0000000010" / "COMMITTED").write_bytes(b"digest")
        write_json_atomic(str(control / heartbeat.FILE), {"attempt": 1}, durable=False)
        got = _drain(slot.events)
    finally:
        observer.stop()
        observer.join(timeout=5)
    assert {os.path.basename(x.path) for x in got if isinstance(x, Committed)} == {
        "0000000010", "COMMITTED"}  # the folder renamed into place, its marker
    assert [x.rank for x in got if isinstance(x, Beat)] == [0]
    # the 200 pieces, the 50 reads and the 200 log lines: their files' creations only
    assert sorted(around) == [("created", "1.log"), ("created", "abcdef")], around
    assert {e.event_type for e in delivered} <= {"created", "moved"}

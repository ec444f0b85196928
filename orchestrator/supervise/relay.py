"""A rank's control state relayed through Ray from the node it runs on to the supervisor.

Why: a rank writes its heartbeat, its journal and its log into the control folder on its own
node's local disk (core/rundir.py). On the supervisor's node that folder is the supervisor's
own, and the files are simply there. On any other node it is a folder of the same name that the
supervisor never sees: rank 0's hang went unnoticed there, its journal (``worker_ready``, the
faults it fired, its durable copies) and its log arrived, if at all, as the last 64 KiB at the
end of the attempt.

So the actor that runs the rank (rayengine.py) reads that folder on its node (``RankFiles``:
the newest heartbeat, the journal's and the log's new whole lines since a cursor) and answers a
long call from the supervisor with what changed; the supervisor ``deliver``s it: the beat to
its hang clock (``Beat`` with the record, whatever node the rank is on), the heartbeat file and
the journal lines into the same places of its own control folder (rank 0's journal lines into
the run's journal, as they would have been written on one machine), the log bytes into
``attempts/<n>.r<k>.log`` as they come (the stack dumps of a hang with them). A durable copy
made on the rank's node (its ``checkpoint_durable`` line) is told to the loop as ``Committed``:
a commit its rank told of with a beat may be waiting for that copy (ledger.py), and a shared
folder need not tell the supervisor of a write made on another node. On the
supervisor's own node (``node_key``: the same boot and mount namespace) only the beat is
relayed: the files are already there.

Plain objects, no Ray: the actor is a thin shell over ``RankFiles``, and both halves are tested
here without a process (tests/test_relay.py).
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

from orchestrator.core import heartbeat
from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal, append_lines
from orchestrator.core.osutil import complete_lines, file_size, read_json, write_json_atomic
from orchestrator.core.rundir import JOURNAL_FILE
from orchestrator.supervise.messages import Beat, Committed

# How often the node side looks at the files while a call waits: beats are coalesced to this
# (a hang timeout is tens of seconds), and a log line reaches the supervisor this late at most.
POLL_S = 0.25
# The most bytes of a journal or a log one answer carries (the rest comes with the next).
CHUNK = 1 << 20


def node_key() -> str:
    """Which machine and which filesystem view this process has: two processes with the same
    key see the same files at the same paths (a node of the test cluster differs from the
    supervisor's by its mount namespace alone, a real node by its boot id too)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = os.uname().nodename
    try:
        ns = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        ns = 0
    return f"{boot}:{ns}"


@dataclass
class Cursor:
    """What the supervisor has of a rank's files: the last beat's time, the bytes read."""

    beat: float = 0.0
    journal: int = 0
    log: int = 0


def _new_lines(path: str, offset: int) -> bytes:
    """Whole lines of ``path`` from ``offset`` (a torn last line waits for its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(CHUNK)
    except OSError:
        return b""
    # (a line longer than a chunk goes in pieces rather than never)
    return data if len(data) == CHUNK and b"\n" not in data else complete_lines(data)


class RankFiles:
    """The node's side: a rank's control folder (``control``: RunDir.for_rank there) and log.
    ``files``: relay the journal and the log too (the rank is not on the supervisor's node)."""

    def __init__(self, control: str, log: str, files: bool, clock: Clock = SYSTEM,
                 poll_s: float = POLL_S):
        self.heartbeat = os.path.join(control, heartbeat.FILE)
        self.journal, self.log = os.path.join(control, JOURNAL_FILE), log
        self.files, self.clock, self.poll_s = files, clock, poll_s

    def cursor(self) -> Cursor:
        """Now, before the rank starts: what earlier attempts left on this node is not news."""
        beat = read_json(self.heartbeat) or {}
        return Cursor(float(beat.get("time", 0.0)), file_size(self.journal), file_size(self.log))

    def read(self, cur: Cursor) -> tuple[Cursor, dict]:
        """What changed since ``cur``: ``beat`` (the record), ``journal`` and ``log`` (bytes)."""
        out: dict = {}
        beat = read_json(self.heartbeat)
        if beat and float(beat.get("time", 0.0)) > cur.beat:
            out["beat"] = beat
            cur = Cursor(float(beat["time"]), cur.journal, cur.log)
        if self.files:
            lines = _new_lines(self.journal, cur.journal)
            log = _new_lines(self.log, cur.log)
            if lines:
                out["journal"] = lines
            if log:
                out["log"] = log
            cur = Cursor(cur.beat, cur.journal + len(lines), cur.log + len(log))
            if out:
                out["files"] = True
        return cur, out

    def next(self, cur: Cursor, timeout: float) -> tuple[Cursor, dict]:
        """``read``, waiting up to ``timeout`` for something to change."""
        deadline = self.clock.monotonic() + timeout
        while True:
            cur, out = self.read(cur)
            if out or self.clock.monotonic() >= deadline:
                return cur, out
            self.clock.sleep(self.poll_s)


def durable_copies(text: str) -> list[str]:
    """The paths of the durable copies that the journal lines ``text`` say were made."""
    out = []
    for line in text.splitlines():
        if Event.CHECKPOINT_DURABLE not in line:
            continue
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and e.get("event") == Event.CHECKPOINT_DURABLE:
            out.append(str(e.get("path", "")))
    return out


class Delivery:
    """The supervisor's side, for one rank: where what the node relayed goes here.
    ``control``: the rank's control folder here (RunDir.for_rank); ``log``: its attempt log;
    ``journal``: the run's (rank 0's lines go there); ``events``: the loop's queue."""

    def __init__(self, rank: int, control: str, log: str, journal: Journal, events):
        self.rank, self.control, self.log = rank, control, log
        self.journal, self.events = journal, events
        self._lock = threading.Lock()

    def __call__(self, updates: dict) -> None:
        with self._lock:
            beat = updates.get("beat")
            if "journal" in updates or "log" in updates or (beat and updates.get("files")):
                os.makedirs(self.control, exist_ok=True)
            if updates.get("files") and beat:  # `status` reads it here
                write_json_atomic(os.path.join(self.control, heartbeat.FILE), beat,
                                  durable=False)
            if updates.get("journal"):
                text = updates["journal"].decode("utf-8", "replace")
                if self.rank == 0:
                    self.journal.relay(text)
                else:
                    append_lines(os.path.join(self.control, JOURNAL_FILE), text.encode())
                for path in durable_copies(text):
                    self.events.put(Committed(path))
            if updates.get("log"):
                os.makedirs(os.path.dirname(self.log), exist_ok=True)
                with open(self.log, "ab") as f:
                    f.write(updates["log"])
            if beat:
                self.events.put(Beat(self.rank, beat))

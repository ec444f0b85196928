import json
import os
import subprocess
import sys

import pytest

from orchestrator.core.journal import Journal, JournalTail
from orchestrator.core.lock import LockedError, RunLock


def test_journal_appends_and_skips_a_torn_line(tmp_path):
    j = Journal(str(tmp_path / "events.jsonl"))
    j.append("a", x=1)
    with open(j.path, "a") as f:
        f.write('{"ts": 1, "event": "tor')  # a writer killed mid-line
    j.append("b", x=2)
    assert [(e["event"], e["x"]) for e in j.events()] == [("a", 1), ("b", 2)]
    assert [e["event"] for e in j.events("b")] == ["b"]


def test_a_tail_reads_only_what_was_appended_and_the_same_records_as_a_full_read(tmp_path,
                                                                            monkeypatch):
    j = Journal(str(tmp_path / "events.jsonl"))
    tail = JournalTail(j.path)
    assert tail.events() == []  # no journal yet
    j.append("a", x=1)
    with open(j.path, "a") as f:
        f.write('{"ts": 1, "event": "tor')  # a writer killed mid-line: waits, then is skipped
    assert [e["event"] for e in tail.events()] == ["a"]
    parsed = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda b: parsed.append(b) or real(b))
    j.append("b", x=2)
    tailed = [e["event"] for e in tail.events()]
    by_tail = list(parsed)
    assert tailed == ["a", "b"] == [e["event"] for e in j.events()]
    assert [b'"event": "b"' in p for p in by_tail] == [False, True]  # the torn one, then b:
    assert not any(b'"event": "a"' in p for p in by_tail)  # "a" was not parsed again
    os.replace(str(tmp_path / "events.jsonl"), str(tmp_path / "old.jsonl"))
    Journal(j.path).append("c")  # replaced by a shorter file: read afresh
    assert [e["event"] for e in tail.events()] == ["c"]


def test_journal_holds_events_while_its_folder_fails_then_writes_them_in_order(tmp_path,
                                                                              capsys):
    import errno

    from drivefaults import DriveFaults
    from orchestrator.core.heartbeat import HeartbeatWriter

    (tmp_path / "run").mkdir()
    j = Journal(str(tmp_path / "run" / "events.jsonl"))
    beat = HeartbeatWriter(str(tmp_path / "run"), attempt=1, interval=0)
    j.append("a")
    with DriveFaults(str(tmp_path / "run")) as drive:
        drive.down(errno.ENOTCONN)  # Drive, holding the whole run dir, is gone
        j.append("b")
        j.append("c")
        assert not beat.beat(force=True) and beat.last_error.errno == errno.ENOTCONN
        assert [json.loads(x)["event"] for x in j.held] == ["b", "c"]
    assert "Transport endpoint is not connected" in capsys.readouterr().err
    assert [e["event"] for e in j.events()] == ["a"]
    j.append("d")
    assert [e["event"] for e in j.events()] == ["a", "b", "c", "d"] and not j.held
    assert beat.beat(force=True)


def test_journal_of_missing_file_is_empty(tmp_path):
    assert Journal(str(tmp_path / "none.jsonl")).events() == []


def test_lock_excludes_a_live_owner(tmp_path):
    a = RunLock(str(tmp_path))
    assert a.acquire() is None
    with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
        RunLock(str(tmp_path)).acquire()
    a.release()
    assert not os.path.exists(a.path)
    b = RunLock(str(tmp_path))
    assert b.acquire() is None
    b.release()


@pytest.mark.integration
def test_stale_lock_of_dead_owner_is_taken_over(tmp_path):
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True)
    dead_pid = int(p.stdout)
    with open(tmp_path / "lock", "w") as f:
        json.dump({"host": os.uname().nodename, "pid": dead_pid, "refreshed": 0}, f)
    taken = RunLock(str(tmp_path)).acquire()
    assert taken["pid"] == dead_pid and "not running" in taken["reason"]


def test_lock_of_other_host_goes_stale_only_when_silent(tmp_path):
    import time

    with open(tmp_path / "lock", "w") as f:
        json.dump({"host": "elsewhere", "pid": 1, "refreshed": time.time()}, f)
    with pytest.raises(LockedError, match="host elsewhere"):
        RunLock(str(tmp_path), stale_after=60).acquire()
    with open(tmp_path / "lock", "w") as f:
        json.dump({"host": "elsewhere", "pid": 1, "refreshed": time.time() - 120}, f)
    taken = RunLock(str(tmp_path), stale_after=60).acquire()
    assert "silent" in taken["reason"]


def _lock_of(tmp_path, pid, identity, refreshed=0.0):
    with open(tmp_path / "lock", "w") as f:
        json.dump({"host": os.uname().nodename, "pid": pid, "identity": identity,
                   "refreshed": refreshed}, f)


@pytest.mark.integration
def test_lock_whose_owner_pid_is_now_another_process_is_taken_over(tmp_path):
    """The owner died and a stranger got its pid: alive, but not the owner (core/procid.py)."""
    import dataclasses

    from orchestrator.core.procid import ProcessIdentity

    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        now = ProcessIdentity.of(stranger.pid, settle_s=1.0)
        owner = dataclasses.replace(now, start_ticks=now.start_ticks - 1,
                                    cmdline=(sys.executable, "-m", "orchestrator", "run"))
        _lock_of(tmp_path, stranger.pid, owner.record())
        taken = RunLock(str(tmp_path)).acquire()
        assert taken["pid"] == stranger.pid and "is another process now" in taken["reason"]
        assert stranger.poll() is None  # a lock takes over; it signals nobody
    finally:
        stranger.kill()
        stranger.wait()


def test_lock_of_this_host_in_another_boot_goes_stale_only_when_silent(tmp_path):
    """Same host name, another boot id: a recycled VM of that name may still hold it, or
    this machine before a reboot: only silence tells, as for another host."""
    import time

    from orchestrator.core.procid import ProcessIdentity

    me = ProcessIdentity.of(os.getpid())
    other_boot = dict(me.record(), boot_id="0" * 36)
    _lock_of(tmp_path, 999_999_999, other_boot, refreshed=time.time())  # no such pid here
    with pytest.raises(LockedError, match="last seen"):
        RunLock(str(tmp_path), stale_after=60).acquire()
    _lock_of(tmp_path, 999_999_999, other_boot, refreshed=time.time() - 120)
    taken = RunLock(str(tmp_path), stale_after=60).acquire()
    assert "another boot" in taken["reason"] and "silent" in taken["reason"]

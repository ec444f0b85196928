"""A journaled pid is signalled only while it is still the process we started (core/procid.py)."""
import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration  # real processes: a bystander, a dead run's leftovers

from orchestrator.core.procid import ProcessIdentity, boot_id, signal_proven


@pytest.fixture
def bystander():
    """A plain process that leads its own group, as a stranger holding a reused pid would."""
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield p
    if p.poll() is None:
        p.kill()
    p.wait()


def _identity(p):
    """As a spawn takes it: the command line may read empty a moment after exec."""
    return ProcessIdentity.of(p.pid, settle_s=1.0)


def test_a_live_process_is_itself(bystander):
    me = _identity(bystander)
    assert me is not None and me.cmdline == ("sleep", "600") and me.boot_id == boot_id()
    assert me.differs() is None and me.matches()
    assert ProcessIdentity.from_record(me.pid, me.record()) == me


def test_another_start_time_is_another_process(bystander):
    me = _identity(bystander)
    other = dataclasses.replace(me, start_ticks=me.start_ticks - 7)
    assert "is another process now: started at tick" in other.differs()
    assert not other.matches()


def test_another_command_line_is_another_process(bystander):
    other = dataclasses.replace(_identity(bystander),
                                cmdline=(sys.executable, "-m", "orchestrator.train.worker"))
    assert "runs another command line: 'sleep 600'" in other.differs()


def test_another_boot_is_another_process(bystander):
    other = dataclasses.replace(_identity(bystander), boot_id="0" * 36)
    assert "started in another boot" in other.differs()


def test_a_process_gone_is_not_running():
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    me = _identity(p)
    p.kill()
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped
    assert me.differs() == f"pid {p.pid} has exited (a zombie not yet reaped)"
    p.wait()
    assert me.differs() == f"pid {p.pid} is not running"
    assert ProcessIdentity.of(p.pid) is None


def test_no_identity_recorded_is_none():
    assert ProcessIdentity.from_record(123, None) is None
    assert ProcessIdentity.from_record(123, {"start_ticks": 1}) is None  # torn or older record
    assert ProcessIdentity.from_record(None, {"start_ticks": 1, "boot_id": "b",
                                              "cmdline": []}) is None


def _dead_within(p, seconds=5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return True
        time.sleep(0.02)
    return False


def test_signal_proven_leaves_a_stranger_alone_and_kills_its_own(bystander):
    me = _identity(bystander)
    stranger = dataclasses.replace(me, start_ticks=me.start_ticks + 1)
    assert "another process" in signal_proven(stranger, signal.SIGKILL)
    assert "no identity was recorded" in signal_proven(None, signal.SIGKILL)
    assert not _dead_within(bystander, 0.3)
    assert signal_proven(me, signal.SIGKILL) is None
    assert _dead_within(bystander) and bystander.returncode == -signal.SIGKILL


def test_a_dead_runs_leftovers_are_killed_only_when_proven_its_own(tmp_path, bystander):
    """kill_orphans (supervise/attempt.py) over a dead run's journal: a rank of its unended
    group attempt and its unpromoted standby, spawned as the supervisor spawns them, are
    killed; a rank whose pid a stranger holds, one on another host and a promoted standby
    are left alone (the first two journaled with why)."""
    from orchestrator.core.journal import Journal
    from orchestrator.supervise.procs import identity_record, kill_orphans, spawn

    here = os.uname().nodename
    log = str(tmp_path / "w.log")
    rank0, standby = spawn(["sleep", "601"], None, None, log), spawn(["sleep", "602"], None,
                                                                    None, log)
    # a rank that held the bystander's pid before it: another start tick (both processes here
    # may have started within one 10 ms tick), another command line
    stranger = dataclasses.replace(rank0.identity, pid=bystander.pid,
                                   start_ticks=_identity(bystander).start_ticks - 1).record()
    events = [
        {"event": "run_resumed"},
        {"event": "attempt_started", "attempt": 4, "pid": rank0.pid, "host": here,
         "workers": [{"rank": 0, "pid": rank0.pid, "host": here,
                      "identity": identity_record(rank0)},
                     {"rank": 1, "pid": bystander.pid, "host": here, "identity": stranger},
                     {"rank": 2, "pid": 4242, "host": "elsewhere", "identity": stranger}]},
        {"event": "standby_started", "for_attempt": 4, "pid": bystander.pid, "host": here,
         "identity": _identity(bystander).record()},
        {"event": "standby_promoted", "attempt": 4, "pid": bystander.pid},
        {"event": "standby_started", "for_attempt": 5, "pid": standby.pid, "host": here,
         "identity": identity_record(standby)},
    ]
    journal = Journal(str(tmp_path / "events.jsonl"))
    try:
        kill_orphans(events, journal)
        assert _dead_within(rank0) and _dead_within(standby)
        assert bystander.poll() is None
        got = [(e["event"], e.get("rank", e.get("standby_for_attempt")), e["pid"])
               for e in journal.events()]
        assert got == [("orphan_worker_killed", 0, rank0.pid),
                       ("process_left_alone", 1, bystander.pid),
                       ("process_left_alone", 2, 4242),
                       ("orphan_worker_killed", 5, standby.pid)]
        left = journal.events("process_left_alone")
        assert "is another process now" in left[0]["reason"]
        assert "host elsewhere" in left[1]["reason"]
    finally:
        for p in (rank0, standby):
            p.kill()
            p.wait()

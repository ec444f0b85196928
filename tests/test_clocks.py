"""The supervisor's timers on a clock moved by hand (core/clock.py): the lease that pauses a
worker, the hang clock, the run directory's outage, the flush's deadline, the durable mirror's
backoff and remounts. What the integration tests prove with real processes and seconds of real
waiting (test_run_dir_outage.py, test_supervisor_recovery.py), here in microseconds."""
import errno
import signal
import threading

import pytest

from helpers import FakeClock
from orchestrator.core import heartbeat
from orchestrator.core.journal import Journal
from orchestrator.core.lock import Lease, LockLost
from orchestrator.core.rundir import RunDir
from orchestrator.core.outage import Outage
from orchestrator.supervise.controlmirror import ControlMirror
from orchestrator.supervise.hangs import HangClock
from orchestrator.supervise.lease import LeaseKeeper


def _names(journal):
    return [e["event"] for e in journal.events()]


class _Lock:
    """A RunLock whose refresh answers what the test says: None (written), an OSError (the
    run directory is down) or LockLost (another supervisor's token is in the file)."""

    def __init__(self):
        self.answer = None

    def refresh(self):
        if isinstance(self.answer, LockLost):
            raise self.answer
        return self.answer


@pytest.fixture
def keeper(tmp_path, said):
    clock = FakeClock()
    journal = Journal(str(tmp_path / "events.jsonl"))
    signals, lost = [], []
    hang = HangClock(str(tmp_path), hang_timeout=30, startup_timeout=60, clock=clock)
    lease = Lease(stale_after=8.0, clock=clock)  # refresh every 1 s, lease 6 s
    k = LeaseKeeper(_Lock(), lease, Outage(journal, str(tmp_path), clock=clock),
                    journal, hang, lambda sig: signals.append(sig) or 4242, lost.append,
                    clock=clock)
    return k, clock, journal, signals, lost, said


def test_a_lease_is_due_for_refresh_then_expires_by_the_clock():
    clock = FakeClock()
    lease = Lease(stale_after=8.0, clock=clock)
    assert (lease.refresh_s, lease.lease_s) == (1.0, 6.0)
    assert not lease.due() and not lease.expired()
    clock.advance(1.0)
    assert lease.due() and not lease.expired()
    clock.advance(5.0)
    assert lease.expired()
    lease.renewed()
    assert not lease.due() and not lease.expired()


def test_the_worker_is_paused_past_the_lease_and_goes_on_when_the_lock_is_ours(keeper):
    k, clock, journal, signals, lost, said = keeper
    assert k.hold()  # not due: no refresh, the run directory may be written
    k.lock.answer = OSError(errno.ENOTDIR, "Not a directory")
    clock.advance(1.0)
    assert not k.hold() and signals == []  # refresh failed: an outage, no pause yet
    assert _names(journal) == ["run_dir_unreachable"]
    clock.advance(5.0)
    assert not k.hold()  # 6 s without a refresh: past the lease
    assert signals == [signal.SIGSTOP] and not k.held.is_set() and k.hang.paused
    assert k.hang.remaining() == float("inf")  # a stopped worker is no hang
    clock.advance(30.0)
    k.lock.answer = None
    assert k.hold()
    assert signals == [signal.SIGSTOP, signal.SIGCONT] and k.held.is_set()
    assert not k.hang.paused and k.hang.remaining() == 60.0  # its silence was ours
    paused = [e for e in journal.events() if e["event"] == "worker_resumed"]
    assert paused[0]["paused_s"] == 30.0 and "after 30 s paused" in said[-1]
    assert lost == []


def test_a_lock_taken_over_during_the_outage_is_told_once_and_nothing_more_is_written(keeper):
    k, clock, journal, signals, lost, said = keeper
    k.lock.answer = LockLost({"pid": 7, "host": "vm-b", "token": "theirs"})
    clock.advance(1.0)
    assert not k.hold()
    assert not k.hold()  # lost stays lost, without asking the lock again
    assert len(lost) == 1 and _names(journal) == ["lock_lost"]


def test_wait_held_returns_false_once_stopped_while_paused(keeper):
    k, clock, journal, signals, lost, said = keeper
    k.held.clear()
    stopped = threading.Event()
    stopped.set()
    assert k.wait_held(stopped) is False
    assert clock.slept == [0.5]  # one wait on the clock, none in real time


def test_the_hang_clock_gives_the_startup_timeout_then_the_hang_timeout(tmp_path):
    clock = FakeClock()
    hang = HangClock(str(tmp_path), hang_timeout=30, startup_timeout=600, clock=clock)
    hang.start(3)
    clock.advance(100)
    assert hang.remaining() == 500 and not hang.training
    (tmp_path / heartbeat.FILE).write_text(
        '{"attempt": 3, "phase": "training", "time": %r}' % (clock.time() - 2))
    hang.beat()
    assert hang.training and hang.stepped and hang.remaining() == 30
    assert hang.age() == 2.0  # by the beat's own timestamp
    clock.advance(31)
    assert hang.remaining() < 0


def test_the_first_step_s_trace_and_compile_are_start_up_not_a_hang(tmp_path):
    """train_begin comes before the first step, whose trace and XLA compilation may outlast
    the hang timeout: the start-up timeout still applies until a step is done."""
    clock = FakeClock()
    hang = HangClock(str(tmp_path), hang_timeout=30, startup_timeout=600, clock=clock)
    hang.start(3)
    (tmp_path / heartbeat.FILE).write_text('{"attempt": 3, "phase": "train_begin", "time": 1}')
    hang.beat()
    clock.advance(100)
    assert not hang.training and hang.remaining() == 500
    (tmp_path / heartbeat.FILE).write_text('{"attempt": 3, "phase": "epoch_end", "time": 2}')
    hang.beat()
    assert hang.training and hang.remaining() == 30


def test_a_beat_of_another_attempt_does_not_reset_the_hang_clock(tmp_path):
    clock = FakeClock()
    hang = HangClock(str(tmp_path), hang_timeout=30, startup_timeout=60, clock=clock)
    hang.start(4)
    clock.advance(50)
    (tmp_path / heartbeat.FILE).write_text('{"attempt": 3, "phase": "training", "time": 1}')
    hang.beat()
    assert hang.remaining() == 10 and not hang.training


def test_an_outage_is_journaled_once_with_its_length_by_the_clock(tmp_path, said):
    clock = FakeClock()
    journal = Journal(str(tmp_path / "events.jsonl"))
    outage = Outage(journal, str(tmp_path), clock=clock)
    outage.failed(OSError(errno.ENOTCONN, "Transport endpoint is not connected"), during="x")
    clock.advance(42.0)
    outage.failed(OSError(errno.ENOTCONN, "Transport endpoint is not connected"), during="y")
    assert outage.down and outage.failures == 2
    assert outage.ok({"journal_lines": 3}) and not outage.ok()
    restored = journal.events()[-1]
    assert _names(journal) == ["run_dir_unreachable", "run_dir_restored"]
    assert restored["outage_s"] == 42.0 and restored["held_back"] == {"journal_lines": 3}
    assert said[-1] == "the run directory is back after 42 s"


def test_a_flush_retries_every_half_second_until_its_deadline(tmp_path):
    clock = FakeClock()
    rd = RunDir(str(tmp_path / "run"), str(tmp_path / "local-control"))
    rd.make()
    m = ControlMirror(rd, Outage(Journal(rd.journal), rd.root, clock=clock),
                      clock=clock)
    m.sync = lambda: False  # the run directory never answers
    assert m.flush(1.2) is False
    assert clock.slept == [0.5, 0.5, pytest.approx(0.2)]


def test_the_durable_mirror_backs_off_and_remounts_once_a_minute(tmp_path):
    from orchestrator.checkpoint.mirror import DurableMirror
    from orchestrator.checkpoint.store import Retention
    from orchestrator.checkpoint.tiers import TieredStore

    clock, remounts = FakeClock(), []
    store = TieredStore(str(tmp_path / "local"), str(tmp_path / "durable"))
    journal = Journal(str(tmp_path / "events.jsonl"))
    m = DurableMirror(store, journal, Retention(3), backoff_initial=1.0, backoff_max=8.0,
                      remount=remounts.append, remount_every_s=60.0, clock=clock)
    calls = []

    def gone():
        calls.append(clock.time())
        if len(calls) < 12:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    m._with_retries(gone, None)  # returns once the tier answers (call 12)
    waits = [b - a for a, b in zip(calls, calls[1:])]
    assert waits[:5] == [1.0, 2.0, 4.0, 8.0, 8.0]  # exponential, capped at backoff_max
    assert len(remounts) == 2  # at the first ENOTCONN, then once 60 s had passed
    assert _names(journal).count("durable_unreachable") == 1
    assert remounts[0] == store.durable.root

"""A rank's heartbeat, journal and log relayed from its node (supervise/relay.py), and the hang
clock on the slowest rank (supervise/hangs.py): no process, no Ray, no real waiting (a clock
moved by hand). The Ray actor around ``RankFiles`` is the e2e test's
(tests/test_e2e_multiworker.py, a three-node cluster with a private /tmp per node)."""
import json
import queue

from helpers import FakeClock
from orchestrator.core import heartbeat
from orchestrator.core.journal import Journal
from orchestrator.core.rundir import JOURNAL_FILE
from orchestrator.supervise.hangs import HangClock, HeartbeatEvents
from orchestrator.supervise.messages import Beat
from orchestrator.supervise.relay import Cursor, Delivery, RankFiles


def _beat(folder, attempt, t, phase="training", step=1):
    (folder / heartbeat.FILE).write_text(json.dumps(
        {"attempt": attempt, "phase": phase, "time": t, "step": step, "rss": 123}))


def _sides(tmp_path, files=True):
    """A rank's control folder on its node, and the supervisor's (separate: another /tmp)."""
    node, here = tmp_path / "node", tmp_path / "here"
    (node / "attempts").mkdir(parents=True)
    (here / "attempts").mkdir(parents=True)
    clock = FakeClock()
    rank = RankFiles(str(node), str(node / "attempts" / "2.log"), files, clock=clock)
    q = queue.Queue()
    deliver = Delivery(0, str(here), str(here / "attempts" / "2.log"),
                       Journal(str(here / JOURNAL_FILE)), q)
    return node, here, rank, deliver, q, clock


def test_a_remote_rank_s_beat_journal_and_log_reach_the_supervisor_s_folder(tmp_path):
    node, here, rank, deliver, q, clock = _sides(tmp_path)
    (node / JOURNAL_FILE).write_text('{"event": "from_an_earlier_attempt"}\n')
    cur = rank.cursor()  # before the rank starts: what was there is not news
    _beat(node, 2, clock.time(), step=7)
    (node / JOURNAL_FILE).open("a").write('{"event": "worker_ready"}\n{"event": "to')
    (node / "attempts" / "2.log").write_text("epoch 1/2\n")
    cur, updates = rank.next(cur, timeout=5.0)
    deliver(updates)
    item = q.get_nowait()
    assert isinstance(item, Beat) and item.rank == 0 and item.record["step"] == 7
    assert heartbeat.read(str(here))["step"] == 7  # `status` reads it here
    assert [e["event"] for e in Journal(str(here / JOURNAL_FILE)).events()] == ["worker_ready"]
    assert (here / "attempts" / "2.log").read_text() == "epoch 1/2\n"
    # the torn line waits for its end; a stack dump appended to the log comes with it
    (node / JOURNAL_FILE).open("a").write('rn"}\n')
    (node / "attempts" / "2.log").open("a").write("Thread 0x01 (most recent call first):\n")
    cur, updates = rank.next(cur, timeout=5.0)
    deliver(updates)
    assert [e["event"] for e in Journal(str(here / JOURNAL_FILE)).events()] == [
        "worker_ready", "torn"]
    assert "most recent call first" in (here / "attempts" / "2.log").read_text()
    assert q.empty()  # the same beat is not told twice


def test_a_rank_that_writes_nothing_is_waited_for_on_the_clock_then_nothing_is_told(tmp_path):
    node, here, rank, deliver, q, clock = _sides(tmp_path)
    cur = rank.cursor()
    t0 = clock.monotonic()
    cur2, updates = rank.next(cur, timeout=2.0)
    assert updates == {} and cur2 == cur and clock.monotonic() - t0 >= 2.0
    deliver(updates)
    assert q.empty() and not (here / JOURNAL_FILE).exists()


def test_on_the_supervisor_s_node_only_the_beat_is_relayed(tmp_path):
    """Same boot and mount namespace: the files are already here; writing them again would
    journal every line twice."""
    node, here, rank, deliver, q, clock = _sides(tmp_path, files=False)
    cur = rank.cursor()
    _beat(node, 2, clock.time())
    (node / JOURNAL_FILE).write_text('{"event": "worker_ready"}\n')
    cur, updates = rank.next(cur, timeout=1.0)
    assert set(updates) == {"beat"}
    deliver(updates)
    assert q.get_nowait().record["attempt"] == 2
    assert not (here / JOURNAL_FILE).exists() and heartbeat.read(str(here)) is None


def test_the_hang_clock_runs_on_the_slowest_rank_wherever_its_beats_come_from(tmp_path):
    """Rank 0 keeps beating (a relayed record); rank 1 went silent (stuck in a collective, on
    another node): the group is hung at rank 1's timeout, and rank 1 is the one named."""
    clock = FakeClock()
    hang = HangClock(str(tmp_path), hang_timeout=20, startup_timeout=600, clock=clock)
    hang.start(5, ranks=2)
    for rank in (0, 1):
        hang.beat(rank, {"attempt": 5, "phase": "training", "time": clock.time()})
    assert hang.training and hang.remaining() == 20
    for _ in range(5):
        clock.advance(5)
        hang.beat(0, {"attempt": 5, "phase": "training", "time": clock.time()})
    assert hang.remaining() < 0 and hang.silent() == 1
    assert hang.ages() == {0: 0.0, 1: 25.0} and hang.age() == 25.0


def test_a_rank_still_starting_keeps_the_startup_timeout_while_the_other_trains(tmp_path):
    clock = FakeClock()
    hang = HangClock(str(tmp_path), hang_timeout=20, startup_timeout=600, clock=clock)
    hang.start(1, ranks=2)
    hang.beat(0, {"attempt": 1, "phase": "training", "time": clock.time()})
    clock.advance(100)
    assert not hang.training and hang.silent() == 0 and hang.remaining() == -80
    while clock.monotonic() - hang.ranks[1].last < 600:  # rank 0 beats; rank 1 starts up
        hang.beat(0, {"attempt": 1, "phase": "training", "time": clock.time()})
        assert hang.remaining() > 0
        clock.advance(10)
    assert hang.remaining() <= 0 and hang.silent() == 1 and hang.timeout == 600


def test_a_rank_s_heartbeat_file_here_is_heard_as_that_rank_s_beat(tmp_path):
    """The local engine's path: rank k's file in ``rank-k/`` of the control folder."""
    q = queue.Queue()
    events = HeartbeatEvents(q, str(tmp_path))
    events._check(str(tmp_path / "rank-1" / heartbeat.FILE))
    events._check(str(tmp_path / heartbeat.FILE))
    events._check(str(tmp_path / "attempts" / "1.log"))
    events._check(str(tmp_path / "elsewhere" / heartbeat.FILE))
    assert [b.rank for b in (q.get_nowait(), q.get_nowait())] == [1, 0] and q.empty()
    clock = FakeClock()
    hang = HangClock(str(tmp_path), hang_timeout=20, startup_timeout=60, clock=clock)
    hang.start(2, ranks=2)
    (tmp_path / "rank-1").mkdir()
    clock.advance(30)
    _beat(tmp_path / "rank-1", 2, clock.time())
    hang.beat(1)  # read from rank 1's file
    assert hang.ages() == {0: 30.0, 1: 0.0}

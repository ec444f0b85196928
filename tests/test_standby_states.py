"""The standby's life as a state machine (supervise/standby.StandbyState), its moves made
through the keeper's listener and the fake engine (tests/fakes/engine.py): no process."""
import os
import queue
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fakes"))

from engine import FakeEngine  # noqa: E402
from helpers import FakeClock  # noqa: E402
from orchestrator.core.journal import Journal  # noqa: E402
from orchestrator.core.rundir import RunDir  # noqa: E402
from orchestrator.core.specload import load  # noqa: E402
from orchestrator.supervise.standby import Standby, StandbyKeeper  # noqa: E402
from orchestrator.supervise.standby import StandbyState as S  # noqa: E402

# The docstring's table, written out again: (from, to) pairs that are allowed
ALLOWED = {(S.STARTED, S.READY), (S.STARTED, S.ADOPTED), (S.STARTED, S.DISCARDED),
           (S.STARTED, S.LOST), (S.READY, S.PROMOTED), (S.READY, S.DISCARDED),
           (S.READY, S.LOST)}


@pytest.fixture
def world(fake_job):
    """(spec, run layout, journal, fake engine, queue) of a job with ``standby: on``."""
    def make(plan=None):
        spec = load(fake_job(extra="strategy: cpu\n            standby: on"))
        rd = RunDir.for_spec(spec)
        rd.make()
        engine = FakeEngine(spec, FakeClock(), plan)
        return spec, rd, Journal(rd.journal), engine, queue.Queue()
    return make


def _standby(world, plan=None, for_attempt=2):
    spec, rd, journal, engine, events = world(plan)
    sb = Standby(for_attempt, "warm", ["fake", "--attempt", str(for_attempt), "--standby",
                                       "warm"], {}, spec.job_dir, rd.standby_log(for_attempt),
                 events, journal, engine)
    return sb.start(), rd, journal, events


@pytest.mark.parametrize("start", list(S))
@pytest.mark.parametrize("to", list(S))
def test_each_move_is_allowed_only_as_the_table_says(start, to):
    sb = Standby(2, "warm", [], {}, "", "", queue.Queue(), None, engine=object())
    sb.state = start
    if (start, to) in ALLOWED:
        sb.move(to)
        assert sb.state is to
    else:
        with pytest.raises(ValueError, match=f"{start.value} cannot become {to.value}"):
            sb.move(to)
        assert sb.state is start


def test_only_a_started_or_ready_standby_is_live():
    assert {s for s in S if s.live} == {S.STARTED, S.READY}


def test_a_ready_standby_promoted_is_the_attempt_with_its_log(world):
    sb, rd, journal, _ = _standby(world)
    assert sb.state is S.STARTED
    assert sb.ready() and sb.state is S.READY  # it journaled standby_ready
    member = sb.promote(2, rd.attempt_log(2))
    assert sb.state is S.PROMOTED and member is sb.member
    assert member.log == rd.attempt_log(2) and os.path.exists(rd.attempt_log(2))
    assert sb.proc.stdin.lines == [b'{"attempt": 2}\n']


def test_one_promoted_while_warming_up_is_adopted(world):
    sb, rd, _, _ = _standby(world, {"standby_cold": True})
    assert not sb.ready()
    sb.promote(2, rd.attempt_log(2))
    assert sb.state is S.ADOPTED


def test_a_discarded_standby_is_journaled_with_where_it_was(world):
    sb, _, journal, events = _standby(world)
    sb.discard("the run completed")
    assert sb.state is S.DISCARDED
    e = journal.events("standby_discarded")[0]
    assert (e["reason"], e["was_alive"], e["was_ready"]) == ("the run completed", True, True)
    assert events.get_nowait().code == -9  # killed through its engine


def test_a_standby_is_unfit_when_the_next_attempt_s_settings_changed(world):
    sb, _, _, _ = _standby(world)
    sb.env = {"ORCHESTRATOR_BATCH_SIZE": "16", "PATH": "/bin"}
    same = {"ORCHESTRATOR_BATCH_SIZE": "16"}
    assert sb.unfit("restart", same) is None
    assert "ORCHESTRATOR_BATCH_SIZE" in sb.unfit("restart", {})
    assert "ORCHESTRATOR_STRATEGY" in sb.unfit("restart", dict(same, ORCHESTRATOR_STRATEGY="cpu"))
    assert "halve_batch needs a fresh process" in sb.unfit("halve_batch", same)
    sb.proc.returncode = 1  # it exited meanwhile
    assert "exited (exit code 1" in sb.unfit("restart", same)


def _keeper(world, plan=None):
    spec, rd, journal, engine, events = world(plan)
    slot = SimpleNamespace(events=events, stopped=SimpleNamespace(is_set=lambda: False))
    remedies = SimpleNamespace(current_strategy=lambda: "cpu", seen=None)
    recovery = SimpleNamespace(remedies=remedies, attempt_env=lambda: {})
    keeper = StandbyKeeper(spec, lambda spec, n, mode: ["fake", "--attempt", str(n),
                                                        "--standby", mode],
                           rd, journal, slot, recovery, engine=engine)
    return keeper, journal, events


def test_the_keeper_starts_one_when_the_attempt_trains_and_none_twice(world):
    keeper, journal, _ = _keeper(world)
    keeper.on_training(1)
    keeper.on_commit(1)
    keeper.on_training(1)
    assert [e["for_attempt"] for e in journal.events("standby_started")] == [2]
    assert keeper.current.state is S.STARTED


def test_a_lost_standby_is_replaced_once_per_attempt(world):
    keeper, journal, events = _keeper(world, {"standby_exit": {"2": 1}})
    keeper.on_training(1)
    for _ in range(2):
        item = events.get_nowait()
        keeper.on_exit(item.key, item.code, 1)
    assert events.empty() and keeper.current is None
    assert [sb.state for sb in keeper.standbys] == [S.LOST, S.LOST]
    assert [e["for_attempt"] for e in journal.events("standby_lost")] == [2, 2]
    keeper.on_commit(1)  # asking again at a commit does not start a third
    assert len(keeper.standbys) == 2


def test_an_exit_that_is_not_the_standby_s_is_not_its_loss(world):
    keeper, journal, _ = _keeper(world)
    keeper.on_training(1)
    keeper.on_exit(object(), -9, 1)
    assert keeper.current.state is S.STARTED and not journal.events("standby_lost")


def test_promotion_takes_the_standby_and_leaves_the_keeper_none(world):
    keeper, journal, _ = _keeper(world)
    keeper.on_training(1)
    member, path = keeper.promote(2, {})
    assert path["path"] == "warm" and member is keeper.standbys[0].member
    assert keeper.current is None and keeper.standbys[0].state is S.PROMOTED
    assert journal.events("standby_promoted")[0]["adopted"] is False

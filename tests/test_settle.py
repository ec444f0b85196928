"""When a durable copy counts as in the cloud (checkpoint/settle.py), and retention on a
write-back tier: never without a settled complete checkpoint. All on a FakeClock, no waiting."""
import json
import os

import pytest

from helpers import FakeClock
from orchestrator.checkpoint.mirror import DurableMirror
from orchestrator.checkpoint.settle import (Immediate, Settling, WriteBack, durable_to_retire,
                                            history, policy_for, standing)
from orchestrator.checkpoint.store import Checkpoint, Retention
from orchestrator.checkpoint.tiers import TieredStore
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.spec import CheckpointSpec
from orchestrator.ops.status import format_status, run_status

POLICY = WriteBack(quiet_s=10.0, bytes_per_s_estimate=1000.0, margin=2.0)


def _payload(nbytes):
    def write(d):
        with open(os.path.join(d, "state.npz"), "wb") as f:
            f.write(b"x" * nbytes)
    return write


def _commit(store, step, nbytes=1000):
    return store.commit(step, _payload(nbytes), {"epoch": step, "batch": 0, "metrics": {}})


def _settled(journal):
    return [(e["steps"], e["how"]) for e in journal.events(Event.CHECKPOINT_SETTLED)]


@pytest.fixture
def tiers(tmp_path):
    return TieredStore(str(tmp_path / "local"), str(tmp_path / "drive" / "checkpoints"))


def _mirror(tiers, tmp_path, policy=POLICY, keep=1, max_bytes=None):
    clock = FakeClock()
    journal = Journal(str(tmp_path / "events.jsonl"))
    settling = Settling(policy, journal, tiers.durable.root, clock)
    m = DurableMirror(tiers, journal, Retention(keep=keep), backoff_initial=0.01,
                      backoff_max=0.05, clock=clock, settling=settling, max_bytes=max_bytes)
    return m, journal, clock


def _fake(step, nbytes=1000):
    return Checkpoint(step, f"/x/{step:010d}", {"files": {"state.npz": {"size": nbytes}}})


# ------------------------------------------------------------------ the policy
def test_the_policy_is_write_back_under_drive_unless_told(tmp_path):
    ck = CheckpointSpec()
    assert isinstance(policy_for(ck, "/content/drive/MyDrive/run/checkpoints"), WriteBack)
    assert isinstance(policy_for(ck, str(tmp_path / "checkpoints")), Immediate)
    forced = CheckpointSpec(durable_cache="writeback", writeback_quiet_s=3.0)
    assert policy_for(forced, str(tmp_path)).quiet_s == 3.0
    assert isinstance(policy_for(CheckpointSpec(durable_cache="none"),
                                 "/content/drive/MyDrive/x"), Immediate)


def test_a_written_copy_settles_by_the_estimate_and_not_before(tmp_path):
    clock = FakeClock()
    journal = Journal(str(tmp_path / "events.jsonl"))
    os.makedirs(tmp_path / "ck")
    s = Settling(POLICY, journal, str(tmp_path / "ck"), clock)
    s.seen({})
    s.wrote(_fake(5, nbytes=1000), "/x")
    # 2 x (10 s quiet + 1000 B / 1000 B/s) = 22 s after the write
    clock.advance(21.9)
    assert s.tick() == [] and s.pending() == [5]
    clock.advance(0.2)
    assert s.tick() == [5] and s.settled_steps() == {5}
    assert _settled(journal) == [([5], "estimate")]
    assert history(str(tmp_path / "ck"))[0]["step"] == 5  # the state file next to it


def test_copies_queue_behind_each_other_in_the_estimate(tmp_path):
    clock = FakeClock()
    s = Settling(POLICY, Journal(str(tmp_path / "e.jsonl")), str(tmp_path / "ck"), clock)
    s.seen({})
    s.wrote(_fake(1, nbytes=10_000), "/x")   # 2 x (10 + 10) = 40 s
    s.wrote(_fake(2, nbytes=1000), "/x")     # 2 x (10 + 11) = 42 s: it waits behind step 1
    clock.advance(41)
    assert s.tick() == [1]
    clock.advance(1.5)
    assert s.tick() == [2]


def test_a_new_mount_settles_what_this_machine_did_not_write(tmp_path):
    clock = FakeClock()
    journal = Journal(str(tmp_path / "e.jsonl"))
    s = Settling(POLICY, journal, str(tmp_path / "ck"), clock)
    s.seen({1: _fake(1), 2: _fake(2)}, here={2: clock.time()})
    assert s.settled_steps() == {1} and s.pending() == [2]
    assert _settled(journal) == [([1], "mount")]
    s.seen({1: _fake(1), 2: _fake(2), 3: _fake(3)})  # only the first listing says so
    assert s.settled_steps() == {1}


def test_a_flush_settles_everything_and_measures_the_rate(tmp_path):
    clock = FakeClock()
    journal = Journal(str(tmp_path / "e.jsonl"))
    s = Settling(POLICY, journal, str(tmp_path / "ck"), clock)
    s.seen({})
    s.wrote(_fake(1, nbytes=4000), "/x")
    assert s.flushed(seconds=2.0) == [1] and s.rate == 2000.0
    s.wrote(_fake(2, nbytes=4000), "/x")   # 2 x (10 + 4000 / 2000) = 24 s now, not 28
    clock.advance(24.01)
    assert s.tick() == [2]
    assert _settled(journal)[0] == ([1], "flush")


# ------------------------------------------------------------------ retention
def test_the_newest_written_copy_never_pushes_out_the_settled_one(tiers, tmp_path):
    m, journal, clock = _mirror(tiers, tmp_path, keep=1)
    _commit(tiers, 1)
    m._pass()
    clock.advance(30)
    m._pass()                                  # step 1 settled by the estimate
    _commit(tiers, 2)
    m._pass()                                  # step 2 written, in the cache only
    assert m.settling.pending() == [2]
    assert [c.step for c in tiers.durable.list()] == [1, 2]  # 1 survives: the only settled one
    clock.advance(30)
    m._pass()                                  # 2 settles: now 1 may go
    assert [c.step for c in tiers.durable.list()] == [2]
    assert not os.path.exists(os.path.join(tiers.durable.root, "0000000001.state.json"))


def test_an_immediate_tier_retires_at_once_as_before(tiers, tmp_path):
    m, journal, clock = _mirror(tiers, tmp_path, policy=Immediate(), keep=1)
    _commit(tiers, 1)
    m._pass()
    _commit(tiers, 2)
    m._pass()
    assert [c.step for c in tiers.durable.list()] == [2]
    assert _settled(journal) == []  # nothing to say on a tier that settles at fsync


def test_the_space_cap_forces_out_kept_copies_and_says_so(tiers, tmp_path):
    m, journal, clock = _mirror(tiers, tmp_path, keep=3, max_bytes=2500)
    for step in (1, 2, 3):
        _commit(tiers, step)
        m._pass()
        clock.advance(30)
    m._pass()
    assert [c.step for c in tiers.durable.list()] == [2, 3]
    cap = journal.events(Event.DURABLE_CAP)
    assert cap and cap[0]["removed"] == [1]
    m._pass()
    assert 1 not in [c.step for c in m.backlog()]  # evicted: not uploaded again


def test_the_cap_never_removes_the_newest_settled_nor_the_newest_written():
    copies = {1: _fake(1), 2: _fake(2), 3: _fake(3)}
    plan = durable_to_retire(copies, due={1, 2, 3}, newest=3, settled={1}, max_bytes=100)
    assert plan.steps == [] and plan.forced == []   # 1 settled, 2 and 3 its successors
    assert plan.over_cap == 3000 - 100
    plan = durable_to_retire(copies, due={3}, newest=3, settled={1, 2}, max_bytes=None)
    assert plan.steps == [1]
    assert durable_to_retire(copies, due={3}, newest=3, settled=None).steps == [1, 2]


def test_the_only_durable_copy_stays_until_a_newer_one_is_durable():
    """Local steps 3 and 4 are what retention keeps, but only step 1 is in the bucket: retired
    for them, the bucket would hold no checkpoint until the next upload (seen: a machine lost
    then resumed from step 0)."""
    copies = {1: _fake(1)}
    for settled in (None, {1}):
        assert durable_to_retire(copies, due={3, 4}, newest=4, settled=settled).steps == []
    copies[3] = _fake(3)
    assert durable_to_retire(copies, due={3, 4}, newest=4, settled=None).steps == [1]


# ------------------------------------------------------------------ status
def test_status_says_whether_the_newest_copy_is_written_or_settled(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [(1000, "run_started", {"epochs": 5}),
            (1010, "checkpoint_durable", {"step": 20, "epoch": 2}),
            (1040, "checkpoint_settled", {"steps": [20], "how": "estimate"}),
            (1050, "checkpoint_durable", {"step": 30, "epoch": 3})]
    with open(run / "events.jsonl", "w") as f:
        f.writelines(json.dumps({"ts": ts, "event": ev, **kw}) + "\n" for ts, ev, kw in rows)
    s = run_status(str(run), now=1060)
    assert s["durable_settled"] == {"policy": "writeback", "step": 30, "settled": False,
                                    "how": None, "newest_settled": 20}
    assert "step 30 written, not settled yet; newest settled: step 20" in format_status(s, 1060)
    assert standing(Journal(str(run / "events.jsonl")).events(), False, 20)["settled"]


def test_a_supervisor_restarted_on_the_same_machine_does_not_take_its_own_cache_for_the_cloud(
        tiers, tmp_path):
    m, journal, clock = _mirror(tiers, tmp_path)
    _commit(tiers, 1)
    m._pass()                                   # written by this machine, not settled
    (tmp_path / "again").mkdir()
    again, journal2, _ = _mirror(tiers, tmp_path / "again")
    again._pass()
    assert again.settling.pending() == [1] and again.settling.settled_steps() == set()

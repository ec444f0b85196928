"""standby: auto decides per attempt whether a standby is worth it, from the run's journal."""
import pytest

from helpers import supervise
from orchestrator.recovery.policy import is_preemption
from orchestrator.supervise import standby_policy
from orchestrator.supervise.standby_policy import Evidence, worth_it


def test_a_worker_training_on_an_accelerator_or_with_spare_cores_gets_a_standby():
    assert worth_it("gpu", 2, Evidence())[0] and worth_it("tpu", 2, Evidence())[0]
    ok, why = worth_it("cpu", 8, Evidence())
    assert ok and "8 cores" in why


def test_a_cpu_bound_worker_on_two_cores_gets_none_until_a_kill_is_seen():
    ok, why = worth_it("cpu", 2, Evidence(attempts_ended=3, killed=0))
    assert not ok and "no kill in this run yet" in why


def test_after_kills_the_expected_saving_is_weighed_against_the_warm_up_s_cost():
    # one kill in one attempt: 1 x 3.8 s cold start against 6 s x 0.45 = 2.7 s lost
    ok, why = worth_it("cpu", 2, Evidence(attempts_ended=1, killed=1, cold_start_s=3.8,
                                          warm_up_s=6.0))
    assert ok and "3.8 s expected saved" in why and "2.7 s of training lost" in why
    # one kill in twenty attempts: 0.19 s expected against 8 s x 0.45 = 3.6 s
    ok, why = worth_it("cpu", 2, Evidence(attempts_ended=20, killed=1, cold_start_s=3.8,
                                          warm_up_s=8.0))
    assert not ok and "1 of 20 attempts killed" in why


def test_the_evidence_is_the_run_s_own_journal():
    events = [
        {"event": "attempt_started", "attempt": 1, "path": "cold", "ts": 0},
        {"event": "first_step", "attempt": 1, "since_start_s": 4.0, "ts": 4},
        {"event": "standby_started", "pid": 11, "ts": 5.0},
        {"event": "standby_ready", "pid": 11, "ts": 11.5},
        {"event": "attempt_ended", "attempt": 1, "kind": "killed"},
        {"event": "attempt_started", "attempt": 2, "path": "warm", "ts": 20},
        {"event": "first_step", "attempt": 2, "since_start_s": 0.1, "ts": 20.1},  # not cold
        {"event": "attempt_ended", "attempt": 2, "kind": "storage"},
        {"event": "attempt_started", "attempt": 3, "path": "cold", "ts": 30},
        {"event": "first_step", "attempt": 3, "since_start_s": 6.0, "ts": 36},
    ]
    ev = Evidence.from_journal(events, is_preemption)
    assert ev == Evidence(attempts_ended=2, killed=1, cold_start_s=5.0, warm_up_s=6.5)


SLOW = {"batches": 3, "epoch_s": 0.6}


def test_standbys_discarded_warming_up_twice_stop_until_attempts_train_longer_than_that():
    """Kills every few seconds on 2 cores (bench --quick's goodput run): each standby was
    discarded still warming up, its warm-up slowing the worker for nothing."""
    ev = Evidence(attempts_ended=4, killed=4, cold_start_s=12.0, warm_up_s=None,
                  unready_s=(4.3, 9.8), trained_s=(4.1, 3.2, 9.8, 4.0))
    ok, why = worth_it("cpu", 2, ev)
    assert not ok and "the last 2 standbys were discarded still warming up" in why, why
    assert "after up to 9.8 s" in why and "killed 4.0 s after their first step" in why
    # one discarded is not yet a pattern; attempts that now train longer get one again
    assert worth_it("cpu", 2, Evidence(4, 4, 12.0, None, (9.8,), (4.1, 3.2, 9.8, 4.0)))[0]
    assert worth_it("cpu", 2, Evidence(4, 4, 12.0, None, (4.3, 9.8), (30.0, 25.0, 40.0)))[0]
    # and on a GPU the rule never applies (the CPU is spare)
    assert worth_it("gpu", 2, ev)[0]


def test_the_evidence_counts_standbys_discarded_warming_up_since_the_last_ready_one():
    t = 1000.0
    events = [
        {"event": "attempt_started", "attempt": 1, "ts": t, "path": "cold"},
        {"event": "first_step", "attempt": 1, "ts": t + 12, "since_start_s": 12.0},
        {"event": "standby_started", "pid": 7, "ts": t + 12},
        {"event": "attempt_ended", "attempt": 1, "kind": "killed", "ts": t + 16},
        {"event": "standby_discarded", "pid": 7, "was_alive": True, "was_ready": False,
         "age_s": 4.3, "ts": t + 16},
        {"event": "standby_started", "pid": 8, "ts": t + 30},
        {"event": "standby_ready", "pid": 8, "ts": t + 38},
        {"event": "standby_started", "pid": 9, "ts": t + 40},
        {"event": "standby_discarded", "pid": 9, "was_alive": True,  # an older journal's words
         "reason": "it was still warming up (5.0 s)", "age_s": 5.0, "ts": t + 45},
        {"event": "standby_discarded", "pid": 10, "was_alive": True, "was_ready": True,
         "age_s": 20.0, "ts": t + 60},
    ]
    ev = Evidence.from_journal(events, is_preemption)
    assert ev.unready_s == (5.0,) and ev.warm_up_s == 8.0 and ev.trained_s == (4.0,)


@pytest.mark.integration
def test_auto_on_two_cores_starts_the_first_standby_after_the_first_kill(fake_job, monkeypatch):
    """The first kill after 4 s of training, the second 2 s into the next attempt: a standby
    started once attempt 2 trains is expected to be ready before the next kill (its warm-up
    taken as the fake's cold start)."""
    monkeypatch.setattr(standby_policy, "cores", lambda: 2)
    plan = dict(SLOW, epoch_s=1.0, exit_at_epoch={"1": [5, -9], "2": [7, -9]})
    rc, out, events = supervise(fake_job(epochs=12), plan, standby=True)
    assert rc == 0, out
    decided = [(e["for_attempt"], e["mode"]) for e in events if e["event"] == "standby_decided"]
    assert decided[0] == (2, None) and (3, "warm") in decided, [e.get("reason") for e in events if e["event"] == "standby_decided"]
    assert "no kill in this run yet" in next(e["reason"] for e in events
                                             if e["event"] == "standby_decided")
    paths = [e["path"] for e in events if e["event"] == "attempt_started"]
    assert paths == ["cold", "cold", "warm"], paths


def test_none_when_the_next_kill_is_expected_before_a_standby_would_be_ready():
    """bench --quick's goodput run: ResNet-20 on 2 cores, a kill every ~20 s, a cold start of
    12 s; a standby starts once its worker's start-up is done, so after a cold start it has
    ~5 s, and every one was discarded still warming up."""
    ev = Evidence(attempts_ended=1, killed=1, cold_start_s=12.0, kill_gaps_s=(16.7,),
                  last_kill_ts=100.0)
    ok, why = worth_it("cpu", 2, ev, now=112.3)
    assert not ok and "kills come every 16.7 s" in why and "expected in 4.4 s" in why, why
    assert "(12.0 s warm-up)" in why  # no standby was ready here yet: a cold start's length
    # after a warm start (under a second) it has nearly all of the gap
    assert worth_it("cpu", 2, ev, now=100.8)[0]
    # a warm-up measured here is the figure, and one discarded later at an older age bounds it
    ready = Evidence(1, 1, 12.0, 6.0, kill_gaps_s=(20.0,), last_kill_ts=100.0)
    assert worth_it("cpu", 2, ready, now=108.0)[0]
    slower = Evidence(1, 1, 12.0, 6.0, unready_s=(13.0,), kill_gaps_s=(20.0,), last_kill_ts=100.0)
    assert not worth_it("cpu", 2, slower, now=108.0)[0]
    # the median of the last three gaps: one long gap does not decide it
    ev = Evidence(3, 3, 12.0, 6.0, kill_gaps_s=(120.0, 9.0, 10.0, 11.0), last_kill_ts=100.0)
    assert not worth_it("cpu", 2, ev, now=105.0)[0]
    # where the CPU is spare the timing does not matter
    assert worth_it("gpu", 2, ev, now=105.0)[0]


def test_the_gaps_between_kills_are_counted_per_session():
    events = [
        {"event": "run_started", "ts": 0.0},
        {"event": "attempt_started", "attempt": 1, "ts": 0.5, "path": "cold"},
        {"event": "attempt_ended", "attempt": 1, "kind": "killed", "ts": 16.7},
        {"event": "attempt_ended", "attempt": 2, "kind": "storage", "ts": 20.0},  # not a kill
        {"event": "attempt_ended", "attempt": 3, "kind": "killed", "ts": 34.8},
        {"event": "run_resumed", "ts": 5000.0},  # a day later: not a gap between kills
        {"event": "attempt_ended", "attempt": 4, "kind": "killed", "ts": 5030.0},
    ]
    ev = Evidence.from_journal(events, is_preemption)
    assert ev.kill_gaps_s == (16.7, 18.1, 30.0) and ev.last_kill_ts == 5030.0


def test_none_when_the_run_is_expected_to_end_before_the_next_kill():
    """bench --quick's goodput run (2026-12-05): the run's only kill came at 16.7 s and it ended
    before the next; the standby started after that kill was paid for and never used."""
    ev = Evidence(attempts_ended=1, killed=1, cold_start_s=6.0, warm_up_s=6.0,
                  kill_gaps_s=(16.7,), last_kill_ts=100.0, epoch=20.0,
                  epochs=32, epochs_per_s=1.25)
    # at 107 s: 12 epochs at 1.25/s = 9.6 s left; the next kill is expected in 9.7 s
    ok, why = worth_it("cpu", 2, ev, now=107.0)
    assert not ok and "expected to end in 9.6 s (12.0 epochs at 1.25/s)" in why, why
    assert "before the next kill (in 9.7 s)" in why
    # a longer run is expected to meet that kill
    longer = Evidence(1, 1, 6.0, 6.0, kill_gaps_s=(16.7,), last_kill_ts=100.0, epoch=20.0,
                      epochs=40, epochs_per_s=1.25)
    assert worth_it("cpu", 2, longer, now=107.0)[0]
    # where its pace is not known yet, the rule does not apply
    unknown = Evidence(1, 1, 6.0, 6.0, kill_gaps_s=(16.7,), last_kill_ts=100.0, epoch=20.0,
                       epochs=32)
    assert worth_it("cpu", 2, unknown, now=107.0)[0]


def test_where_training_stands_and_its_pace_come_from_the_journal():
    events = [
        {"event": "worker_ready", "attempt": 1, "steps_per_epoch": 10, "ts": 0.0},
        {"event": "checkpoint_committed", "attempt": 1, "epoch": 1, "batch": 0, "ts": 10.0},
        {"event": "checkpoint_committed", "attempt": 1, "epoch": 3, "batch": 0, "ts": 14.0},
        {"event": "attempt_ended", "attempt": 1, "kind": "killed", "ts": 15.0},  # 0.5/s
        {"event": "checkpoint_committed", "attempt": 2, "epoch": 3, "batch": 5, "ts": 30.0},
        {"event": "checkpoint_committed", "attempt": 2, "epoch": 4, "ts": 31.0},  # 0.5/s
        {"event": "checkpoint_committed", "attempt": 3, "epoch": 5, "batch": 2, "ts": 40.0},
    ]
    ev = Evidence.from_journal(events, is_preemption, epochs=8)
    assert (ev.epoch, ev.epochs, ev.epochs_per_s) == (5.2, 8, 0.5)
    assert ev.training_left_s() == pytest.approx(2.8 / 0.5)
    assert Evidence.from_journal(events, is_preemption).training_left_s() is None


def test_a_standby_adopted_still_warming_up_bounds_the_warm_up_as_a_discarded_one_does():
    events = [
        {"event": "standby_started", "pid": 7, "ts": 10.0},
        {"event": "standby_promoted", "attempt": 2, "pid": 7, "adopted": True, "age_s": 3.5},
        {"event": "standby_started", "pid": 8, "ts": 30.0},
        {"event": "standby_promoted", "attempt": 3, "pid": 8, "adopted": False, "age_s": 12.0},
    ]
    assert Evidence.from_journal(events, is_preemption).unready_s == (3.5,)


@pytest.mark.integration
def test_auto_starts_none_after_a_kill_when_the_run_ends_before_the_next(fake_job, monkeypatch):
    """The first kill after 4 s of training; 3 epochs of 1 s are left, the next kill is
    expected ~4 s later: no standby is worth it (the fake journals its commits and steps per
    epoch as the worker does)."""
    monkeypatch.setattr(standby_policy, "cores", lambda: 2)
    plan = dict(SLOW, epoch_s=1.0, exit_at_epoch={"1": [5, -9]})
    rc, out, events = supervise(fake_job(epochs=7), plan, standby=True)
    assert rc == 0, out
    decided = [e for e in events if e["event"] == "standby_decided"]
    assert [(e["for_attempt"], e["mode"]) for e in decided] == [(2, None), (3, None)], decided
    assert "before the next kill" in decided[1]["reason"], decided[1]["reason"]
    assert not [e for e in events if e["event"] == "standby_started"]


def test_before_any_kill_a_long_run_gets_one_when_its_warm_up_is_a_small_share_of_it():
    # 6 s x 0.45 = 2.7 s against 300 s of training left (30 epochs at 0.1/s)
    ev = Evidence(cold_start_s=6.0, epoch=10.0, epochs=40, epochs_per_s=0.1)
    ok, why = worth_it("cpu", 2, ev, now=120.0)
    assert ok and "300 s of training left" in why and "~2.7 s" in why and "0.9%" in why, why
    # a short run (60 s left) pays 4.5 %: none, as in any run whose pace is not known yet
    short = Evidence(cold_start_s=6.0, epoch=34.0, epochs=40, epochs_per_s=0.1)
    assert not worth_it("cpu", 2, short, now=100.0)[0]
    assert not worth_it("cpu", 2, Evidence(cold_start_s=6.0), now=100.0)[0]


@pytest.mark.integration
def test_a_long_run_never_killed_gets_a_standby_once_its_pace_is_known(fake_job, monkeypatch):
    """At the first step its pace is unknown (none); asked again at a later commit, the rest of
    the run is long against the warm-up's cost (the fake's cold start, under a second)."""
    from orchestrator.supervise import standby

    monkeypatch.setattr(standby_policy, "cores", lambda: 2)
    monkeypatch.setattr(standby, "RETRY_S", 0.0)
    # the share's value is the unit test's; here the fake's cold start (0.1 s quiet, more beside
    # the suite's other processes) against its ~9 s of training must not decide it
    monkeypatch.setattr(standby_policy, "LONG_RUN_SHARE", 0.25)
    rc, out, events = supervise(fake_job(epochs=24), dict(SLOW, epoch_s=0.4), standby=True)
    assert rc == 0, out
    decided = [e for e in events if e["event"] == "standby_decided"]
    assert [(e["for_attempt"], e["mode"]) for e in decided] == [(2, None), (2, "warm")], decided
    assert "no kill in this run yet, and" in decided[1]["reason"], decided[1]["reason"]
    started = [e for e in events if e["event"] == "standby_started"]
    assert [e["for_attempt"] for e in started] == [2]  # once: not again at every commit


@pytest.mark.integration
def test_asking_again_at_commits_never_restarts_a_standby_that_failed_its_warm_up(
        fake_job, monkeypatch):
    from orchestrator.supervise import standby

    monkeypatch.setattr(standby, "RETRY_S", 0.0)
    plan = dict(SLOW, epoch_s=0.4, standby_exit={"2": 1})
    rc, out, events = supervise(fake_job(epochs=12, extra="standby: on"), plan, standby=True)
    assert rc == 0, out
    # the first and its one replacement (StandbyKeeper.exited), then no more for attempt 2
    assert [e["for_attempt"] for e in events if e["event"] == "standby_started"] == [2, 2]


def test_a_standby_needs_memory_for_about_as_much_as_the_worker_holds():
    gib = 2**30
    ok, why = standby_policy.memory_allows(worker_rss=2 * gib, headroom=int(2.2 * gib))
    assert not ok and "2.2 GiB of memory available, a standby needs about 2.5 GiB" in why, why
    assert standby_policy.memory_allows(2 * gib, 3 * gib)[0]
    assert standby_policy.memory_allows(None, 0)[0]  # not known: allowed


@pytest.mark.integration
def test_auto_starts_none_where_the_memory_left_could_not_hold_it(fake_job, monkeypatch):
    from orchestrator.recovery import oom

    monkeypatch.setattr(standby_policy, "cores", lambda: 8)  # the CPU rule would say yes
    monkeypatch.setattr(oom, "headroom", lambda: 2**20)  # 1 MiB left
    rc, out, events = supervise(fake_job(epochs=3), dict(SLOW, epoch_s=0.3), standby=True)
    assert rc == 0, out
    decided = [e for e in events if e["event"] == "standby_decided"]
    assert decided[0]["mode"] is None and "GiB of memory available" in decided[0]["reason"]
    assert not [e for e in events if e["event"] == "standby_started"]


def test_a_decision_asked_again_for_the_same_attempt_is_journaled_only_when_its_mode_changes():
    """The keeper asks again at commits; the reasons' figures change with every asking (the
    full bench's 2-minute run journaled the same "none" twice in 16 s)."""
    from orchestrator.supervise.standby import StandbyKeeper

    journaled = []
    keeper = StandbyKeeper.__new__(StandbyKeeper)  # decide() needs only these
    keeper._decided = None
    keeper.journal = type("J", (), {"append": lambda self, event, **kw: journaled.append(
        (kw["for_attempt"], kw["mode"], kw["reason"]))})()
    answers = iter([(None, "next kill in 9.7 s"), (None, "next kill in 8.1 s"),
                    ("warm", "saves 5 s"), ("warm", "saves 6 s"), ("warm", "saves 6 s")])
    keeper.mode = lambda: next(answers)
    for attempt in (3, 3, 3, 4, 4):
        keeper.decide(attempt)
    assert journaled == [(3, None, "next kill in 9.7 s"), (3, "warm", "saves 5 s"),
                         (4, "warm", "saves 6 s")]


def test_a_standby_needs_memory_for_one_more_copy_of_the_state_too():
    gib = 2**30
    assert standby_policy.memory_allows(2 * gib, 3 * gib)[0]
    ok, why = standby_policy.memory_allows(2 * gib, 3 * gib, state_bytes=2 * gib)
    assert not ok and "needs about 4.5 GiB" in why and "the state's 2.0 GiB" in why, why
    assert not standby_policy.memory_allows(None, 3 * gib, state_bytes=4 * gib)[0]


def test_the_ledger_journals_the_state_s_size_from_the_manifest_and_the_evidence_takes_the_newest(
        tmp_path):
    from orchestrator.checkpoint.store import CheckpointStore
    from orchestrator.supervise.ledger import CheckpointLedger

    import numpy as np

    store = CheckpointStore(str(tmp_path / "ckpt"))
    frozen = np.ones(1000, np.uint8)
    # the second shares the first's array: its blob is written once, yet the state holds it
    for step, arrays in ((5, {"a": frozen}), (10, {"a": frozen, "b": np.zeros(2000, np.uint8)})):
        store.commit(step, None, {"epoch": 0, "batch": step}, arrays=arrays)
    journaled = []
    journal = type("J", (), {"append": lambda self, event, **kw: journaled.append(
        dict(kw, event=event))})()
    ledger = CheckpointLedger(None, journal, None, lambda: None, lambda: None)  # _journal's
    for c in reversed(store.list()):  # the newest first: the evidence goes by step
        ledger._journal(c)
    assert [e["state_bytes"] for e in journaled] == [3000, 1000]  # the arrays, shared ones too
    assert Evidence.from_journal(journaled, is_preemption).state_bytes == 3000


def test_auto_refuses_a_standby_when_the_newest_checkpoint_s_state_would_not_fit(monkeypatch):
    """The worker's heartbeat RSS alone fits the memory left; with the state's size from the
    newest checkpoint's manifest (journaled at its commit) it does not."""
    from types import SimpleNamespace

    from orchestrator.core import heartbeat
    from orchestrator.recovery import oom
    from orchestrator.supervise.standby import StandbyKeeper

    gib = 2**30
    monkeypatch.setattr(heartbeat, "read", lambda folder: {"rss": 3 * gib})
    monkeypatch.setattr(oom, "headroom", lambda: 8 * gib)
    events = [{"event": "checkpoint_committed", "epoch": 1, "step": 8, "ts": 1.0,
               "state_bytes": 5 * gib}]
    keeper = StandbyKeeper.__new__(StandbyKeeper)  # mode() needs only these
    keeper.cmd = lambda *a: ["worker"]
    keeper.cores = lambda: 8  # the CPU rule alone would say yes
    keeper.spec = SimpleNamespace(workers=1, engine="local", standby="auto",
                                  backend="tensorflow", epochs=10)
    keeper.rd = SimpleNamespace(for_rank=lambda rank: "control")
    keeper.recovery = SimpleNamespace(remedies=SimpleNamespace(
        current_strategy=lambda: "cpu", seen=set()))
    keeper.journal = SimpleNamespace(events=lambda: events)
    mode, why = keeper.mode()
    assert mode is None and "the state's 5.0 GiB" in why and "needs about 8.8 GiB" in why, why
    events[0]["state_bytes"] = 1 * gib  # 3 x 1.25 + 1 = 4.75 GiB: it fits
    assert keeper.mode()[0] is not None

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
    # one kill in one attempt: 1 x 3.8 s cold start against 8 s x 0.19 = 1.52 s lost
    ok, why = worth_it("cpu", 2, Evidence(attempts_ended=1, killed=1, cold_start_s=3.8,
                                          warm_up_s=8.0))
    assert ok and "3.8 s expected saved" in why and "1.5 s of training lost" in why
    # one kill in twenty attempts: 0.19 s expected against the same 1.52 s
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


@pytest.mark.integration
def test_auto_on_two_cores_starts_the_first_standby_after_the_first_kill(fake_job, monkeypatch):
    monkeypatch.setattr(standby_policy, "cores", lambda: 2)
    plan = dict(SLOW, exit_at_epoch={"1": [2, -9], "2": [4, -9]})
    rc, out, events = supervise(fake_job(epochs=6), plan, standby=True)
    assert rc == 0, out
    decided = [(e["for_attempt"], e["mode"]) for e in events if e["event"] == "standby_decided"]
    assert decided[0] == (2, None) and (3, "warm") in decided, decided
    assert "no kill in this run yet" in next(e["reason"] for e in events
                                             if e["event"] == "standby_decided")
    paths = [e["path"] for e in events if e["event"] == "attempt_started"]
    assert paths == ["cold", "cold", "warm"], paths

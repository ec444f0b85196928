"""The recovery policy on its own: ladders, skipped rungs, budgets, crash loops, escalation."""
import dataclasses

import pytest

from orchestrator.recovery.policy import GIVE_UP, Failure, RecoveryPolicy, next_strategy
from orchestrator.core.spec import CrashLoopSpec, RecoverySpec, RestartSpec, Rung, SpecError


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _policy(spec=RecoverySpec(), max_restarts=20, applicable=lambda a: None):
    clock = Clock()
    return RecoveryPolicy(spec, RestartSpec(max=max_restarts), applicable=applicable,
                          clock=clock), clock


def _fail(kind, pos="epoch 0 batch 1", sig=None, t=1000.0, escalate=None, n=1):
    return Failure(n, kind, sig, pos, t, "evidence", escalate)


def test_accelerator_context_climbs_its_ladder_skipping_what_is_not_enabled():
    spec = RecoverySpec(crash_loop=CrashLoopSpec(same_failure=10, failures=10))
    policy, _ = _policy(spec, applicable=lambda a: "not enabled" if a in (
        "reinstall_tensorflow", "fallback_strategy") else None)
    actions = [policy.decide(_fail("accelerator_context", pos=f"epoch 0 batch {i}")).action
               for i in range(3)]
    assert actions == ["restart", "reinit_accelerator", GIVE_UP]
    last = policy.next_rung("accelerator_context")
    assert "exhausted" in last.reason


def test_opted_in_rungs_are_taken_in_order_and_counted():
    spec = RecoverySpec(crash_loop=CrashLoopSpec(same_failure=10, failures=10))
    policy, _ = _policy(spec)
    seen = [policy.decide(_fail("accelerator_context", pos=f"p{i}")) for i in range(5)]
    assert [d.action for d in seen] == ["restart", "reinit_accelerator", "reinstall_tensorflow",
                                        "fallback_strategy", GIVE_UP]
    assert "ladder rung 3 (reinstall_tensorflow, 1 of 1)" in seen[2].reason


def test_user_error_stops_at_once_unless_a_confirming_retry_is_configured():
    policy, _ = _policy()
    d = policy.decide(_fail("user_error"))
    assert d.action == GIVE_UP and "a restart cannot fix it" in d.reason
    spec = RecoverySpec(ladders=(("user_error", (Rung("restart"),)),))
    policy, _ = _policy(spec)
    assert [policy.decide(_fail("user_error", pos=f"p{i}")).action for i in range(2)] == \
        ["restart", GIVE_UP]


def test_restart_budget_stops_an_otherwise_endless_ladder():
    policy, _ = _policy(max_restarts=2)
    d = [policy.decide(_fail("unknown", pos=f"p{i}")) for i in range(3)]
    assert [x.action for x in d] == ["restart", "restart", GIVE_UP]
    assert d[2].reason == "restart budget of 2 spent"


def test_same_kind_at_the_same_step_three_times_is_a_crash_loop():
    policy, clock = _policy()
    d = []
    for i in range(3):
        clock.t += 300  # slow enough for the window rule not to fire
        d.append(policy.decide(_fail("unknown", t=clock.t)))
    assert [x.action for x in d] == ["restart", "restart", GIVE_UP]
    assert "crash loop" in d[2].reason and "3 times in a row" in d[2].reason


def test_four_failures_in_ten_minutes_without_a_checkpoint_is_a_crash_loop():
    policy, clock = _policy()
    d = [policy.decide(_fail("unknown", pos=f"p{i}", t=clock.t + i)) for i in range(4)]
    assert [x.action for x in d][-1] == GIVE_UP
    assert "4 failures within 10 minutes" in d[-1].reason
    # the same four failures spread out, or with progress in between, are not a loop
    policy, clock = _policy()
    out = []
    for i in range(6):
        clock.t += 240
        out.append(policy.decide(_fail("unknown", pos=f"p{i}", t=clock.t)).action)
    assert GIVE_UP not in out
    policy, clock = _policy()
    for i in range(6):
        assert policy.decide(_fail("unknown", pos=f"p{i}", t=clock.t)).action == "restart"
        policy.progress()


def test_kills_at_the_same_start_up_step_are_preemptions_not_a_crash_loop():
    policy, clock = _policy(max_restarts=3)
    d = [policy.decide(_fail("killed", pos="epoch 0 batch 0", t=clock.t + i)) for i in range(12)]
    assert {x.action for x in d} == {"restart"}
    assert policy.counters() == {"errors": 0, "errors_max": 3, "preemptions": 12,
                                 "preemptions_max": None}


def test_preemptions_have_their_own_budget_when_one_is_set():
    policy = RecoveryPolicy(RecoverySpec(), RestartSpec(max=0, preemptions=2))
    d = [policy.decide(_fail("killed", pos=f"p{i}")) for i in range(3)]
    assert [x.action for x in d] == ["restart", "restart", GIVE_UP]
    assert d[2].reason == "preemption budget of 2 spent"


def test_kills_in_between_do_not_hide_a_deterministic_bug():
    policy, clock = _policy()
    actions = []
    for i in range(4):
        clock.t += 300
        actions.append(policy.decide(_fail("unknown", pos="epoch 1 batch 3", t=clock.t)).action)
        policy.decide(_fail("killed", pos=f"epoch 0 batch {i}", t=clock.t))
    assert actions == ["restart", "restart", GIVE_UP, GIVE_UP]


def test_a_storage_outage_at_one_step_is_bounded_by_the_budget_not_called_a_crash_loop():
    policy, _ = _policy(max_restarts=5)
    d = [policy.decide(_fail("storage", pos="epoch 1 batch 0")) for i in range(6)]
    assert [x.action for x in d] == ["restart"] * 5 + [GIVE_UP]
    assert d[-1].reason == "restart budget of 5 spent"


def test_the_error_budget_counts_failures_since_the_last_checkpoint_only():
    policy, _ = _policy(max_restarts=2)
    for i in range(10):  # ten scattered failures, each after progress: never stopped
        assert policy.decide(_fail("unknown", pos=f"p{i}")).action == "restart"
        policy.progress()
    assert policy.counters()["errors"] == 0


def test_the_first_restart_after_progress_is_immediate_and_the_backoff_resets():
    policy = RecoveryPolicy(RecoverySpec(), RestartSpec(max=100, backoff_initial=1.0,
                                                        backoff_multiplier=2.0, backoff_max=5.0))
    delays = [policy.decide(_fail("killed", pos=f"p{i}")).delay_s for i in range(6)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]
    policy.progress()
    assert policy.decide(_fail("killed", pos="q")).delay_s == 0.0
    assert policy.decide(_fail("unknown", pos="r")).delay_s == 1.0


def test_the_backoff_spaces_starts_so_an_attempt_that_ran_longer_restarts_at_once():
    policy = RecoveryPolicy(RecoverySpec(), RestartSpec(max=100, backoff_initial=1.0,
                                                        backoff_multiplier=2.0, backoff_max=30.0))
    ran = [9.0, 9.0, 1.5, 0.5, 3.0]  # killed after a cold start, twice; then quicker deaths
    delays = [policy.decide(dataclasses.replace(_fail("killed", pos=f"p{i}"), ran_s=r)).delay_s
              for i, r in enumerate(ran)]
    assert delays == [0.0, 0.0, 0.5, 3.5, 5.0]  # waits of 0, 1, 2, 4, 8 s less what each ran


def test_progress_resets_the_ladders():
    policy, _ = _policy(applicable=lambda a: None)
    assert policy.decide(_fail("hang", pos="a")).action == "restart"
    assert policy.decide(_fail("hang", pos="b")).action == "restart"
    policy.progress()
    assert policy.decide(_fail("hang", pos="c")).action == "restart"
    assert policy.decide(_fail("hang", pos="d")).action == "restart"
    assert policy.decide(_fail("hang", pos="e")).action == GIVE_UP


def test_illegal_address_at_the_same_step_twice_escalates_to_user_error():
    esc = {"after": 2, "kind": "user_error"}
    policy, _ = _policy()
    first = policy.decide(_fail("accelerator_unavailable", sig="cuda_illegal_address",
                                escalate=esc))
    assert first.action == "wait_accelerator"
    second = policy.decide(_fail("accelerator_unavailable", sig="cuda_illegal_address",
                                 escalate=esc))
    assert (second.kind, second.action) == ("user_error", GIVE_UP)
    policy, _ = _policy()
    policy.decide(_fail("accelerator_unavailable", sig="cuda_illegal_address", escalate=esc))
    other = policy.decide(_fail("accelerator_unavailable", pos="elsewhere",
                                sig="cuda_illegal_address", escalate=esc))
    assert other.kind == "accelerator_unavailable"


def test_strategy_fallback_order():
    assert [next_strategy(s) for s in ("tpu", "gpu", "cpu", "auto")] == ["gpu", "cpu", None, None]


def test_recovery_section_of_the_job_file(write_job):
    from orchestrator.core.specload import load

    base = "name: j\nmodel: m:f\ndata: m:g\nepochs: 1\nbatch_size: 4\n"
    spec = load(write_job(base + """
hang_timeout: 30
recovery:
  reinstall_tensorflow: true
  pip: [/opt/py/bin/python, -m, pip]
  pip_args: [--no-index]
  halve_batch: true
  ladders:
    out_of_memory: [{halve_batch: 3}, restart, give_up]
    killed: [{restart: budget}]
  crash_loop: {same_failure: 2, window_minutes: 5}
  wait: {initial: 0.5, timeout: 20}
"""))
    r = spec.recovery
    assert spec.hang_timeout == 30 and r.reinstall_tensorflow and r.halve_batch
    assert r.pip == ("/opt/py/bin/python", "-m", "pip") and r.pip_args == ("--no-index",)
    assert r.ladder("out_of_memory") == (Rung("halve_batch", 3), Rung("restart"),
                                         Rung("give_up"))
    assert r.ladder("killed") == (Rung("restart", None),)
    assert r.ladder("hang") is None
    assert (r.crash_loop.same_failure, r.crash_loop.failures, r.crash_loop.window_minutes) == \
        (2, 4, 5.0)
    assert (r.wait_initial, r.wait_max, r.wait_timeout) == (0.5, 60.0, 20.0)


@pytest.mark.parametrize("text,line,key,expected", [
    ("recovery:\n  ladders:\n    oom: [restart]\n", 8, "recovery.ladders.oom", "unknown key"),
    ("recovery:\n  ladders:\n    hang: [reboot]\n", 8, "recovery.ladders.hang[0]",
     "expected actions from restart"),
    ("recovery:\n  ladders:\n    hang: [{restart: 0}]\n", 8, "recovery.ladders.hang[0]",
     "expected a count >= 1"),
    ("recovery:\n  reinstall_tensorflow: yes please\n", 7, "recovery.reinstall_tensorflow",
     "expected true or false"),
    ("recovery:\n  pip: python -m pip\n", 7, "recovery.pip", "expected a list of strings"),
    ("hang_timeout: 0\n", 6, "hang_timeout", "expected a number >= 0.1"),
])
def test_bad_recovery_settings_name_file_line_and_key(write_job, text, line, key, expected):
    from orchestrator.core.specload import load

    path = write_job("name: j\nmodel: m:f\ndata: m:g\nepochs: 1\nbatch_size: 4\n" + text)
    with pytest.raises(SpecError) as e:
        load(path)
    assert e.value.line == line and e.value.key == key and expected in str(e.value)
    assert str(e.value).startswith(f"{path}:{line}: key '{key}'")

"""The supervisor's recovery, in this thread: the real loop, policy, ledger, journal and
standby keeper over a fake engine (tests/fakes/engine.py) and a fake clock. No process, no
real wait: the restart ladder, the budgets, the crash-loop rule, the standby's promotion and
a group's failure in milliseconds each. The real processes are tests/test_supervisor*.py's."""
import io
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fakes"))

from engine import FakeEngine, ScriptedQueue  # noqa: E402
from helpers import FakeClock  # noqa: E402
from orchestrator.core.journal import Journal  # noqa: E402
from orchestrator.core.specload import load  # noqa: E402
from orchestrator.supervise.compose import Commands  # noqa: E402
from orchestrator.supervise.supervisor import Supervisor  # noqa: E402


def _worker(spec, n):
    return ["fake-worker", "--attempt", str(n)]


def _standby(spec, n, mode):
    return _worker(spec, n) + ["--standby", mode]


def run(job, plan=None, standby=False, faults=()):
    """(exit code, journal events, the fake engine, the clock) of a whole run, in process."""
    spec, clock = load(job), FakeClock()
    engine = FakeEngine(spec, clock, plan)
    sup = Supervisor(spec, Commands(_worker, _standby if standby else None, None),
                     out=io.StringIO(), env={}, faults=faults, clock=clock, engine=engine)
    sup.slot.events = ScriptedQueue(engine)  # what the fake workers do, as the loop waits
    rc = sup.run_loop()
    return rc, Journal(sup.rd.journal).events(), engine, clock


def _ev(events, name):
    return [e for e in events if e["event"] == name]


def _epochs(events):
    return [e["epoch"] for e in _ev(events, "epoch_completed")]


CPU = "strategy: cpu"


def _extra(*keys: str) -> str:
    """Top-level keys for ``fake_job``'s ``extra``, one a line (its text is dedented)."""
    return "\n            ".join(keys)


def test_a_clean_run_completes_and_journals_each_epoch_once(fake_job):
    rc, events, engine, _ = run(fake_job(epochs=3, extra=CPU))
    assert rc == 0
    assert _epochs(events) == [1, 2, 3]
    assert events[-1]["event"] == "run_completed" and events[-1]["weights_sha256"] == "fake-3"
    assert engine.spawned == [(1, 0)] and engine.closed == 1


def test_a_killed_worker_is_restarted_and_resumes_after_its_last_commit(fake_job):
    plan = {"exit_at_epoch": {"1": [3, -9], "2": [4, -9]}}
    rc, events, engine, _ = run(fake_job(epochs=5, extra=CPU), plan)
    assert rc == 0
    assert _epochs(events) == [1, 2, 3, 4, 5]
    assert [e["from_epoch"] for e in _ev(events, "attempt_started")] == [0, 2, 3]
    assert [e["signal"] for e in _ev(events, "attempt_ended")] == ["SIGKILL", "SIGKILL", None]
    assert len(_ev(events, "restart")) == 2


def test_the_restart_budget_is_spent_then_the_run_fails_with_the_reason(fake_job, said):
    plan = {"exit": {str(n): 1 for n in range(1, 10)}}
    rc, events, engine, _ = run(fake_job(restarts="{max: 2, backoff: {initial: 0.01}}",
                                         extra=CPU), plan)
    assert rc == 1
    assert len(_ev(events, "attempt_started")) == 3  # max: 2 restarts
    failed = events[-1]
    assert failed["event"] == "run_failed" and "restart budget of 2 spent" in failed["reason"]
    assert failed["error"]["message"] == "planned exit 1"
    assert any("FAILED at epoch 0/4: restart budget of 2 spent" in line for line in said)


def test_the_backoff_between_restarts_without_progress_grows_on_the_clock(fake_job):
    plan = {"exit": {"1": 1, "2": 1, "3": 1}}
    rc, events, _, clock = run(fake_job(
        restarts="{max: 3, backoff: {initial: 0.05, max: 1, multiplier: 4}}",
        extra=_extra(CPU, "recovery: {crash_loop: {same_failure: 4}}")), plan)
    delays = [e["delay_s"] for e in _ev(events, "restart")]
    assert delays == [0.0, 0.05, 0.2]  # the first restart after progress is immediate
    assert [round(s, 3) for s in clock.slept] == delays  # waited on the fake clock


def test_a_kill_after_a_start_up_longer_than_the_backoff_restarts_at_once(fake_job):
    plan = {"exit_at_epoch": {"1": [3, -9], "2": [3, -9], "3": [3, -9]},
            "startup_s": {"2": 5.0, "3": 0.25}}  # 2 and 3 die before committing anything
    rc, events, _, clock = run(fake_job(
        epochs=3, restarts="{max: 3, backoff: {initial: 1, max: 30, multiplier: 2}}",
        extra=CPU), plan)
    assert rc == 0
    delays = [e["delay_s"] for e in _ev(events, "restart")]
    assert delays == [0.0, 0.0, 1.75]  # 1 s and 2 s after their starts: 5 s and 0.25 s ran
    assert [round(s, 3) for s in clock.slept] == delays


def test_a_config_error_exit_is_not_retried(fake_job):
    rc, events, engine, _ = run(fake_job(extra=CPU), {"exit": {"1": 78}})
    assert rc == 1
    assert engine.spawned == [(1, 0)] and not _ev(events, "restart")
    assert "a restart cannot fix it" in events[-1]["reason"]


def test_the_same_failure_at_the_same_step_is_a_crash_loop(fake_job):
    boom = {"type": "KeyError", "message": "'labels'"}
    rc, events, _, _ = run(fake_job(epochs=2, restarts="{max: 10, backoff: {initial: 0.01}}",
                                    extra=CPU), {"error": {str(n): boom for n in range(1, 10)}})
    assert rc == 1
    assert len(_ev(events, "attempt_started")) == 3  # not the budget of 10
    failed = _ev(events, "run_failed")[0]
    assert "crash loop" in failed["reason"] and "3 times in a row" in failed["reason"]
    assert failed["tried"] == ["restart", "restart"]


def test_failures_with_progress_in_between_are_not_a_crash_loop(fake_job):
    plan = {"exit_at_epoch": {str(n): [n + 1, -6] for n in range(1, 5)}}
    rc, events, _, _ = run(fake_job(epochs=5, restarts="{max: 9, backoff: {initial: 0.01}}",
                                    extra=CPU), plan)
    assert rc == 0 and _epochs(events) == [1, 2, 3, 4, 5]
    assert [e["action"] for e in _ev(events, "recovery")] == ["restart"] * 4


def test_a_warm_standby_is_promoted_and_a_new_one_starts_behind_it(fake_job):
    plan = {"exit_at_epoch": {"1": [3, -9]}}
    rc, events, engine, _ = run(fake_job(epochs=4, extra=_extra(CPU, "standby: on")), plan,
                                standby=True)
    assert rc == 0 and _epochs(events) == [1, 2, 3, 4]
    started = _ev(events, "attempt_started")
    assert [e["path"] for e in started] == ["cold", "warm"]
    assert started[1]["pid"] == _ev(events, "standby_started")[0]["pid"]
    assert [(e["attempt"], e["adopted"]) for e in _ev(events, "standby_promoted")] == \
        [(2, False)]
    assert [e["for_attempt"] for e in _ev(events, "standby_started")] == [2, 3]
    assert [e["reason"] for e in _ev(events, "standby_discarded")] == ["the run completed"]
    assert engine.spawned == [(1, 0)]  # attempt 2 was the standby's process


def test_a_standby_still_warming_up_is_adopted(fake_job):
    plan = {"exit_at_epoch": {"1": [3, -9]}, "standby_cold": True}
    rc, events, _, _ = run(fake_job(epochs=4, extra=_extra(CPU, "standby: on")), plan,
                           standby=True)
    assert rc == 0
    assert [e["path"] for e in _ev(events, "attempt_started")] == ["cold", "adopted"]


def test_a_standby_lost_while_warming_up_is_replaced_once_then_the_recovery_is_cold(fake_job):
    plan = {"exit_at_epoch": {"1": [3, -9]}, "standby_exit": {"2": 1}}
    rc, events, engine, _ = run(fake_job(epochs=4, extra=_extra(CPU, "standby: on")), plan,
                                standby=True)
    assert rc == 0
    assert [e["for_attempt"] for e in _ev(events, "standby_lost")] == [2, 2]
    started = _ev(events, "attempt_started")
    assert started[1]["path"] == "cold" and engine.spawned == [(1, 0), (2, 0)]


def test_a_group_stops_every_rank_when_one_dies_and_restarts_as_one(fake_job):
    plan = {"exit_at_epoch": {"1": [2, -9, 1]}}
    rc, events, engine, _ = run(fake_job(epochs=3, extra=_extra(CPU, "workers: 2")), plan)
    assert rc == 0 and _epochs(events) == [1, 2, 3]
    failed = _ev(events, "group_member_failed")
    assert [(e["rank"], e["exit_code"], e["stopping"]) for e in failed] == [(1, -9, [0])]
    assert engine.killed == [(1, 0, -15)]  # rank 0 stopped, not left in a collective
    assert engine.spawned == [(1, 0), (1, 1), (2, 0), (2, 1)] and engine.opened == [2, 2]
    assert [e["from_epoch"] for e in _ev(events, "attempt_started")] == [0, 1]


def test_every_rank_of_a_group_restores_the_step_the_supervisor_names(fake_job):
    from orchestrator.core.rundir import ENV_RESTORE_STEP

    plan = {"exit_at_epoch": {"1": [3, 1, 0]}}
    rc, _, engine, _ = run(fake_job(epochs=3, extra=_extra(CPU, "workers: 2")), plan)
    assert rc == 0
    assert [env[ENV_RESTORE_STEP] for env in engine.envs] == ["", "", "20", "20"]
    ranks = [json.loads(env["TF_CONFIG"])["task"]["index"] for env in engine.envs]
    assert ranks == [0, 1, 0, 1]


def test_one_worker_is_never_placed_and_has_no_cluster(fake_job):
    rc, _, engine, _ = run(fake_job(epochs=1, extra=CPU))
    assert rc == 0 and engine.opened == [] and "TF_CONFIG" not in engine.envs[0]


# ---------------------------------------------------------------------- moved from the
# integration tier: what they prove is the loop's, the ledger's and the policy's, not a process's


def test_a_second_run_of_a_completed_job_starts_no_worker(fake_job):
    job = fake_job(epochs=2, extra=CPU)
    run(job)
    rc, events, engine, _ = run(job)
    assert rc == 0 and engine.spawned == []
    assert len(_ev(events, "attempt_started")) == 1  # the first run's
    assert len(_ev(events, "run_completed")) == 1


def test_mid_epoch_checkpoints_journal_each_epoch_once(fake_job):
    rc, events, _, _ = run(fake_job(epochs=4, extra=CPU),
                           {"mid_epoch": True, "exit_at_epoch": {"1": [3, -9]}})
    assert rc == 0
    assert _epochs(events) == [1, 2, 3, 4]
    committed = [(e["epoch"], e["batch"]) for e in _ev(events, "checkpoint_committed")]
    assert (2, 5) in committed and (2, 0) in committed and len(committed) == len(set(committed))


def test_training_ended_early_by_a_callback_counts_as_completed(fake_job):
    job = fake_job(epochs=6, extra=CPU)
    rc, events, _, _ = run(job, {"stop_early": {"1": 2}})
    assert rc == 0
    assert _epochs(events) == [1, 2]
    assert events[-1]["event"] == "run_completed" and events[-1]["epochs"] == 2
    rc, events, engine, _ = run(job)
    assert rc == 0 and engine.spawned == [] and len(_ev(events, "attempt_started")) == 1


def test_a_factory_typeerror_is_the_jobs_and_stops_at_once(fake_job, tmp_path):
    """The supervisor tells classify which factories are the job's: a TypeError raised where
    the worker calls ``nowhere:build`` with arguments it does not take is ``user_error``."""
    import traceback

    from orchestrator.train import jobcode

    (tmp_path / "nowhere.py").write_text("def build(width=8):\n    return width\n")
    job = fake_job(epochs=2, extra=CPU)
    try:
        spec = load(job)
        jobcode.resolve(spec, spec.model, "model").func(widht=3)
    except TypeError as exc:  # a real record of a real call, as the worker writes it
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
        error = {"type": "TypeError", "qualified_type": "builtins.TypeError",
                 "message": str(exc), "traceback": tb}
    rc, events, engine, _ = run(job, {"error": {"1": error}})
    assert rc == 1 and engine.spawned == [(1, 0)]
    ended = _ev(events, "attempt_ended")[0]
    assert (ended["kind"], ended["signature"], ended["layer"]) == ("user_error", None,
                                                                   "exception")
    assert _ev(events, "run_failed")[0]["evidence"] == \
        "TypeError: build() got an unexpected keyword argument 'widht'"


# TensorFlow's record of an out-of-memory error, as the worker writes it
OOM = {"type": "ResourceExhaustedError", "message": "OOM when allocating tensor with "
       "shape[64,3,224,224] and type float on /job:localhost/replica:0/task:0/device:GPU:0"}


def test_out_of_memory_halves_the_batch_when_allowed_and_it_sticks(fake_job):
    job = fake_job(epochs=2, extra=_extra(CPU, "recovery: {halve_batch: true}"))
    rc, events, engine, _ = run(job, {"error": {"1": OOM, "2": OOM}})
    assert rc == 0
    assert [(e["action"], e["batch_size"]) for e in _ev(events, "recovery")] == [
        ("halve_batch", 4), ("halve_batch", 2)]
    assert [env.get("ORCHESTRATOR_BATCH_SIZE") for env in engine.envs] == [None, "4", "2"]


def test_out_of_memory_without_the_opt_in_restarts_once_then_gives_up_with_a_report(
        fake_job):
    rc, events, engine, _ = run(fake_job(epochs=2, extra=CPU), {"error": {"1": OOM, "2": OOM}})
    assert rc == 1 and len(engine.spawned) == 2
    assert [e["action"] for e in _ev(events, "recovery")] == ["restart", "give_up"]
    assert "skipped halve_batch: not enabled" in _ev(events, "recovery")[0]["detail"]
    failed = _ev(events, "run_failed")[0]
    assert failed["kind"] == "out_of_memory" and failed["tried"] == ["restart"]
    assert failed["evidence"].startswith("ResourceExhaustedError: OOM when allocating")


def test_a_user_error_stops_at_once_with_a_final_report(fake_job, said):
    rc, events, engine, _ = run(fake_job(epochs=2, extra=CPU), {"error": {"1": {
        "type": "ValueError", "message": "Please provide a TPU Name to connect to."}}})
    assert rc == 1 and engine.spawned == [(1, 0)]
    failed = _ev(events, "run_failed")[0]
    assert (failed["kind"], failed["tried"]) == ("user_error", [])
    assert failed["evidence"] == "ValueError: Please provide a TPU Name to connect to."
    assert any("kind: user_error" in line for line in said)
    assert any("tried: nothing" in line for line in said)


def test_an_unknown_exit_is_restarted(fake_job):
    rc, events, _, _ = run(fake_job(epochs=3, extra=CPU), {"exit_at_epoch": {"1": [2, 3]}})
    assert rc == 0
    assert [(e["kind"], e["action"]) for e in _ev(events, "recovery")] == [("unknown",
                                                                             "restart")]


def test_a_new_run_where_a_deleted_one_was_does_not_resume_its_local_checkpoints(
        fake_job, tmp_path, said):
    import shutil

    job = fake_job(epochs=2, extra=CPU)
    rc, first, _, _ = run(job)
    assert rc == 0
    local = first[-1]["checkpoint"].rsplit(os.sep, 1)[0]  # the local tier's folder
    assert os.listdir(local)
    rc, again, _, _ = run(job)  # the same run again: it is complete, nothing set aside
    assert rc == 0 and not _ev(again, "local_checkpoints_set_aside")

    shutil.rmtree(tmp_path / "run")  # the user throws the run away and starts anew
    rc, events, _, _ = run(job)
    assert rc == 0
    aside = _ev(events, "local_checkpoints_set_aside")[0]
    assert aside["path"] == local  # kept, not deleted: the earlier final checkpoint is there
    assert os.path.basename(first[-1]["checkpoint"]) in os.listdir(aside["moved_to"])
    assert aside["entries"] == len(os.listdir(aside["moved_to"]))
    assert [e["from_epoch"] for e in _ev(events, "attempt_started")] == [0]  # from scratch
    assert _epochs(events) == [1, 2] and any("starts from scratch" in line for line in said)


def test_standby_off_starts_none(fake_job):
    rc, events, _, _ = run(fake_job(epochs=3, extra=_extra(CPU, "standby: off")),
                           {"exit_at_epoch": {"1": [2, -9]}}, standby=True)
    assert rc == 0
    assert not _ev(events, "standby_started")
    assert [e.get("cold_reason") for e in _ev(events, "attempt_started")] == [
        "standby: off", "standby: off"]


def test_an_action_that_needs_a_fresh_process_discards_the_standby(fake_job):
    job = fake_job(epochs=4, extra=_extra(
        CPU, "recovery: {ladders: {unknown: [reinit_accelerator, restart]}}", "standby: on"))
    rc, events, _, _ = run(job, {"exit_at_epoch": {"1": [3, 1]}}, standby=True)
    assert rc == 0
    discarded = _ev(events, "standby_discarded")
    assert discarded[0]["for_attempt"] == 2 and discarded[0]["was_alive"]
    assert "reinit_accelerator needs a fresh process" in discarded[0]["reason"]
    # discarded before the action is journaled (a reinstall must not run beside it)
    order = [e["event"] for e in events]
    assert order.index("standby_discarded") < order.index("recovery")
    started = _ev(events, "attempt_started")
    assert [e["path"] for e in started] == ["cold", "cold"]
    assert started[1]["cold_reason"] == "no standby was up"
    assert not _ev(events, "standby_promoted")


def test_a_completed_run_leaves_no_blob_that_no_kept_checkpoint_names(fake_job):
    """Retention keeps an unnamed blob for a minute (the storage's clock may differ from
    ours): a run that checkpoints more often than that ended with the blobs of every
    checkpoint it had deleted in its last minute. Here: one deleted just before the run."""
    import numpy as np

    from orchestrator.checkpoint import tiers

    assert run(fake_job(epochs=1, extra=CPU))[0] == 0
    job = fake_job(epochs=2, extra=CPU)  # one epoch more: the run resumes
    local = tiers.for_spec(load(job)).local
    gone = local.commit(7, None, {"epoch": 0, "batch": 7, "metrics": {}},
                        arrays={"w": np.arange(64, dtype="float32")})
    local.remove(gone)
    assert local.collect_blobs() == []  # younger than the grace: retention keeps it
    rc, events, _, _ = run(job)
    assert rc == 0 and _epochs(events) == [1, 2]
    on_disk = {n for _, _, names in os.walk(os.path.join(local.root, "blobs")) for n in names}
    assert on_disk == set() == local.named_blobs()

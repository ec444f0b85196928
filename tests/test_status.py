"""`orchestrator status` and the goodput accounting: on runs made by the real supervisor with the
fake worker, and on hand-written journals with the fields later supervisors add."""
import json
import os
import signal
import time

import pytest

from helpers import supervisor_process

from orchestrator import cli
from orchestrator.ops import timeline
from orchestrator.core.journal import Journal
from orchestrator.ops.status import format_status, run_status


@pytest.mark.integration
def test_status_of_a_finished_run(finished_run, capsys):
    s = run_status(finished_run)
    assert s["state"] == "completed"
    assert (s["epoch"], s["epochs"], s["step"], s["attempt"]) == (5, 5, 50, 2)
    assert s["restarts"] == 1 and s["restarts_by_kind"] == {"killed": 1}
    assert s["last_error"] == "attempt 1 (killed): killed by SIGKILL"
    assert 0 < s["goodput"] < 1
    assert s["lost_to_faults_s"] == s["time_by_cause_s"]["killed"] > 0
    assert sum(s["time_by_cause_s"].values()) == pytest.approx(s["wall_s"], abs=0.01)
    assert s["checkpoints_by_tier"]["run_dir"]["step"] == 50
    assert s["weights_sha256"] == "fake-5"

    assert cli.main(["status", finished_run]) == 0
    text = capsys.readouterr().out
    assert f"run fake ({finished_run}): COMPLETED" in text
    assert "epoch 5/5, step 50; attempt 2" in text
    assert "restarts: 1 (killed 1); failed attempts: 1" in text
    assert f"goodput: {s['goodput']:.1%}" in text
    assert "last checkpoint (run_dir): epoch 5, step 50" in text
    assert "last error: attempt 1 (killed): killed by SIGKILL" in text

    assert cli.main(["status", finished_run, "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["state"] == "completed" and j["restarts_by_kind"] == {"killed": 1}


@pytest.mark.integration
def test_status_says_the_backend_the_run_trains_on_and_a_run_from_before_is_tensorflow(
        finished_run, capsys):
    import json
    import os

    assert run_status(finished_run)["backend"]["name"] == "tensorflow"
    info_path = os.path.join(finished_run, "run.json")
    info = json.load(open(info_path))
    json.dump(dict(info, backend="jax"), open(info_path, "w"))
    assert run_status(finished_run)["backend"]["name"] == "jax"
    assert cli.main(["status", finished_run]) == 0
    assert "  backend: jax" in capsys.readouterr().out
    del info["backend"]  # a run.json written before there were two backends
    json.dump(info, open(info_path, "w"))
    assert run_status(finished_run)["backend"]["name"] == "tensorflow"


@pytest.mark.integration
def test_status_of_a_failed_run(failed_run, capsys):
    s = run_status(failed_run)
    assert s["state"] == "failed"
    assert (s["epoch"], s["attempts"], s["failed_attempts"]) == (0, 3, 3)
    assert s["restarts_by_kind"] == {"unknown": 2}
    assert s["goodput"] == 0.0 and s["useful_s"] == 0
    assert s["last_error"] == "attempt 3 (unknown): RuntimeError: planned exit 1"
    assert "restart budget of 2 spent" in s["failure"]["reason"]
    assert cli.main(["status", failed_run]) == 0
    text = capsys.readouterr().out
    assert "FAILED" in text and "last checkpoint (run_dir): none" in text
    assert "last error: attempt 3 (unknown): RuntimeError: planned exit 1" in text
    assert "failed: restart budget of 2 spent" in text


@pytest.mark.integration
def test_status_shows_the_preemption_budget_apart_from_the_error_budget(finished_run, capsys):
    assert run_status(finished_run)["budgets"] == {"errors": 0, "errors_max": 2,
                                                   "preemptions": 1, "preemptions_max": None}
    assert cli.main(["status", finished_run]) == 0
    assert ("budgets: errors 0 of 2 since the last checkpoint; preemptions 1 (no limit)"
            in capsys.readouterr().out)


@pytest.mark.integration
def test_status_of_a_failed_run_shows_the_spent_error_budget(failed_run):
    assert run_status(failed_run)["budgets"] == {"errors": 3, "errors_max": 2,
                                                 "preemptions": 0, "preemptions_max": None}


def test_status_of_no_run_dir_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path)]) == 2
    assert "not a run directory (no events.jsonl)" in capsys.readouterr().err


def _journal(path, rows):
    """Hand-written events with chosen timestamps: (ts, event, fields)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "events.jsonl"), "w") as f:
        for ts, ev, fields in rows:
            f.write(json.dumps({"ts": ts, "event": ev, **fields}) + "\n")
    return path


# Two sessions: a SIGKILL then a vanished supervisor (VM recycled), an hour away, then an
# out-of-memory fault with issue 3's fields (kind, signature, recovery), then completion.
TWO_SESSIONS = [
    (1000, "run_started", {"epochs": 5}),
    (1000, "attempt_started", {"attempt": 1, "from_epoch": 0}),
    (1010, "worker_ready", {"attempt": 1, "steps_per_epoch": 10}),
    (1020, "first_step", {"attempt": 1}),
    (1050, "epoch_completed", {"epoch": 1, "metrics": {"loss": 1.0}, "attempt": 1}),
    (1050, "checkpoint_committed", {"epoch": 1, "step": 10}),
    (1080, "epoch_completed", {"epoch": 2, "metrics": {"loss": 0.5}, "attempt": 1}),
    (1080, "checkpoint_committed", {"epoch": 2, "step": 20}),
    (1090, "attempt_ended", {"attempt": 1, "exit_code": -9, "signal": "SIGKILL"}),
    (1090, "restart", {"after_attempt": 1, "delay_s": 5, "restart": 1}),
    (1095, "attempt_started", {"attempt": 2, "from_epoch": 2}),
    (1100, "worker_ready", {"attempt": 2}),
    (1105, "first_step", {"attempt": 2}),
    (1130, "epoch_completed", {"epoch": 3, "metrics": {"loss": 0.4}, "attempt": 2}),
    (1130, "checkpoint_committed", {"epoch": 3, "step": 30}),
    (1135, "checkpoint_durable", {"epoch": 3, "step": 30, "verified": True}),
    (1140, "fault_injected", {"fault": "kill@step=35", "attempt": 2}),
    (5000, "run_resumed", {"epochs": 5}),
    (5001, "attempt_started", {"attempt": 3, "from_epoch": 3}),
    (5021, "first_step", {"attempt": 3}),
    (5051, "epoch_completed", {"epoch": 4, "metrics": {"loss": 0.3}, "attempt": 3}),
    (5051, "checkpoint_committed", {"epoch": 4, "step": 40}),
    (5055, "attempt_ended", {"attempt": 3, "exit_code": 1, "kind": "out_of_memory",
                             "signature": "OOM when allocating",
                             "error": {"type": "ResourceExhaustedError",
                                       "message": "OOM when allocating tensor\nmore"}}),
    (5055, "recovery", {"attempt": 3, "kind": "out_of_memory", "action": "halve_batch",
                        "detail": "batch 64 -> 32"}),
    (5055, "restart", {"after_attempt": 3, "delay_s": 2, "restart": 2}),
    (5057, "attempt_started", {"attempt": 4, "from_epoch": 4}),
    (5067, "first_step", {"attempt": 4}),
    (5097, "epoch_completed", {"epoch": 5, "metrics": {"loss": 0.2}, "attempt": 4}),
    (5097, "checkpoint_committed", {"epoch": 5, "step": 50}),
    (5100, "attempt_ended", {"attempt": 4, "exit_code": 0}),
    (5101, "run_completed", {"epochs": 5, "weights_sha256": "abc"}),
]


def test_goodput_accounting_is_exact_on_a_known_journal(tmp_path):
    path = _journal(str(tmp_path / "run"), TWO_SESSIONS)
    tl = timeline.build(Journal(os.path.join(path, "events.jsonl")).events())
    assert [s.how for s in tl.sessions] == ["vanished", "completed"]
    a = timeline.account(tl)
    # session 1: 1000-1140, session 2: 5000-5101 (see the module docstring for the rules)
    assert a["wall_s"] == 241 and a["away_s"] == 3860
    assert a["useful_s"] == 60 + 25 + 30 + 30
    assert a["by_cause_s"] == {"useful": 145, "killed": 10 + 5 + 10 + 10 + 1 + 20,
                               "startup": 20, "out_of_memory": 4 + 2 + 10, "overhead": 3 + 1}
    assert a["goodput"] == round(145 / 241, 4)
    assert a["lost_to_faults_s"] == 56 + 16
    assert timeline.restarts_by_kind(tl) == {"killed": 1, "out_of_memory": 1}
    kinds = [(f.attempt, f.kind) for f in tl.faults]
    assert kinds == [(1, "killed"), (2, "killed"), (3, "out_of_memory")]
    oom = tl.faults[2]
    assert oom.detail == "ResourceExhaustedError: OOM when allocating tensor"
    assert "halve_batch batch 64 -> 32" in oom.action
    assert "vanished" in tl.faults[1].detail and "resumed" in tl.faults[1].action


def test_status_reads_new_fields_and_tiers(tmp_path):
    path = _journal(str(tmp_path / "run"), TWO_SESSIONS)
    s = run_status(path, now=5200)
    assert s["state"] == "completed"
    assert s["faults_by_kind"] == {"killed": 2, "out_of_memory": 1}
    assert s["last_error"] == ("attempt 3 (out_of_memory): ResourceExhaustedError: OOM when "
                               "allocating tensor")
    assert s["checkpoints_by_tier"]["durable"]["step"] == 30
    assert s["checkpoints_by_tier"]["run_dir"] is None  # no checkpoint on disk here
    text = format_status(s, now=5200)
    assert "restarts: 2 (killed 1, out_of_memory 1)" in text
    assert "goodput: 60.2% (useful 2m25s of 4m01s supervised); lost to faults: 1m12s" in text
    assert "last checkpoint (durable): epoch 3, step 30" in text


def test_run_failed_with_a_kind_and_evidence(tmp_path):
    rows = TWO_SESSIONS[:17] + [
        (1141, "run_failed", {"reason": "crash loop: the same kind 3 times", "kind": "hang",
                              "evidence": "no heartbeat for 300 s", "tried": ["restart"],
                              "last_attempt": 2})]
    s = run_status(_journal(str(tmp_path / "run"), rows), now=2000)
    assert s["state"] == "failed"
    assert s["failure"] == {"kind": "hang", "reason": "crash loop: the same kind 3 times",
                            "evidence": "no heartbeat for 300 s", "tried": ["restart"]}
    assert s["last_error"].startswith("attempt 2 (hang): ")


def test_a_running_run_counts_uncommitted_training_as_in_progress(tmp_path):
    path = _journal(str(tmp_path / "run"), TWO_SESSIONS[:15])
    tl = timeline.build(Journal(os.path.join(path, "events.jsonl")).events(), running=True,
                        now=1150)
    a = timeline.account(tl)
    assert tl.sessions[-1].how == "running"
    assert a["by_cause_s"]["in_progress"] == 20  # 1130 (last commit) -> now
    assert a["wall_s"] == 150


def test_a_lock_left_by_a_recycled_vm_does_not_read_as_running(tmp_path):
    path = _journal(str(tmp_path / "run"), TWO_SESSIONS[:15])
    lock = os.path.join(path, "lock")
    for silent_s, state in ((10, "running"), (600, "stopped")):
        with open(lock, "w") as f:
            json.dump({"host": "another-colab-vm", "pid": 1,
                       "refreshed": time.time() - silent_s}, f)
        assert run_status(path)["state"] == state


@pytest.mark.integration
def test_status_of_a_running_run_shows_where_the_worker_is(fake_job, tmp_path, capsys):
    job = fake_job(epochs=3)
    p = supervisor_process(job, {"epoch_s": 5, "batches": 600})
    try:
        hb = tmp_path / "run" / "heartbeat.json"
        deadline = time.time() + 60
        while time.time() < deadline:
            if hb.exists() and json.loads(hb.read_text() or "{}").get("batch", 0) >= 2:
                break
            time.sleep(0.1)
        s = run_status(str(tmp_path / "run"))
        assert s["state"] == "running" and s["attempt"] == 1
        assert s["live"]["epoch"] == 0 and s["live"]["batch"] >= 2
        assert s["live"]["steps_per_epoch"] == 600
        assert s["time_by_cause_s"].get("in_progress", 0) > 0 and s["goodput"] == 0.0
        assert cli.main(["status", str(tmp_path / "run")]) == 0
        assert "RUNNING" in capsys.readouterr().out
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    assert run_status(str(tmp_path / "run"))["state"] == "stopped"


def test_status_lists_every_rank_with_its_node_and_last_heartbeat(tmp_path):
    """A group's ranks as the last attempt placed them, each with the beat relayed from its
    node (rank 0's in the run's folder, rank k's in rank-k/, where supervise/relay.py writes
    them and the control mirror copies them); a beat of an earlier attempt is not this one's."""
    workers = [{"rank": 0, "pid": 101, "host": "a", "node": "127.0.0.2"},
               {"rank": 1, "pid": 202, "host": "b", "node": "127.0.0.3"},
               {"rank": 2, "pid": 303, "host": "c", "node": "127.0.0.5"}]
    path = _journal(str(tmp_path / "run"), [
        (1000, "run_started", {"epochs": 2}),
        (1000, "attempt_started", {"attempt": 1, "from_epoch": 0, "engine": "ray",
                                   "workers": workers})])
    beats = {".": {"time": 1090.0, "pid": 101, "attempt": 1, "phase": "training", "epoch": 1,
                   "batch": 3, "step": 47},
             "rank-1": {"time": 1060.5, "pid": 202, "attempt": 1, "phase": "training",
                        "epoch": 1, "batch": 1, "step": 45},
             "rank-2": {"time": 900.0, "pid": 9, "attempt": 0, "phase": "starting"}}
    for folder, beat in beats.items():
        os.makedirs(os.path.join(path, folder), exist_ok=True)
        with open(os.path.join(path, folder, "heartbeat.json"), "w") as f:
            json.dump(beat, f)
    s = run_status(path, now=1100.0)
    assert s["ranks"] == [
        {"rank": 0, "node": "127.0.0.2", "host": "a", "pid": 101, "phase": "training",
         "epoch": 1, "step": 47, "heartbeat_age_s": 10.0},
        {"rank": 1, "node": "127.0.0.3", "host": "b", "pid": 202, "phase": "training",
         "epoch": 1, "step": 45, "heartbeat_age_s": 39.5},
        {"rank": 2, "node": "127.0.0.5", "host": "c", "pid": 303, "phase": None,
         "epoch": None, "step": None, "heartbeat_age_s": None}]
    text = format_status(s, now=1100.0)
    assert "    rank 0 on 127.0.0.2 pid 101: training, epoch 1 step 47, heartbeat 10s ago" in text
    assert "    rank 1 on 127.0.0.3 pid 202: training, epoch 1 step 45, heartbeat 40s ago" in text
    assert "    rank 2 on 127.0.0.5 pid 303: no heartbeat in this attempt" in text
    one = _journal(str(tmp_path / "one"), [(1000, "run_started", {"epochs": 2}),
                                           (1000, "attempt_started", {"attempt": 1})])
    assert run_status(one, now=1100.0)["ranks"] is None  # one worker: no ranks to list

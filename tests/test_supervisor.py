"""Supervisor logic with tiny fake workers (no TensorFlow): fast and exact."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from helpers import (ROOT, live, readme_run_dir_names, supervise, supervisor_process,
                     unlisted_in_run_dir, wait_until, wait_while_running)
from orchestrator.core import heartbeat
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import pid_alive
from orchestrator.core.procid import is_running

# integration: the real supervisor with the fake worker: real processes, real waiting
pytestmark = pytest.mark.integration



def _run(job, plan):
    return supervise(job, plan)


def _epochs(events):
    return [e["epoch"] for e in events if e["event"] == "epoch_completed"]


def test_clean_run_completes_and_journals_each_epoch_once(fake_job):
    rc, out, events = _run(fake_job(epochs=4), {})
    assert rc == 0
    assert _epochs(events) == [1, 2, 3, 4]
    assert [e["event"] for e in events][-1] == "run_completed"
    assert events[-1]["weights_sha256"] == "fake-4"
    assert "completed: 4 epochs" in out


# What the fake worker itself writes into the run directory for the tests to read (its pid, the
# recovery overrides it was given): not the product's.
FAKE_WORKER_FILES = ["fake-<n>.pid", "fake-<n>.env.json"]


def test_a_completed_run_directory_holds_only_what_the_readme_lists(fake_job, tmp_path):
    """Attempt 1 is SIGKILLed mid-run, attempt 2 after its last commit, in its export (the
    staging folder made, nothing in it yet): the run completes, and its directory holds what
    the README's list names, the killed export's folder gone."""
    plan = {"exit_at_epoch": {"1": [2, -9]}, "killed_exporting": ["2"], "batches": 3}
    rc, out, events = _run(fake_job(epochs=3), plan)
    assert rc == 0, out
    assert [e.get("exit_code") for e in events if e["event"] == "attempt_ended"] == [-9, -9]
    assert "removed export.tmp-" in out and "killed half-way" in out
    run, listed = tmp_path / "run", readme_run_dir_names() + FAKE_WORKER_FILES
    assert unlisted_in_run_dir(run, listed) == []
    (run / "export.tmp-1-abcdef").mkdir()  # the comparison sees what the list does not name
    assert unlisted_in_run_dir(run, listed) == ["export.tmp-1-abcdef/"]


def test_killed_worker_is_restarted_and_resumes_after_last_commit(fake_job):
    plan = {"exit_at_epoch": {"1": [3, -9], "2": [4, -9]}}
    rc, out, events = _run(fake_job(epochs=5), plan)
    assert rc == 0
    assert _epochs(events) == [1, 2, 3, 4, 5]
    started = [e for e in events if e["event"] == "attempt_started"]
    assert [e["from_epoch"] for e in started] == [0, 2, 3]
    ended = [e for e in events if e["event"] == "attempt_ended"]
    assert [e["signal"] for e in ended] == ["SIGKILL", "SIGKILL", None]
    assert sum(e["event"] == "restart" for e in events) == 2
    assert "killed by SIGKILL" in out


def test_worker_exit_is_noticed_at_once(fake_job):
    _, _, events = _run(fake_job(restarts="{max: 1, backoff: {initial: 0}}"),
                        {"exit": {"1": 3}})
    start = next(e for e in events if e["event"] == "attempt_started")
    end = next(e for e in events if e["event"] == "attempt_ended")
    assert end["ts"] - start["ts"] < 2.0  # a python start-up, not a polling period


def test_supervisor_killed_then_rerun_resumes_and_stops_the_orphan(fake_job, tmp_path):
    job = fake_job(epochs=6)
    run = tmp_path / "run"
    p = supervisor_process(job, {"sleep_forever": ["1"]})
    deadline = time.time() + 20
    while not (run / "fake-1.pid").exists() and time.time() < deadline:
        time.sleep(0.05)
    orphan = int((run / "fake-1.pid").read_text())
    p.send_signal(signal.SIGKILL)
    p.wait()
    rc, out, events = _run(job, {})
    assert rc == 0, out
    assert "took over the run directory from a dead supervisor" in out
    assert any(e["event"] == "lock_taken_over" for e in events)
    assert _epochs(events) == [1, 2, 3, 4, 5, 6]
    killed = [e for e in events if e["event"] == "orphan_worker_killed"]
    assert [(e["attempt"], e["pid"]) for e in killed] == [(1, orphan)]  # proven ours: killed
    deadline = time.time() + 5
    while pid_alive(orphan) and time.time() < deadline:
        time.sleep(0.05)
    assert not pid_alive(orphan), f"orphan worker {orphan} still alive"


def _journaled_pid_is(path, pid: int, keep_identity: bool) -> None:
    """Rewrite a dead run's journal as if attempt 1's worker had had ``pid``: with the
    identity recorded for the real worker (its start time and command line, now another
    process's pid), or none (a journal of an older version)."""
    lines = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            e = json.loads(line)
        except ValueError:
            lines.append(line)  # a torn last line, as a SIGKILL may leave
            continue
        if e["event"] == "attempt_started":
            assert e["identity"]["cmdline"][1].endswith("fake_worker.py")
            e["pid"] = pid
            if not keep_identity:
                del e["identity"]
            line = json.dumps(e) + "\n"
        lines.append(line)
    path.write_text("".join(lines))


@pytest.mark.parametrize("keep_identity", [True, False], ids=["other-start-time", "no-identity"])
def test_a_bystander_holding_a_journaled_pid_survives_the_restart_of_a_dead_run(
        fake_job, tmp_path, keep_identity):
    """The supervisor and its worker were SIGKILLed (the VM died); a stranger that leads its
    own process group now holds the pid the journal recorded for the worker. The restart
    leaves it alone, journals why, and completes the run."""
    job = fake_job(epochs=3)
    run = tmp_path / "run"
    p = supervisor_process(job, {"sleep_forever": ["1"]})
    wait_while_running(p, lambda: (run / "fake-1.pid").exists(), what="attempt 1 spawned")
    worker = int((run / "fake-1.pid").read_text())
    p.kill()
    p.communicate()
    os.killpg(worker, signal.SIGKILL)
    wait_until(lambda: not is_running(worker), timeout=60, what="the dead run's worker gone")
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        for journal in (live(job, run).journal, str(run / "events.jsonl")):
            if os.path.exists(journal):
                _journaled_pid_is(pathlib.Path(journal), bystander.pid, keep_identity)
        rc, out, events = _run(job, {})
        assert rc == 0, out
        assert _epochs(events) == [1, 2, 3]
        assert bystander.poll() is None, "the bystander was killed"
        left = [e for e in events if e["event"] == "process_left_alone"]
        assert [(e["attempt"], e["pid"]) for e in left] == [(1, bystander.pid)]
        why = "is another process now" if keep_identity else "no identity was recorded"
        assert why in left[0]["reason"], left[0]
        assert not [e for e in events if e["event"] == "orphan_worker_killed"]
    finally:
        bystander.kill()
        bystander.wait()


def test_sigterm_stops_the_worker_group_and_keeps_the_run_resumable(fake_job, tmp_path):
    job = fake_job(epochs=3)
    run = tmp_path / "run"
    p = supervisor_process(job, {"sleep_forever": ["1"]})
    deadline = time.time() + 20
    while not (run / "fake-1.pid").exists() and time.time() < deadline:
        time.sleep(0.05)
    worker = int((run / "fake-1.pid").read_text())
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 130, out
    assert "stopped; the run resumes" in out
    assert not pid_alive(worker), "worker survived the supervisor's stop"
    rc, _, events = _run(job, {})
    assert rc == 0 and _epochs(events) == [1, 2, 3]


def test_supervisor_side_never_imports_tensorflow():
    # every module outside train/, found by walking the package (no hand-kept list)
    code = ("import importlib, pkgutil, sys, orchestrator\n"
            "for m in pkgutil.walk_packages(orchestrator.__path__, 'orchestrator.'):\n"
            "    if not m.name.startswith(('orchestrator.train', 'orchestrator.__main__')):\n"
            "        importlib.import_module(m.name)\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]\n"
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def test_sigterm_to_the_supervisor_is_a_preemption_notice_the_worker_saves_its_step(fake_job,
                                                                                    tmp_path):
    job = fake_job(epochs=3, extra="preempt_grace: 10")
    run = tmp_path / "run"
    p = supervisor_process(job, {"epoch_s": 4, "batches": 10})
    deadline = time.time() + 30
    while time.time() < deadline:
        hb = heartbeat.read(live(job, run).control)
        if hb and hb.get("phase") == "training" and hb.get("epoch") == 0 and hb.get("batch", 0) >= 3:
            break
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 130, out
    events = Journal(str(run / "events.jsonl")).events()
    names = [e["event"] for e in events]
    preempted = next(e for e in events if e["event"] == "preempted")
    assert 3 <= preempted["step"] < 10  # in the middle of epoch 1
    committed = [e for e in events if e["event"] == "checkpoint_committed"]
    assert [c["step"] for c in committed] == [preempted["step"]]
    assert names.index("checkpoint_committed") < names.index("supervisor_stopped")
    ended = [e for e in events if e["event"] == "attempt_ended"]
    assert ended == []  # a stop, not a failure: the next session resumes


def test_the_run_directory_gone_for_seconds_is_reported_and_the_run_completes(fake_job,
                                                                               tmp_path):
    """The whole run directory renamed away with a plain file in its place for 7 s (a Drive
    mount gone): the supervisor used to die of NotADirectoryError in the lock refresh."""
    job = fake_job(epochs=3)
    run, away = tmp_path / "run", tmp_path / "run-away"
    p = supervisor_process(job, {"epoch_s": 4, "batches": 10})
    deadline = time.time() + 30
    while time.time() < deadline and not (heartbeat.read(live(job, run).control) or {}).get(
            "phase") == "training":
        time.sleep(0.05)
    os.rename(run, away)
    run.write_text("not a directory: the mount is gone")
    time.sleep(7)  # longer than the lock refresh period (5 s)
    run.unlink()
    os.rename(away, run)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    events = Journal(str(run / "events.jsonl")).events()
    names = [e["event"] for e in events]
    assert "run_dir_unreachable" in names and "run_dir_restored" in names
    assert names.index("run_dir_unreachable") < names.index("run_dir_restored")
    restored = next(e for e in events if e["event"] == "run_dir_restored")
    assert restored["outage_s"] > 0
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2, 3]
    assert names[-1] == "run_completed"


def test_a_group_stops_every_rank_when_one_dies_and_restarts_as_one(fake_job, tmp_path):
    """workers: 2 (local engine) with the fake worker: rank 1 SIGKILLs itself as epoch 2
    begins; rank 0 is stopped at once, the failure is rank 1's, and attempt 2 (a new group)
    completes the run."""
    job = fake_job(epochs=3, extra="workers: 2")
    rc, out, events = supervise(job, {"epoch_s": 1.0, "exit_at_epoch": {"1": [2, -9, 1]}})
    assert rc == 0, out
    failed = [e for e in events if e["event"] == "group_member_failed"]
    assert [(e["attempt"], e["rank"], e["exit_code"], e["stopping"]) for e in failed] == \
        [(1, 1, -9, [0])]
    ended = [e for e in events if e["event"] == "attempt_ended"]
    assert [(e["exit_code"], e["kind"]) for e in ended] == [(-9, "killed"), (0, None)]
    starts = [e for e in events if e["event"] == "attempt_started"]
    assert [[w["rank"] for w in e["workers"]] for e in starts] == [[0, 1], [0, 1]]
    epochs = [(e["epoch"], e["attempt"]) for e in events if e["event"] == "epoch_completed"]
    # attempt 1's rank 0 was stopped a second before it could commit epoch 2: attempt 2 did
    assert [x[0] for x in epochs] == [1, 2, 3] and epochs[1:] == [(2, 2), (3, 2)]

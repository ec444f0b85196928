"""The warm standby with real workers: killed runs whose recoveries were promoted standbys end
with the uninterrupted run's weights, bit for bit."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import JAX_THEN_TF_IN_SOAK, NO_SAVED_MODEL, ROOT, live, wait_until
from test_e2e import DIGITS_JOB, digits_reference, write_job_files  # noqa: F401
from orchestrator.core import heartbeat
from orchestrator.core.journal import Journal

pytestmark = pytest.mark.e2e

# For a cold worker and a standby side by side (the standby's own job: one epoch)
JOB = """
name: digits-standby
model: digits_job:build_model
data: digits_job:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}
epochs: 1
batch_size: 32
strategy: cpu
seed: 5
deterministic: true
learning_rate: {schedule: step_decay, factor: 0.9, every: 5}
checkpoint: {every_epochs: 1, every_steps: 10, keep: 2}
restarts: {max: 4, backoff: {initial: 0.2, max: 1}}
heartbeat_interval: 0.05
""" + NO_SAVED_MODEL


# The killed run is the digits job of test_e2e, compared with the session's uninterrupted run
# of it (no reference of its own: a framework start and a whole training saved). It must
# outlast three standby warm-ups (up to ~40 s each with the suite's four processes on 2 cores):
# its 225 steps are slowed, sleeping, not computing (JAX trains digits twice as fast as
# TensorFlow: 160 epochs of real training were needed once), so the suite's CPU goes to the
# tests beside it, and the weights are the same.
SLOW_STEPS = "slow-steps@step=1,for=0.5"


def _job(tmp_path, name, standby):
    d = tmp_path / name
    d.mkdir()
    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), d)
    p = d / "job.yaml"
    p.write_text(JOB + f"standby: {standby}\n")
    return str(p)


def _start(job, run_dir, *args):
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                             str(run_dir), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait(journal, event, timeout=120, **match):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in journal.iter(event):
            if all(e.get(k) == v for k, v in match.items()):
                return e
        time.sleep(0.02)
    raise AssertionError(f"no {event} {match} within {timeout} s")


def _kill_mid_epoch(control, attempt, pid):
    """SIGKILL ``pid`` at a batch that is no checkpoint's (mid-epoch, work since the last
    checkpoint is lost and redone); returns the time of the kill. ``control``: the local
    control folder, where the heartbeat is written first."""
    def due():
        hb = heartbeat.read(control) or {}
        return (hb.get("attempt") == attempt and hb.get("phase") == "training"
                and 25 <= hb.get("batch", 0) <= 40 and hb.get("step", 0) % 10 not in (0, 9))
    wait_until(due, timeout=60, what=f"attempt {attempt} at a mid-epoch batch")
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return t


def _kill_between_epochs(control, attempt, pid):
    """SIGKILL ``pid`` once an epoch has ended, before the next one starts."""
    wait_until(lambda: (lambda hb: hb.get("attempt") == attempt
                        and hb.get("phase") == "epoch_end")(heartbeat.read(control) or {}),
               timeout=60, what=f"attempt {attempt} between epochs")
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return t


def _ev(events, name):
    return [e for e in events if e["event"] == name]


# The 2nd checkpoint's write is held in the background writer; training goes on until the next
# periodic one waits for it. The worker is killed while that write is in flight.
SLOW_WRITE = "delay-checkpoint@checkpoint=2,for=90"


@JAX_THEN_TF_IN_SOAK
def test_kills_mid_epoch_between_epochs_and_during_a_write_recover_warm_bit_identical(
        tmp_path, backend, digits_reference):
    ref_events = digits_reference["events"]
    run = tmp_path / "run"
    write_job_files(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(DIGITS_JOB + f"backend: {backend}\nstandby: on\n")
    job = str(job)
    ctl = live(job, run)
    journal = Journal(ctl.journal)
    sup = _start(job, run, "--fault", SLOW_WRITE, "--fault", SLOW_STEPS)
    try:
        # 1. the standby itself, killed while it warms up: it is replaced
        first = _wait(journal, "standby_started", for_attempt=2)
        time.sleep(1.0)
        os.kill(first["pid"], signal.SIGKILL)
        _wait(journal, "standby_lost", pid=first["pid"])
        # 2. the active worker killed while the 2nd checkpoint's write is in flight, once the
        #    replacement standby is ready: the standby becomes attempt 2, from the 1st
        ready2 = _wait(journal, "standby_ready", for_attempt=2)
        assert ready2["pid"] != first["pid"]
        slow = _wait(journal, "fault_injected", fault=SLOW_WRITE)
        a1 = _wait(journal, "attempt_started", attempt=1)
        assert time.time() < slow["until"] - 5, "the write was no longer in flight"
        kills = [(time.time(), 2, "during a background write")]
        os.kill(a1["pid"], signal.SIGKILL)
        # 3. the promoted worker killed mid-epoch once a standby stands behind it
        _wait(journal, "standby_ready", for_attempt=3)
        a2 = _wait(journal, "attempt_started", attempt=2)
        kills.append((_kill_mid_epoch(ctl.control, 2, a2["pid"]), 3, "mid-epoch"))
        # 4. and the next one killed between epochs
        _wait(journal, "standby_ready", for_attempt=4)
        a3 = _wait(journal, "attempt_started", attempt=3)
        kills.append((_kill_between_epochs(ctl.control, 3, a3["pid"]), 4, "between epochs"))
        out, _ = sup.communicate(timeout=300)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 0, out
    events = journal.events()

    started = {e["attempt"]: e for e in _ev(events, "attempt_started")}
    assert [started[n]["path"] for n in (1, 2, 3, 4)] == ["cold", "warm", "warm", "warm"]
    standbys = {e["for_attempt"]: e["pid"] for e in _ev(events, "standby_ready")}
    assert all(started[n]["pid"] == standbys[n] for n in (2, 3, 4))
    ready = {e["attempt"]: e for e in _ev(events, "worker_ready")}
    assert [ready[n]["warm"] for n in (1, 2, 3, 4)] == [False, True, True, True]
    # the write in flight at the kill (step 20, or 30 when the first write was still busy at
    # 20, skipped) never got its marker: attempt 2 resumes at the 1st, step 10
    assert slow["step"] in (20, 30) and ready[2]["resumed_from_step"] == 10
    for n in (2, 3, 4):  # each resume from the newest checkpoint committed before it
        before = events[:events.index(ready[n])]
        assert ready[n]["resumed_from_step"] == max(
            e["step"] for e in before if e["event"] == "checkpoint_committed"), n
    first_step = {e["attempt"]: e["ts"] for e in _ev(events, "first_step")}
    cold = first_step[1] - started[1]["ts"]
    print(f"\ncold start (attempt 1, process start -> first step): {cold:.2f} s")
    for t, n, where in kills:
        print(f"kill {where} -> first step of attempt {n} (a promoted standby): "
              f"{first_step[n] - t:.2f} s ({(first_step[n] - t) / cold:.2f}x)")
    assert not _ev(events, "resume_not_exact")
    assert heartbeat.read(str(run))["pid"] == started[4]["pid"]  # the trainer's pid

    done, ref_done = _ev(events, "run_completed")[0], _ev(ref_events, "run_completed")[0]
    assert done["weights_sha256"] == ref_done["weights_sha256"]
    assert done["state_sha256"] == ref_done["state_sha256"]
    metrics = [e["metrics"] for e in _ev(events, "epoch_completed")]
    assert metrics == [e["metrics"] for e in _ev(ref_events, "epoch_completed")]
    for e in _ev(events, "standby_started"):  # none outlives the run
        assert not os.path.exists(f"/proc/{e['pid']}") or _zombie(e["pid"]), e


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


@JAX_THEN_TF_IN_SOAK
def test_a_standby_promoted_before_any_checkpoint_trains_as_a_cold_worker_would(tmp_path,
                                                                                backend):
    """Its traced step is undone: promoted with no checkpoint, it starts from the very state a
    cold worker builds, and one epoch ends with the same weights; and so does one adopted (the
    line written at once, while it imports)."""
    path = _job(tmp_path, "one-epoch", "on")
    worker = [sys.executable, "-m", "orchestrator.train.worker", path, "--attempt", "1"]
    cold = subprocess.run(worker + ["--run-dir", str(tmp_path / "cold")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert cold.returncode == 0, cold.stdout + cold.stderr
    sb = subprocess.Popen(worker + ["--run-dir", str(tmp_path / "warm"), "--standby", "warm"],
                          cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in sb.stdout:
        lines.append(line)
        if line.startswith("[standby] ready"):
            break
    assert sb.poll() is None, "".join(lines)
    sb.stdin.write('{"attempt": 1}\n')
    sb.stdin.close()
    rest = sb.stdout.read()
    assert sb.wait(300) == 0, "".join(lines) + rest
    assert "a promoted standby" in rest

    def done(text):
        return next(ln for ln in text.splitlines() if ln.startswith("[worker] done"))

    assert done(rest) == done(cold.stdout)

    adopted = subprocess.run(worker + ["--run-dir", str(tmp_path / "adopted"), "--standby",
                                       "warm"], cwd=ROOT, input='{"attempt": 1}\n',
                             capture_output=True, text=True, timeout=300)
    assert adopted.returncode == 0, adopted.stdout + adopted.stderr
    assert "adopted as attempt 1" in adopted.stdout and "ready" not in adopted.stdout
    assert done(adopted.stdout) == done(cold.stdout)

"""Real TensorFlow: outside kills are preemptions, SIGTERM saves the step, a real bug still stops.

Each of these failed before kills were set apart from the job's own failures and before the
worker handled SIGTERM: the kills during start-up were taken for a crash loop after three, and a
SIGTERM lost everything since the last epoch end.
"""
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

# Checkpoints at epoch ends only, and the default restart budget (restarts.max: 3).
JOB = """
name: digits-preempt
model: digits_job:build_model
data: digits_job:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}
epochs: EPOCHS
batch_size: 32
strategy: cpu
seed: 5
deterministic: true
checkpoint: {every_epochs: 1}
heartbeat_interval: 0.05
""" + NO_SAVED_MODEL

BUGGY_CALLBACK = '''
import keras


class Bug(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 4:
            raise ValueError("index 4 is out of bounds for axis 0 with size 4")


def bug():
    return Bug()
'''


def _job(tmp_path, epochs=2, extra="", batch_size=32):
    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), tmp_path)
    p = tmp_path / "job.yaml"
    p.write_text(JOB.replace("EPOCHS", str(epochs)).replace("batch_size: 32",
                                                            f"batch_size: {batch_size}") + extra)
    return str(p)


def _start(job, run_dir):
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


_wait = wait_until  # (helpers)


def _ev(events, name):
    return [e for e in events if e["event"] == name]


def _catches_sigterm(pid: int) -> bool:
    """The process has its own SIGTERM handler (``SigCgt`` in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(ln.split()[1] for ln in f if ln.startswith("SigCgt:"))
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


def _started(journal, n):
    return next((e for e in journal.iter("attempt_started") if e["attempt"] == n), None)


def test_kills_during_start_up_and_training_complete_on_the_default_budget(tmp_path):
    # the default restart budget; no standby (`auto` started 3 after the kills, each a
    # framework start, and none was ready before the next kill)
    job = _job(tmp_path, epochs=2, extra="standby: off\n")
    run = tmp_path / "run"
    ctl = live(job, run)
    journal = Journal(ctl.journal)
    sup = _start(job, run)
    # four kills during start-up (before the first step; the first a SIGTERM), two in training
    for n in range(1, 5):
        pid = _wait(lambda: _started(journal, n), what=f"attempt {n}")["pid"]
        if n == 1:  # once it catches SIGTERM (beside two busy loops 0.8 s was too soon)
            _wait(lambda: _catches_sigterm(pid), what="attempt 1's SIGTERM handler")
        else:
            time.sleep(0.5 + 0.3 * n)
        assert not any(e["attempt"] == n for e in journal.iter("first_step"))
        os.kill(pid, signal.SIGTERM if n == 1 else signal.SIGKILL)
    for n in (5, 6):
        pid = _wait(lambda: _started(journal, n), what=f"attempt {n}")["pid"]
        _wait(lambda: (heartbeat.read(ctl.control) or {}).get("attempt") == n
              and heartbeat.read(ctl.control).get("phase") == "training", what="training")
        os.kill(pid, signal.SIGKILL)
    out, _ = sup.communicate(timeout=300)
    assert sup.returncode == 0, out
    events = journal.events()
    ended = _ev(events, "attempt_ended")
    assert [e["kind"] for e in ended][:6] == ["killed"] * 6
    assert ended[0]["exit_code"] == 143  # SIGTERM during start-up: a clean, prompt exit
    assert _ev(events, "preempted")[0]["step"] is None  # nothing new to save yet
    done = _ev(events, "run_completed")[0]
    assert done["preemptions"] == 6 and done["errors"] == 0
    assert "crash loop" not in out


def test_a_deterministic_bug_is_stopped_within_four_attempts(tmp_path):
    (tmp_path / "bug_cb.py").write_text(BUGGY_CALLBACK)
    job = _job(tmp_path, extra="callbacks: [{factory: bug_cb:bug}]\n"
                               "restarts: {max: 10, backoff: {initial: 0.1}}\n")
    p = subprocess.run([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                        str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    events = Journal(str(tmp_path / "run" / "events.jsonl")).events()
    assert 1 <= len(_ev(events, "attempt_started")) <= 4
    failed = _ev(events, "run_failed")[0]
    assert "ValueError" in failed["error"]["type"]


@JAX_THEN_TF_IN_SOAK
def test_sigterm_mid_epoch_saves_that_step_and_the_run_resumes_there_bit_identical(
        tmp_path, backend, digits_reference):
    # The digits job, compared with the session's uninterrupted run of it. Its steps slowed (the
    # weights are the same): the half epoch between the heartbeat this test reads and the
    # epoch's end outlasts the signal's way through the supervisor (45 steps of JAX's 3 ms did
    # not)
    write_job_files(tmp_path)
    job = tmp_path / "job.yaml"
    # (no standby: `auto` would start one after the notice, which nothing uses)
    job.write_text(DIGITS_JOB + f"backend: {backend}\nstandby: off\n")
    job = str(job)
    run = tmp_path / "run"
    ctl = live(job, run)
    journal = Journal(ctl.journal)
    sup = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                            str(run), "--fault", "slow-steps@step=1,for=0.04"], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    spe = _wait(lambda: next(journal.iter("worker_ready"), None))["steps_per_epoch"]
    target = spe + spe // 2  # the middle of epoch 2: epoch 1's checkpoint is behind
    _wait(lambda: (heartbeat.read(ctl.control) or {}).get("step", 0) >= target, what="step")
    sup.send_signal(signal.SIGTERM)
    out, _ = sup.communicate(timeout=60)
    assert sup.returncode == 130, out
    events = journal.events()
    preempted = _ev(events, "preempted")[0]
    saved = preempted["step"]
    assert saved % spe and saved >= target  # mid-epoch, not the epoch-end checkpoint
    assert preempted["seconds"] < 20  # within preempt_grace
    assert saved in [e["step"] for e in _ev(events, "checkpoint_committed")]

    again = subprocess.run([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                            str(run)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout
    events = journal.events()
    assert _ev(events, "worker_ready")[-1]["resumed_from_step"] == saved
    done = _ev(events, "run_completed")[-1]
    ref_done = _ev(digits_reference["events"], "run_completed")[0]
    assert done["weights_sha256"] == ref_done["weights_sha256"]


MEMORY_HOG = '''
import os

import keras
import numpy as np


class Hog(keras.callbacks.Callback):
    """Once per run, at batch 5: grows past the memory cgroup's limit."""

    def on_train_batch_end(self, batch, logs=None):
        marker = os.path.join(os.path.dirname(__file__), "hogged")
        if batch == 5 and not os.path.exists(marker):
            open(marker, "w").close()
            self.held = [np.ones(1 << 24) for _ in range(64)]  # 8 GiB, page by page


def hog():
    return Hog()
'''


def test_a_real_oom_kill_of_a_tensorflow_worker_is_out_of_memory_not_a_preemption(tmp_path):
    """`orchestrator run` in a 2 GiB memory cgroup made here (root, cgroup v1 on this machine);
    the job's callback grows past it once, the kernel kills the worker, the supervisor reads
    the cgroup's oom_kill counter and calls it out_of_memory."""
    from test_oom import _memory_cgroup

    cg = _memory_cgroup(2 << 30)
    try:
        (tmp_path / "hog_cb.py").write_text(MEMORY_HOG)
        job = _job(tmp_path, epochs=1, extra="callbacks: [{factory: hog_cb:hog}]\n")
        code = ("import os, sys\n"
                "open(os.path.join(%r, 'cgroup.procs'), 'w').write(str(os.getpid()))\n"
                "from orchestrator import cli\n"
                "sys.exit(cli.main(['run', %r, '--run-dir', %r]))\n"
                % (cg, job, str(tmp_path / "run")))
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        events = Journal(str(tmp_path / "run" / "events.jsonl")).events()
        first = _ev(events, "attempt_ended")[0]
        assert (first["signal"], first["kind"]) == ("SIGKILL", "out_of_memory")
        assert _ev(events, "recovery")[0]["kind"] == "out_of_memory"
    finally:
        os.rmdir(cg)

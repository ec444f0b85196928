"""Real TensorFlow workers through the recovery ladder: real exception classes, real hangs,
a real broken TPU context (this CPU build of TensorFlow has no TPU kernels)."""
import os
import shutil
import subprocess
import sys

import pytest

from helpers import NO_SAVED_MODEL, ROOT
from orchestrator.core.journal import Journal

pytestmark = pytest.mark.e2e

JOB = """
name: digits-recovery
model: digits_job:build_model
data: digits_job:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}
epochs: 2
batch_size: 32
strategy: STRATEGY
seed: 7
heartbeat_interval: 0.2
hang_timeout: 8
stop_grace: 2
restarts: {max: 4, backoff: {initial: 0.2, max: 1}}
standby: off
""" + NO_SAVED_MODEL
# hang_timeout: 3 s was a false hang once, with four test processes on 2 cores. No standby: the
# ladders are what these tests are about, and on 2 cores `auto` starts one after the first
# failure that would only cost a framework start.


def _job(tmp_path, strategy, recovery):
    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), tmp_path)
    p = tmp_path / "job.yaml"
    p.write_text(JOB.replace("STRATEGY", strategy) + recovery)
    return str(p)


def _run(job, run_dir, faults=(), env=None):
    args = [a for f in faults for a in ("--fault", f)]
    p = subprocess.run([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                        str(run_dir), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout + p.stderr, Journal(str(run_dir / "events.jsonl")).events()


def _ev(events, name):
    return [e for e in events if e["event"] == name]


def test_oom_halves_the_batch_then_a_hang_is_dumped_and_killed(tmp_path):
    job = _job(tmp_path, "cpu", "recovery: {halve_batch: true}\n")
    rc, out, events = _run(job, tmp_path / "run",
                           faults=["raise=out_of_memory@step=5", "hang@step=30"])
    assert rc == 0, out
    ended = _ev(events, "attempt_ended")
    assert [(e["kind"], e["signature"]) for e in ended] == [
        ("out_of_memory", "oom_allocating_tensor"), ("hang", None), (None, None)]
    assert ended[0]["error"]["type"] == "ResourceExhaustedError"  # the real tf.errors class
    assert [(e["action"], e.get("batch_size")) for e in _ev(events, "recovery")] == [
        ("halve_batch", 16), ("restart", None)]
    ready = _ev(events, "worker_ready")
    assert [e["global_batch"] for e in ready] == [32, 16, 16]
    hang = _ev(events, "hang_detected")[0]
    assert hang["attempt"] == 2 and 8 <= hang["last_heartbeat_age_s"] < 8 + 2
    log = (tmp_path / "run" / "attempts" / "2.log").read_text()
    assert "Current thread" in log and "faults.py" in log and "in on_train_batch_end" in log
    assert [e["epoch"] for e in _ev(events, "epoch_completed")] == [1, 2]


def test_a_broken_tpu_context_is_reinitialised_then_falls_back_to_cpu(tmp_path):
    # TPU_NAME=local makes the worker initialise a TPU system with a TensorFlow that has no
    # TPU kernels: the real "No OpKernel ... 'ConfigureDistributedTPU'" failure.
    job = _job(tmp_path, "auto", "recovery:\n  strategy_fallback: true\n"
                                 "  ladders: {accelerator_context: [reinit_accelerator, "
                                 "fallback_strategy]}\n")
    env = dict(os.environ, TPU_NAME="local")
    rc, out, events = _run(job, tmp_path / "run", env=env)
    assert rc == 0, out
    ended = _ev(events, "attempt_ended")
    assert [(e["kind"], e["signature"]) for e in ended] == [
        ("accelerator_context", "tpu_configure_distributed_no_kernel")] * 2 + [(None, None)]
    assert ended[0]["error"]["type"] == "NotFoundError"
    assert "TPUs not found in the cluster" in ended[0]["error"]["message"]
    rec = _ev(events, "recovery")
    assert [e["action"] for e in rec] == ["reinit_accelerator", "fallback_strategy"]
    assert rec[1]["strategy"] == "cpu" and "passed over gpu" in rec[1]["detail"]
    log2 = (tmp_path / "run" / "attempts" / "2.log").read_text()
    assert "ShutdownDistributedTPU" in log2  # attempt 2 really tried to shut the TPU down
    probes = [(e["attempt"], e["accelerator"], e["state"]) for e in _ev(events,
                                                                        "accelerator_probe")]
    assert probes[0] == (1, "tpu_vm", "unavailable") and probes[-1] == (3, "cpu", "ok")
    ready = _ev(events, "worker_ready")
    assert len(ready) == 1 and ready[0]["strategy_kind"] == "cpu"

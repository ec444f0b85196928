"""TensorBoard across a real SIGKILL, on both backends: the run's logs read back with
TensorBoard's own reader."""
import os
import re
import shutil
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import noimport
from helpers import JAX_THEN_TF_IN_SOAK, NO_SAVED_MODEL, ROOT
from orchestrator.core.journal import Journal
from orchestrator.train.tensorboard import HISTORY_FILE

pytestmark = pytest.mark.e2e

JOB = """
name: digits-tensorboard
model: digits_job:build_model
data: digits_job:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}
epochs: 3
batch_size: 32
strategy: cpu
seed: 5
deterministic: true
checkpoint: {every_epochs: 1, every_steps: 20, keep: 2}
restarts: {max: 3, backoff: {initial: 0.2, max: 1}}
tensorboard: {every_steps: 5}
standby: off
""" + NO_SAVED_MODEL
SPE = 45  # 1438 training digits in batches of 32


def _run(tmp_path, faults=(), env=None, backend="tensorflow"):
    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), tmp_path)
    (tmp_path / "job.yaml").write_text(JOB + f"backend: {backend}\n")
    run = tmp_path / "run"
    args = [a for f in faults for a in ("--fault", f)]
    p = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(tmp_path / "job.yaml"),
                        "--run-dir", str(run), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr, run, Journal(str(run / "events.jsonl")).events()


def _steps(folder):
    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}


@JAX_THEN_TF_IN_SOAK
def test_a_worker_killed_mid_epoch_leaves_every_step_once_and_in_order(tmp_path, backend):
    # Killed at step 70 (mid-epoch 2), after writing its points up to 70; resumed from the newest
    # checkpoint committed before the kill: 60, or 45 when the write of 60 was still in flight
    # in the background, or 40 or even 20 when the earlier ones were too (seen beside two busy
    # loops). Without the repair the reader gets [..., 60, 65, 70, 65, 70, ...].
    # on JAX as on a TPU VM: TensorFlow cannot be imported (the worker writes the logs without)
    env = noimport.env_without(tmp_path / "site", "tensorflow") if backend == "jax" else None
    rc, out, run, events = _run(tmp_path, faults=["kill@step=70"], env=env, backend=backend)
    assert rc == 0, out
    ready = [e for e in events if e["event"] == "worker_ready"]
    assert {e["backend"] for e in ready} == {backend}, ready
    before = events[:events.index(ready[1])]
    committed = [e["step"] for e in before if e["event"] == "checkpoint_committed"]
    resumed = ready[1]["resumed_from_step"]
    assert [e["resumed_from_step"] for e in ready] == [0, max(committed)]
    assert 0 < resumed < 70 and resumed % 5 == 0, resumed  # every 20 steps and each epoch's end
    log = (run / "attempts" / "2.log").read_text()
    dropped = re.search(rf"tensorboard: dropped (\d+) point\(s\) past step {resumed}", log)
    # batch_{loss,accuracy,learning_rate} at each multiple of 5 in (resumed, 70], and epoch 1's
    # points (3 in train, 2 in validation) when the resume is before its end
    expected = 3 * len(range(resumed + 5, 71, 5)) + (5 if resumed < SPE else 0)
    assert dropped and int(dropped.group(1)) == expected, log

    train, validation = _steps(run / "tensorboard" / "train"), _steps(
        run / "tensorboard" / "validation")
    epochs = [SPE, 2 * SPE, 3 * SPE]
    assert train == {
        **{f"batch_{m}": list(range(5, 3 * SPE + 1, 5)) for m in
           ("loss", "accuracy", "learning_rate")},
        **{f"epoch_{m}": epochs for m in ("loss", "accuracy", "learning_rate")}}
    assert validation == {"epoch_loss": epochs, "epoch_accuracy": epochs}
    assert sorted(os.listdir(run / "tensorboard" / "train"))[0] == HISTORY_FILE


def test_a_job_asking_for_tensorboard_without_it_fails_once_naming_the_key(tmp_path):
    # the worker fails before the framework's import: Keras and TensorFlow blocked too, and
    # never tried (seconds of a failure that a key decides)
    rc, out, run, events = _run(tmp_path, env=noimport.env_without(
        tmp_path / "worker-site", "tensorboard", "keras", "tensorflow"))
    assert rc == 1, out
    assert set(noimport.attempted(tmp_path / "worker-site")) == {"tensorboard"}
    assert sum(e["event"] == "attempt_started" for e in events) == 1
    assert not any(e["event"] == "first_step" for e in events)  # failed before training
    failed = events[-1]
    assert failed["event"] == "run_failed" and failed["kind"] == "user_error", failed
    assert "key 'tensorboard'" in failed["error"]["message"]
    assert "pip install 'orchestrator[tensorboard]'" in out
    # ... and the doctor says so before a run
    env = noimport.env_without(tmp_path / "site", "tensorboard")
    p = subprocess.run([sys.executable, "-m", "orchestrator", "doctor", str(tmp_path / "job.yaml")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL  job code" in p.stdout and "key 'tensorboard'" in p.stdout, p.stdout

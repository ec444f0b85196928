"""Real TensorFlow end to end: the supervisor, real workers, SIGKILLs at random moments."""
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from orchestrator.journal import Journal

pytestmark = pytest.mark.e2e

DIGITS_JOB = """
name: digits-e2e
model: digits_job:build_model
data: digits_job:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}
epochs: 8
batch_size: 32
strategy: cpu
seed: 99
checkpoint: {every_epochs: 1, keep: 2}
restarts: {max: 6, backoff: {initial: 0.2, max: 1}}
"""


@pytest.fixture
def digits_job(tmp_path):
    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), tmp_path)
    p = tmp_path / "job.yaml"
    p.write_text(DIGITS_JOB)
    return str(p)


def _start(job, run_dir, env=None):
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                             str(run_dir)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(journal, event, attempt, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in journal.iter(event):
            if e.get("attempt") == attempt:
                return e
        time.sleep(0.02)
    raise AssertionError(f"no {event} for attempt {attempt} within {timeout} s")


def _fingerprint(events):
    return next(e["weights_sha256"] for e in events if e["event"] == "run_completed")


def test_sigkills_at_random_moments_lose_and_repeat_no_epoch(digits_job, tmp_path):
    ref = _start(digits_job, tmp_path / "ref")
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out
    reference = _fingerprint(Journal(str(tmp_path / "ref" / "events.jsonl")).events())

    run = tmp_path / "run"
    journal = Journal(str(run / "events.jsonl"))
    rng = random.Random(2026)
    sup = _start(digits_job, run)
    for attempt in (1, 2):  # SIGKILL the worker somewhere in its training
        _wait_for(journal, "worker_ready", attempt)
        time.sleep(rng.uniform(0.2, 1.5))
        pid = _wait_for(journal, "attempt_started", attempt)["pid"]
        os.kill(pid, signal.SIGKILL)
    _wait_for(journal, "first_step", 3)  # then the supervisor itself dies with the VM
    time.sleep(rng.uniform(0.0, 0.5))
    sup.send_signal(signal.SIGKILL)
    sup.wait()
    again = _start(digits_job, run)  # the user runs the same command again
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert "took over the run directory" in out

    events = journal.events()
    epochs = [e["epoch"] for e in events if e["event"] == "epoch_completed"]
    assert epochs == list(range(1, 9)), epochs
    # each attempt resumed right after the newest checkpoint committed before it started
    committed = 0
    for e in events:
        if e["event"] == "checkpoint_committed":
            committed = max(committed, e["epoch"])
        if e["event"] == "worker_ready":
            assert e["resumed_from_epoch"] == committed, (e, committed)
    assert sum(e["event"] == "attempt_started" for e in events) >= 4
    # the data order and every RNG state are restored: the same model as without the kills
    assert _fingerprint(events) == reference


def test_missing_tensorflow_fails_once_with_one_clear_line(digits_job, tmp_path):
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoTF:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('tensorflow', 'keras'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _NoTF())\n")
    env = dict(os.environ, PYTHONPATH=f"{blocker}{os.pathsep}{ROOT}")
    p = _start(digits_job, tmp_path / "run", env=env)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1, out
    events = Journal(str(tmp_path / "run" / "events.jsonl")).events()
    assert sum(e["event"] == "attempt_started" for e in events) == 1
    msg = events[-1]["error"]["message"]
    assert "TensorFlow is not installed" in msg and "orchestrator[cpu]" in msg
    assert "tensorflow-tpu" in msg
    log = (tmp_path / "run" / "attempts" / "1.log").read_text()
    assert "Traceback" not in log


def test_cifar10_resnet_synthetic_smoke(tmp_path):
    shutil.copy(os.path.join(ROOT, "jobs", "cifar10_resnet", "cifar10_resnet_job.py"), tmp_path)
    text = open(os.path.join(ROOT, "jobs", "cifar10_resnet", "job.yaml")).read()
    text = (text.replace("args: {synthetic: false}", "args: {synthetic: true, "
                         "synthetic_examples: 160}")
            .replace("epochs: 200", "epochs: 2").replace("batch_size: 128", "batch_size: 32"))
    (tmp_path / "job.yaml").write_text(text)
    p = _start(str(tmp_path / "job.yaml"), tmp_path / "run")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    events = Journal(str(tmp_path / "run" / "events.jsonl")).events()
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2]
    ready = next(e for e in events if e["event"] == "worker_ready")
    assert ready["global_batch"] == 32 and ready["steps_per_epoch"] == 5

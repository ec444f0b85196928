"""Real TensorFlow end to end: the supervisor, real workers, SIGKILLs at chosen moments."""
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from helpers import BOTH_BACKENDS, NO_SAVED_MODEL, ROOT, live, once_per_session
from orchestrator.core import heartbeat
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import pid_alive
from orchestrator.core.rundir import CPU_DEVICES_ENV

pytestmark = pytest.mark.e2e

DIGITS_JOB = """
name: digits-e2e
model: digits_job:build_model
data: digits_job:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}
epochs: 5
batch_size: 32
strategy: cpu
seed: 99
deterministic: true
learning_rate: schedule_fn:decay
callbacks:
  - reduce_lr_on_plateau: {monitor: loss, factor: 0.8, patience: 0, min_delta: 0.2}
  - early_stopping: {monitor: val_loss, patience: 3, restore_best_weights: true}
checkpoint: {every_epochs: 1, every_steps: 10, keep: 2}
restarts: {max: 8, backoff: {initial: 0.2, max: 1}}
heartbeat_interval: 0.05
""" + NO_SAVED_MODEL
EVERY_STEPS = 10

# A relative rule: applying it twice to one epoch (a resumed one) would change the result.
SCHEDULE_FN = "def decay(epoch, lr):\n    return lr * 0.7 if epoch else lr\n"

def write_job_files(where):
    """The digits job's modules beside a job file written in ``where``."""
    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), where)
    (where / "schedule_fn.py").write_text(SCHEDULE_FN)


@pytest.fixture
def digits_job(tmp_path, backend):
    write_job_files(tmp_path)
    p = tmp_path / "job.yaml"
    p.write_text(DIGITS_JOB + f"backend: {backend}\n")
    return str(p)


@pytest.fixture
def digits_reference(tmp_path_factory, backend):
    """One uninterrupted run of the digits job on ``backend``, run once for the session: its
    journal's ``events``, its ``job`` file and ``run`` directory (read, never written, by the
    tests that compare a faulted run with it or read its export: a SavedModel too)."""
    def run(where):
        write_job_files(where)
        (where / "job.yaml").write_text(DIGITS_JOB.replace(NO_SAVED_MODEL, "")
                                        + f"backend: {backend}\n")
        p = _start(str(where / "job.yaml"), where / "run")
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
        return {"events": Journal(str(where / "run" / "events.jsonl")).events(),
                "job": str(where / "job.yaml"), "run": str(where / "run")}
    return once_per_session(tmp_path_factory, f"digits-reference-{backend}", run)


def _start(job, run_dir, env=None):
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                             str(run_dir)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(journal, event, attempt, timeout=120, where=lambda e: True):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in journal.iter(event):
            if e.get("attempt") == attempt and where(e):
                return e
        time.sleep(0.02)
    raise AssertionError(f"no {event} for attempt {attempt} within {timeout} s")


def _wait_heartbeat(control, attempt, until, timeout=120):
    """``control``: the run's local control folder, where the worker writes its heartbeat
    (the run directory's copy is synced every 0.5 s, too late for an epoch end that lasts
    milliseconds)."""
    deadline = time.time() + timeout
    where = str(control)
    while time.time() < deadline:
        hb = heartbeat.read(where)
        if hb and hb.get("attempt") == attempt and until(hb):
            return hb
        time.sleep(0.002)
    raise AssertionError(f"attempt {attempt}: heartbeat condition not met in {timeout} s")


def _completed(events):
    return next(e for e in events if e["event"] == "run_completed")


class _KillOnCommit(FileSystemEventHandler):
    """SIGKILLs ``pid`` as soon as the ``nth`` checkpoint commit creates its temporary dir."""

    def __init__(self, pid, nth):
        self.pid, self.nth, self.seen, self.path = pid, nth, 0, None
        self.fired = threading.Event()

    def on_created(self, event):
        if os.path.basename(event.src_path).startswith(".tmp-") and not self.fired.is_set():
            self.seen += 1
            if self.seen == self.nth:
                os.kill(self.pid, signal.SIGKILL)
                self.path = event.src_path
                self.fired.set()


@BOTH_BACKENDS
def test_killed_runs_end_bit_identical_to_an_uninterrupted_one(digits_job, digits_reference,
                                                               tmp_path):
    ref_events = digits_reference["events"]
    # Every resume here is a fresh process restoring from the tiers (the warm path, a promoted
    # standby, is test_e2e_standby's): with `auto` a standby started after each kill, 4 per run,
    # and none was ready before the next kill (all 5 attempts cold), a framework start each.
    with open(digits_job, "a") as f:
        f.write("standby: off\n")

    run = tmp_path / "run"
    ctl = live(digits_job, run)
    journal = Journal(ctl.journal)
    rng = random.Random(int(os.environ.get("EXACT_RESUME_SEED", "2026")))
    kills = []  # (attempt, where, heartbeat at the kill)
    sup = _start(digits_job, run)

    # 1. mid-epoch, at a random step that is not a checkpoint step
    target = rng.choice([s for s in range(12, 80) if s % EVERY_STEPS])
    pid = _wait_for(journal, "attempt_started", 1)["pid"]
    hb = _wait_heartbeat(ctl.control, 1, lambda h: h.get("step", 0) >= target)
    os.kill(pid, signal.SIGKILL)
    kills.append((1, "mid-epoch", hb))

    # 2. between epochs: the epoch has ended, its checkpoint is not written yet
    pid = _wait_for(journal, "attempt_started", 2)["pid"]
    ready = _wait_for(journal, "worker_ready", 2)
    hb = _wait_heartbeat(ctl.control, 2, lambda h: h.get("phase") == "epoch_end"
                         and h["epoch"] > ready["resumed_from_epoch"])
    os.kill(pid, signal.SIGKILL)
    kills.append((2, "between epochs", hb))

    # 3. during a checkpoint write (the commit's temporary directory has just appeared)
    pid = _wait_for(journal, "attempt_started", 3)["pid"]
    handler = _KillOnCommit(pid, nth=rng.randint(1, 3))
    observer = Observer()
    observer.schedule(handler, str(run / "checkpoints"), recursive=False)
    observer.start()
    try:
        assert handler.fired.wait(120), "no checkpoint commit seen"
    finally:
        observer.stop()
        observer.join(5)
    while pid_alive(pid):
        time.sleep(0.01)
    hb = dict(heartbeat.read(ctl.control))
    hb["step"] = int(os.path.basename(handler.path).split("-")[1])  # the step being committed
    kills.append((3, "during a checkpoint write" if os.path.exists(handler.path)
                  else "right after a checkpoint write", hb))

    # 4. the supervisor dies with the VM, its worker at the same moment (left to notice its
    #    parent's death, a JAX worker with a warm compile cache trained the run's last 75 steps
    #    and committed the end first); the user runs the command again
    pid = _wait_for(journal, "attempt_started", 4)["pid"]
    _wait_for(journal, "first_step", 4)
    time.sleep(rng.uniform(0.0, 0.5))
    sup.send_signal(signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)
    sup.wait()
    while pid_alive(pid):
        time.sleep(0.01)
    kills.append((4, "supervisor killed", heartbeat.read(ctl.control)))
    again = _start(digits_job, run)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert "took over the run directory" in out

    events = journal.events()
    ready = {e["attempt"]: e for e in events if e["event"] == "worker_ready"}
    # The last heartbeat (at most 50 ms old) gives the step a worker had reached when it died,
    # give or take the steps of those 50 ms (exact for the kill during a commit: the step being
    # committed): the work lost is about that step - the resumed one.
    print("\nkill points and work lost (steps redone, from the last heartbeat):")
    for attempt, where, hb in kills:
        resumed = ready[attempt + 1]["resumed_from_step"]
        print(f"  attempt {attempt}: {where} at step ~{hb['step']} (epoch {hb['epoch']}, "
              f"batch {hb['batch']}); resumed at step {resumed}: "
              f"~{max(0, hb['step'] - resumed)} redone")
        # a resume starts at the newest checkpoint committed before it (the supervisor scans
        # the tiers when an attempt ends) ...
        before = events[:events.index(ready[attempt + 1])]
        assert resumed == max((e["step"] for e in before
                               if e["event"] == "checkpoint_committed"), default=0), (
            where, hb, resumed)
        # ... at most one interval back, one more for the background write in flight at the
        # kill (it never got its marker) and one for each checkpoint that fell due while the
        # writer was busy (skipped, or waited for when the kill came)
        busy = [e for e in events if e["event"] in ("checkpoint_skipped_busy",
                                                    "checkpoint_waited")
                and e["attempt"] == attempt]
        assert hb["step"] - resumed <= EVERY_STEPS * (2 + len(busy)), (where, hb, resumed)
    assert any(r["resumed_from_batch"] > 0 for r in ready.values())  # mid-epoch resumes
    assert not [e for e in events if e["event"] == "resume_not_exact"]

    # the same model, state, per-epoch metrics and learning rates as without the kills
    assert _completed(events)["weights_sha256"] == _completed(ref_events)["weights_sha256"]
    assert _completed(events)["state_sha256"] == _completed(ref_events)["state_sha256"]
    epochs = [e for e in events if e["event"] == "epoch_completed"]
    ref_epochs = [e for e in ref_events if e["event"] == "epoch_completed"]
    assert [e["epoch"] for e in epochs] == [e["epoch"] for e in ref_epochs] == [1, 2, 3, 4, 5]
    assert [e["metrics"] for e in epochs] == [e["metrics"] for e in ref_epochs]
    rates = [e["metrics"]["learning_rate"] for e in epochs]
    assert len(set(rates)) > 2, rates  # the schedule and the plateau rule both acted
    # and every checkpoint both runs wrote holds the same state, step by step
    def states(evs):
        return {e["step"]: e["state_sha256"] for e in evs if e["event"] == "checkpoint_committed"}
    ours, theirs = states(events), states(ref_events)
    common = sorted(set(ours) & set(theirs))
    # 25 fall due in each run (every 10 steps and each epoch end, 225 steps); the background
    # writer skips one when the previous write is still busy (on a loaded machine, a few per
    # run, different ones in each run; 14 of 25 with four test processes on 2 cores): at least
    # a quarter of them are compared
    assert len(common) >= 6, common
    assert {s: ours[s] for s in common} == {s: theirs[s] for s in common}


REPLICA_JOB = """
name: replicas
model: digits_job:build_model
data: replica_data:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}
epochs: EPOCHS
batch_size: 4
strategy: cpu
seed: 3
heartbeat_interval: 0.05
checkpoint: {every_epochs: 1, every_steps: 10, keep: 2}
restarts: {max: 2, backoff: {initial: 0.2, max: 1}}
"""


# 360 digits to train on, 64 to validate with (validation_fraction 0.8 alone left 1437 to
# validate, 360 steps at a batch of 4 after each epoch on one replica: most of this test's work)
REPLICA_DATA = """
from digits_job import load_data as digits


def load_data():
    d = digits(validation_fraction=0.8)
    x, y = d["validation"]
    return {"train": d["train"], "validation": (x[:64], y[:64])}
"""


def test_checkpoint_moves_between_4_replicas_and_1(tmp_path):
    """A TPU's cores to one GPU and back. 4 replicas, not a v2-8's 8: tracing the step for 8 CPU
    devices took 26 s of the suite's CPU per start, for the same transfer of state."""
    write_job_files(tmp_path)
    (tmp_path / "replica_data.py").write_text(REPLICA_DATA)
    job = tmp_path / "job.yaml"
    run = tmp_path / "run"
    four = dict(os.environ, **{CPU_DEVICES_ENV: "4"})

    # 4 replicas (global batch 16): stopped in the middle of epoch 2
    job.write_text(REPLICA_JOB.replace("EPOCHS", "4"))
    journal = Journal(live(job, run).journal)
    sup = _start(str(job), run, env=four)
    _wait_for(journal, "worker_ready", 1)
    # early in epoch 2 (training no longer waits for checkpoint writes: a stop aimed at a
    # later moment may land at the epoch's end)
    _wait_heartbeat(live(job, run).control, 1,
                    lambda h: h.get("epoch") == 1 and h.get("batch", 0) >= 1)
    # the preemption notice goes to the worker at once, not through the supervisor's own
    # signal handling, which may take longer than the few steps of 20 ms left in the epoch
    os.kill(_wait_for(journal, "attempt_started", 1)["pid"], signal.SIGTERM)
    sup.send_signal(signal.SIGTERM)
    out, _ = sup.communicate(timeout=120)
    assert sup.returncode == 130, out
    # 1 replica (global batch 4) finishes epoch 2 from that position
    job.write_text(REPLICA_JOB.replace("EPOCHS", "2"))
    p = _start(str(job), run)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    # and 4 replicas again for a third epoch
    job.write_text(REPLICA_JOB.replace("EPOCHS", "3"))
    p = _start(str(job), run, env=four)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out

    events = journal.events()
    ready = [e for e in events if e["event"] == "worker_ready"]
    assert [(e["replicas"], e["global_batch"]) for e in ready] == [(4, 16), (1, 4), (4, 16)]
    # each restore put back exactly the state the other strategy wrote
    committed = {e["step"]: e for e in events if e["event"] == "checkpoint_committed"}
    for r in ready[1:]:
        assert r["restored_state_sha256"] == committed[r["resumed_from_step"]]["state_sha256"]
    # the mid-epoch position is carried over in examples: batch b of 16 is batch 4b of 4
    mid = committed[ready[1]["resumed_from_step"]]
    assert mid["epoch"] == ready[1]["resumed_from_epoch"] == 1 and mid["batch"] > 0
    assert ready[1]["resumed_from_batch"] == mid["batch"] * 4
    # and the journal says why these resumes are not bit-exact
    not_exact = [e for e in events if e["event"] == "resume_not_exact"]
    assert [e["attempt"] for e in not_exact] == [2, 3]
    assert all("global batch changed" in " ".join(e["reasons"]) for e in not_exact)
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2, 3]


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


def test_an_unknown_optimizer_stops_the_run_after_one_attempt_naming_its_key(digits_job,
                                                                            tmp_path):
    text = open(digits_job).read().replace("optimizer: adam,", "optimizer: adamm,")
    open(digits_job, "w").write(text)
    p = _start(digits_job, tmp_path / "run")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1, out
    assert "key 'compile.optimizer': Keras does not accept 'adamm'" in out
    assert "did you mean 'adam'" in out
    events = Journal(str(tmp_path / "run" / "events.jsonl")).events()
    assert sum(e["event"] == "attempt_started" for e in events) == 1
    failed = events[-1]
    assert failed["event"] == "run_failed" and failed["kind"] == "user_error", failed
    assert "Keras accepts adadelta" in failed["error"]["message"]
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
    # where start-up time goes (scripts/bench's recovery breakdown): phases in order
    ph = ready["phases_s"]
    assert 0 < ph["tf_imported"] <= ph["model_built"] <= ph["restored"] <= ready["startup_s"]
    assert ready["started_at"] <= next(e["ts"] for e in events if e["event"] == "first_step")




@BOTH_BACKENDS
def test_export_formats_load_on_cpu_and_predict_as_the_run_s_model(digits_reference, tmp_path):
    # the session's uninterrupted digits run, read only
    digits_job, run = digits_reference["job"], Path(digits_reference["run"])
    events = digits_reference["events"]
    exported = [e for e in events if e["event"] == "exported"]
    assert [e.get("source") for e in exported] == ["worker"]  # the last worker, in-process
    final_sha = next(e["weights_sha256"] for e in events if e["event"] == "run_completed")
    on_demand = tmp_path / "again"  # `orchestrator export RUN_DIR` does the same on demand
    rc = subprocess.call([sys.executable, "-m", "orchestrator", "export", str(run), "--out",
                          str(on_demand)], cwd=ROOT)
    assert rc == 0 and (on_demand / "export.json").is_file()

    import keras
    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, str(run.parent))
    import digits_job as job

    from orchestrator.train import state
    from orchestrator.checkpoint import tiers
    from orchestrator.core.specload import load

    # the run's model: rebuilt by the job's factory, restored from the newest valid checkpoint
    spec = load(digits_job, run_dir=str(run))
    ref = job.build_model()
    ref.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    ref.optimizer.build(ref.trainable_variables)
    state.restore(ref, state.load_arrays(tiers.for_spec(spec).latest_valid().path))
    assert state.fingerprint(ref) == final_sha
    x = job.load_data()["validation"][0][:13]
    want = ref.predict(x, verbose=0)

    exp = run / "export"
    facts = __import__("json").loads((exp / "export.json").read_text())
    assert facts["weights_sha256"] == final_sha and facts["epoch"] == 5
    keras_model = keras.saving.load_model(str(exp / "model.keras"))
    np.testing.assert_allclose(keras_model.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    weights_only = job.build_model()
    weights_only.load_weights(str(exp / "model.weights.h5"))
    np.testing.assert_allclose(weights_only.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    served = tf.saved_model.load(str(exp / "saved_model"))
    for n in (1, 13):  # the batch dimension is free
        got = served.serve(tf.constant(x[:n])).numpy()
        np.testing.assert_allclose(got, want[:n], rtol=1e-5, atol=1e-6)


def test_a_worker_killed_while_exporting_costs_no_restart_and_the_supervisor_exports(
        digits_job, tmp_path):
    text = open(digits_job).read().replace("epochs: 5", "epochs: 1")
    open(digits_job, "w").write(text)
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "orchestrator", "run", digits_job, "--run-dir",
                        str(run), "--fault", "kill@export=1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    events = Journal(str(run / "events.jsonl")).events()
    names = [e["event"] for e in events]
    assert "fault_injected" in names and names.count("attempt_started") == 1, names
    ended = next(e for e in events if e["event"] == "attempt_ended")
    assert ended["signal"] == "SIGKILL" and ended["kind"] is None  # not a failure: done
    assert "restart" not in names and "recovery" not in names
    exported = [e for e in events if e["event"] == "exported"]
    assert len(exported) == 1 and "source" not in exported[0]  # the supervisor's exporter
    final_sha = next(e["weights_sha256"] for e in events if e["event"] == "run_completed")
    facts = __import__("json").loads((run / "export" / "export.json").read_text())
    assert facts["weights_sha256"] == final_sha and facts["epoch"] == 1

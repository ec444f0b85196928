"""Issue 36's measurement as a test: ``orchestrator colab`` carries a digits run of about a
minute through a runtime recycled mid-run, with Drive's write-back cache simulated (a runtime
sees its own cache of Drive; the cloud gets a file once left alone for ``QUIET_S``, at
``BYTES_PER_S``; deletions at once; a recycle loses the cache: tests/fakes/drive_writeback.py).

What "durable" must mean there: the second runtime resumes from the newest complete checkpoint
the cloud held when the first was recycled (read from the simulated cloud at that moment), one
at most (quiet period + upload + one checkpoint interval) old, never from scratch while the
cloud held one; the run ends with the weights of its uninterrupted run; and the cloud itself,
not a cache that went with its runtime, holds the final checkpoint and a journal ending with
the run's completion.

Each runtime's own view of the journal is read from its cache while it lives (``Taps``): what
the first runtime had made durable before the recycle, and where the second one resumed.
"""
import json
import subprocess
import sys
import threading
import time

import pytest

from colabsim import SIM, cache, cloud, env, namespaces_work, sim, writeback
from helpers import ROOT, wait_while_running
from test_e2e import DIGITS_JOB, _completed, write_job_files
from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.core import hosts
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal

pytestmark = pytest.mark.e2e

RUN_DIR = "/content/drive/MyDrive/runs/digits"
RUN_IN_DRIVE = ("MyDrive", "runs", "digits")
EPOCHS = 40
# about a minute of training here: no early stopping (the length is the job's), a checkpoint
# every 2 epochs (the interval the bound allows for); a lost runtime's lock is stale after 3 s
# (Colab: 120 s); no standby (a second TensorFlow in a runtime, for nothing here)
_EARLY_STOPPING = "  - early_stopping: {monitor: val_loss, patience: 3, restore_best_weights: true}\n"
_CHECKPOINTS = "checkpoint: {every_epochs: 1, every_steps: 10, keep: 2}\n"
assert _EARLY_STOPPING in DIGITS_JOB and _CHECKPOINTS in DIGITS_JOB and "epochs: 5\n" in DIGITS_JOB
# Each step lasts at least 20 ms (a callback of the job's, with no state: the weights are the
# same): on a fast machine the 40 epochs ended before the recycle (seen: 35 s with the suite's
# load, 20 s of it before the recycle); a slow one is not slowed further.
PACE = '''
import time

import keras


class Pace(keras.callbacks.Callback):
    def __init__(self, min_step_s):
        super().__init__()
        self.min_step_s, self.t = min_step_s, 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self.t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(max(0.0, self.min_step_s - (time.perf_counter() - self.t)))

    def get_state(self):
        return {}

    def set_state(self, state):
        return None


def pace(min_step_s):
    return Pace(min_step_s)
'''
WRITEBACK_JOB = (DIGITS_JOB.replace(_EARLY_STOPPING,
                                    "  - {factory: 'pace:pace', args: {min_step_s: 0.02}}\n")
                 .replace(_CHECKPOINTS, "checkpoint: {every_epochs: 2, keep: 2}\n")
                 .replace("epochs: 5\n", f"epochs: {EPOCHS}\n")
                 + "lock_stale_after: 3\nstandby: off\n")
QUIET_S, BYTES_PER_S = 5.0, 20e6   # the issue measured 12 s and 20 MB/s
RECYCLE_AFTER_S = 20.0             # after the first step (the issue: 45 s of a one-minute job)
SYNC_SLACK_S = 5.0                 # the simulated sync's ticks and scans beside the suite's
                                   # other processes (one is 0.1 s apart when idle)


class Taps(threading.Thread):
    """The run's journal as each runtime's cache of Drive shows it, read every 0.3 s while
    that runtime lives; a recycled or stopped runtime keeps its last reading."""

    def __init__(self, home):
        super().__init__(daemon=True)
        self.home, self.stop, self.events = home, threading.Event(), {}

    def read(self, runtime: str) -> list:
        path = cache(self.home, runtime).joinpath(*RUN_IN_DRIVE, "events.jsonl")
        try:
            events = Journal(str(path)).events() if path.exists() else []
        except OSError:
            events = []
        if events:
            self.events[runtime] = events
        return self.events.get(runtime, [])

    def run(self):
        while not self.stop.is_set():
            for d in list((self.home / "caches").glob("*")):
                self.read(d.name)
            self.stop.wait(0.3)


def _bytes_under(folder) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.mark.skipif(not namespaces_work(), reason="the simulator's runtimes need `unshare` "
                                                  "(root)")
def test_a_recycled_runtime_resumes_from_what_the_cloud_holds_with_drives_write_back(
        tmp_path, backend):
    home, local, job_dir, ref_dir = (tmp_path / n for n in ("sim", "local", "job", "ref"))
    for d in (home, job_dir, ref_dir):
        d.mkdir()
    for d in (job_dir, ref_dir):
        write_job_files(d)
        (d / "pace.py").write_text(PACE)
        (d / "job.yaml").write_text(WRITEBACK_JOB + f"backend: {backend}\n")
    writeback(home, quiet_s=QUIET_S, bytes_per_s=BYTES_PER_S)
    # the uninterrupted run, beside it
    reference = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "run", str(ref_dir / "job.yaml"), "--run-dir",
         str(ref_dir / "run")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    driver = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "colab", str(job_dir / "job.yaml"), "--run-dir",
         RUN_DIR, "--local-dir", str(local), "--poll", "2", "--lock-retry", "1", "--backoff",
         "0.5", "--unreachable", "30"], cwd=str(tmp_path),
        env=env(home, ORCHESTRATOR_COLAB_CLI=SIM, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    taps = Taps(home)
    taps.start()
    first, second = "orc-digits-e2e-1", "orc-digits-e2e-2"
    try:
        first_step = wait_while_running(driver, lambda: next(
            (e for e in taps.read(first) if e["event"] == Event.FIRST_STEP), None),
            "the first runtime's first step", cap=300)
        while time.time() < first_step["ts"] + RECYCLE_AFTER_S and driver.poll() is None:
            time.sleep(0.2)
        before = taps.read(first)
        assert not [e for e in before if e["event"] == Event.RUN_COMPLETED], \
            "the run ended before the recycle: give it more epochs"
        upload_s = _bytes_under(cache(home, first).joinpath(*RUN_IN_DRIVE)) / BYTES_PER_S
        assert sim(home, "_recycle", first).returncode == 0
        # what the cloud holds now is all a new runtime can find (the first one's sync is gone
        # with it; the second has not mounted yet)
        at_recycle = CheckpointStore(str(cloud(home).joinpath(*RUN_IN_DRIVE, "checkpoints"))
                                     ).latest_valid()
        recycled_at = time.time()
        out, _ = driver.communicate(timeout=600)
        ref_out, _ = reference.communicate(timeout=600)
    finally:
        taps.stop.set()
        taps.join()
        for p in (driver, reference):
            if p.poll() is None:
                p.kill()  # we started it
                p.wait()
        backend_state = home / "backend.json"
        for runtime in json.loads(backend_state.read_text()) if backend_state.exists() else ():
            sim(home, "_recycle", runtime)  # a runtime left by a failure, its sync with it
    assert driver.returncode == 0, out
    assert reference.returncode == 0, ref_out
    outer = Journal(str(local / hosts.FILE)).events()
    runtimes = hosts.hosts(outer)
    flushed = [e for e in outer if e["event"] == Event.DRIVE_FLUSHED]
    assert flushed and flushed[-1]["ok"], "Drive was not flushed before the runtime was stopped"
    assert [(h.session, h.why) for h in runtimes] == [(first, "lost"), (second, "completed")]

    # 1. the second runtime resumed from the newest checkpoint the cloud held at the recycle
    assert at_recycle is not None, \
        (f"the cloud held no complete checkpoint {recycled_at - before[0]['ts']:.1f} s into the "
         f"run (quiet {QUIET_S} s, upload {upload_s:.2f} s): recycle later")
    durable = [e for e in before if e["event"] == Event.CHECKPOINT_DURABLE]
    assert durable and max(e["step"] for e in durable) >= at_recycle.step
    # ... and that one is at most (quiet period + upload + one checkpoint interval) old, as
    # the issue bounds it (give or take the sync's slack): nothing of ours kept the sync from
    # uploading it (seen beside the suite's processes: one interval behind, never more)
    written = {e["step"]: e["ts"] for e in durable}
    gaps = sorted(b - a for a, b in zip(sorted(written.values()), sorted(written.values())[1:]))
    interval_s = gaps[len(gaps) // 2] if gaps else 0.0
    age_s = recycled_at - written[at_recycle.step]
    bound_s = QUIET_S + upload_s + interval_s + SYNC_SLACK_S
    print(f"\nthe cloud's newest checkpoint at the recycle: step {at_recycle.step}, written "
          f"{age_s:.1f} s before it (bound {bound_s:.1f} s; newest written: "
          f"{max(written)}, {recycled_at - written[max(written)]:.1f} s before)")
    assert age_s <= bound_s, \
        (f"the cloud held step {at_recycle.step} at the recycle, written {age_s:.1f} s before "
         f"it: over quiet {QUIET_S} + upload {upload_s:.2f} + interval {interval_s:.1f} + slack "
         f"{SYNC_SLACK_S} s; durable: {sorted(written)}")
    mine = taps.events[second]
    start = max(i for i, e in enumerate(mine) if e["event"] in (Event.RUN_STARTED,
                                                                 Event.RUN_RESUMED))
    assert mine[start]["host"] == second
    assert mine[start]["event"] == Event.RUN_RESUMED, \
        "the second runtime found no journal in the cloud: the run's history was lost"
    ready = next(e for e in mine[start:] if e["event"] == Event.WORKER_READY)
    settled = [e for e in mine[start:] if e["event"] == Event.CHECKPOINT_SETTLED]
    assert settled and settled[0]["how"] == "mount", "the new mount settled what the cloud held"
    for lost in (e for e in mine[start:] if e["event"] == Event.DURABLE_LOST):
        assert lost["steps"][0] == ready["resumed_from_step"] + 1, lost
    assert ready["resumed_from_step"] >= at_recycle.step > 0, \
        (f"resumed from step {ready['resumed_from_step']}, although the cloud held the "
         f"checkpoint of step {at_recycle.step} when the first runtime was recycled; skipped: "
         f"{[e for e in mine[start:] if e['event'] == Event.CHECKPOINT_SKIPPED]}")

    # 2. the weights of the uninterrupted run; 3. in the cloud: the journal that ends with the
    # run's completion, and the final checkpoint
    ref = Journal(str(ref_dir / "run" / "events.jsonl")).events()
    in_cloud = cloud(home).joinpath(*RUN_IN_DRIVE)
    events = Journal(str(in_cloud / "events.jsonl")).events()
    completed = [e for e in events if e["event"] == Event.RUN_COMPLETED]
    assert completed, "the cloud's journal does not hold the run's completion"
    assert completed[-1]["weights_sha256"] == _completed(ref)["weights_sha256"]
    assert completed[-1]["state_sha256"] == _completed(ref)["state_sha256"]
    assert not [e for e in events[events.index(completed[-1]):]
                if e["event"] in (Event.RUN_STARTED, Event.RUN_RESUMED, Event.ATTEMPT_STARTED)]
    final = CheckpointStore(str(in_cloud / "checkpoints")).latest_valid()
    assert final is not None and final.ends_run(EPOCHS), "the cloud holds no final checkpoint"
    assert final.manifest.get("state_sha256") == completed[-1]["state_sha256"]

"""Real TensorFlow, two CPU workers under MultiWorkerMirroredStrategy on loopback.

Placed by the local engine (two processes here) and by Ray (a local Ray started by the test,
one placement-group bundle per worker). Rank 1 is SIGKILLed in the middle of an epoch: the group
is stopped, restarted from the newest checkpoint, and ends with the weights of an uninterrupted
2-worker run. A hang of one rank stalls the group; rank 0's silent heartbeat stops it.
Where Ray is not installed the Ray test is skipped with the reason.

On JAX (``backend: jax``) the same group is one ``jax.distributed`` program under
``keras.distribution.DataParallel``: its uninterrupted run ends with the weights of one process
with two CPU devices, and the killed run with those of the uninterrupted one.
"""
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, live, wait_until
from orchestrator.core import heartbeat
from orchestrator.core.journal import Journal
from orchestrator.ops.status import format_status, run_status

pytestmark = pytest.mark.e2e

JOB = """
name: digits-2w
model: digits_job:build_model
data: digits_job:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}
epochs: 2
batch_size: 16
seed: 3
deterministic: true
workers: 2
checkpoint: {every_epochs: 1, every_steps: 20}
heartbeat_interval: 0.05
restarts: {backoff: {initial: 0.1}}
"""


def _job(tmp_path, extra=""):
    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), tmp_path)
    p = tmp_path / "job.yaml"
    p.write_text(JOB + extra)
    return str(p)


def _run(job, run_dir, *args, env=None):
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                             str(run_dir), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


_wait = wait_until  # (conftest)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-worker run's final weights."""
    tmp = tmp_path_factory.mktemp("ref")
    p = _run(_job(tmp), tmp / "run")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    done = Journal(str(tmp / "run" / "events.jsonl")).events("run_completed")[0]
    ready = Journal(str(tmp / "run" / "events.jsonl")).events("worker_ready")[0]
    assert ready["replicas"] == 2 and ready["global_batch"] == 32  # 16 per replica x 2
    return done["weights_sha256"]


@pytest.fixture(scope="module")
def reference_jax(tmp_path_factory):
    """The uninterrupted 2-worker run on JAX, which ends as one process with 2 CPU devices."""
    sha = {}
    for workers in (2, 1):
        tmp = tmp_path_factory.mktemp(f"ref-jax-{workers}")
        job = _job(tmp, "backend: jax\nstandby: off\n")
        env = dict(os.environ, ORCHESTRATOR_CPU_DEVICES=str(3 - workers))  # 2 devices in all
        p = _run(job, tmp / "run", "--workers", str(workers), env=env)
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
        journal = Journal(str(tmp / "run" / "events.jsonl"))
        ready = journal.events("worker_ready")[0]
        assert ready["backend"] == "jax" and ready["replicas"] == 2, ready
        assert ready["global_batch"] == 32 and ready["steps_per_epoch"] == 1438 // 32
        sha[workers] = journal.events("run_completed")[0]["weights_sha256"]
    assert sha[2] == sha[1]  # 2 processes x 1 device train as 1 process x 2 devices
    return sha[2]


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    pytest.importorskip("ray", reason="the ray engine needs Ray: pip install 'orchestrator[ray]'")
    tmp = tmp_path_factory.mktemp("ray")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    subprocess.run(ray + ["start", "--head", "--num-cpus=4", "--include-dashboard=false",
                          f"--temp-dir={tmp}", "--port=0"], check=True, env=env,
                   capture_output=True, timeout=180)
    try:
        with open(os.path.join(tmp, "ray_current_cluster")) as f:
            address = f.read().strip()
        yield address
    finally:
        subprocess.run(ray + ["stop", "--force"], env=env, capture_output=True, timeout=120)


def _kill_rank_1_mid_epoch(job, run, engine, reference, env=None, args=()):
    ctl = live(job, run)
    journal = Journal(ctl.journal)
    p = _run(job, run, "--engine", engine, *args, env=env)
    started = _wait(lambda: next(journal.iter("attempt_started"), None), what="attempt 1")
    assert [w["rank"] for w in started["workers"]] == [0, 1] and started["engine"] == engine
    spe = _wait(lambda: next(journal.iter("worker_ready"), None))["steps_per_epoch"]
    target = spe + spe // 2 + 3  # the middle of epoch 2, past a mid-epoch checkpoint
    _wait(lambda: (heartbeat.read(ctl.control) or {}).get("step", 0) >= target, what="step")
    os.kill(started["workers"][1]["pid"], signal.SIGKILL)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    events = Journal(str(run / "events.jsonl")).events()
    failed = [e for e in events if e["event"] == "group_member_failed"]
    assert failed[0]["rank"] == 1 and failed[0]["stopping"] == [0]
    ended = [e for e in events if e["event"] == "attempt_ended"]
    assert ended[0]["kind"] == "killed"
    starts = [e for e in events if e["event"] == "attempt_started"]
    assert len(starts) >= 2 and len(starts[1]["workers"]) == 2
    ready = [e for e in events if e["event"] == "worker_ready"]
    assert ready[1]["resumed_from_step"] > spe  # from the mid-epoch checkpoint
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2]
    done = next(e for e in events if e["event"] == "run_completed")
    assert done["weights_sha256"] == reference
    s = run_status(str(run))  # status and the report show the group
    assert [w["rank"] for w in s["workers"]] == [0, 1]
    assert "workers: rank 0 pid" in format_status(s)
    return events


def test_local_engine_rank_1_killed_mid_epoch_then_a_hung_rank_ends_bit_identical(
        tmp_path, reference):
    """Attempt 1: rank 1 SIGKILLed mid-epoch 2. Attempt 2: a rank hangs at step 80 (the
    injected fault fires in whichever rank claims it first); the other blocks in a collective,
    rank 0's heartbeat stops, the group is dumped and killed. Attempt 3 completes."""
    events = _kill_rank_1_mid_epoch(_job(tmp_path, "hang_timeout: 4\n"), tmp_path / "run",
                                    "local", reference, args=("--fault", "hang@step=80"))
    hang = next(e for e in events if e["event"] == "hang_detected")
    assert hang["attempt"] == 2 and len(hang["workers"]) == 2
    assert [e["kind"] for e in events if e["event"] == "attempt_ended"] == \
        ["killed", "hang", None]


def test_ray_engine_rank_1_killed_mid_epoch_ends_bit_identical(tmp_path, reference,
                                                               ray_address):
    env = dict(os.environ, RAY_ADDRESS=ray_address)
    events = _kill_rank_1_mid_epoch(_job(tmp_path), tmp_path / "run", "ray", reference, env)
    workers = next(e for e in events if e["event"] == "attempt_started")["workers"]
    assert all(w["pid"] and w["host"] for w in workers)


def test_jax_local_engine_rank_1_killed_then_a_rank_s_error_ends_bit_identical(tmp_path,
                                                                              reference_jax):
    """JAX, local engine. Attempt 1: rank 1 SIGKILLed mid-epoch 2. Attempt 2: a rank raises a
    storage error at step 80: it leaves at once (not after JAX's 300 s shutdown barrier, which
    the hang clock would call a hang), the group is stopped. Attempt 3 completes. Every attempt
    joins a new coordination service."""
    job = _job(tmp_path, "backend: jax\nhang_timeout: 20\n")
    events = _kill_rank_1_mid_epoch(job, tmp_path / "run", "local", reference_jax,
                                    args=("--fault", "raise=storage@step=80"))
    assert [e["kind"] for e in events if e["event"] == "attempt_ended"] == \
        ["killed", "storage", None]
    ready = [e for e in events if e["event"] == "worker_ready"]
    coordinators = [e["distributed"]["coordinator"] for e in ready]
    assert len(ready) == 3 and len(set(coordinators)) == 3, coordinators
    assert all(c.startswith("127.0.0.1:") for c in coordinators)

"""Real TensorFlow, two CPU workers under MultiWorkerMirroredStrategy on loopback.

Placed by the local engine (two processes here) and by Ray (a local Ray started by the test,
one placement-group bundle per worker). Rank 1 SIGKILLed in the middle of an epoch (Ray), or a
hang of one rank (local: it stalls the group; rank 0's silent heartbeat stops it): the group is
stopped, restarted from the newest checkpoint, and ends with the weights of an uninterrupted
2-worker run.
Where Ray is not installed the Ray test is skipped with the reason.

On JAX (``backend: jax``) the same group is one ``jax.distributed`` program under
``keras.distribution.DataParallel``: the 2-process run, one of whose ranks fails, ends with the
weights of one uninterrupted process with two CPU devices.
"""
import contextlib
import os
import shutil
import signal
import subprocess
import sys

import pytest

from helpers import ROOT, live, once_per_session, wait_while_running
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


def _wait(p, cond, what):
    """Until the run reaches a moment, for as long as its supervisor runs (helpers)."""
    return wait_while_running(p, cond, what=what)


@pytest.fixture
def reference(tmp_path_factory):
    """The uninterrupted 2-worker run's final weights (run once for the session)."""
    def run(tmp):
        p = _run(_job(tmp), tmp / "run")
        out, _ = p.communicate(timeout=900)  # a cap only: the supervisor bounds its own waits
        assert p.returncode == 0, out
        done = Journal(str(tmp / "run" / "events.jsonl")).events("run_completed")[0]
        ready = Journal(str(tmp / "run" / "events.jsonl")).events("worker_ready")[0]
        assert ready["replicas"] == 2 and ready["global_batch"] == 32  # 16 per replica x 2
        return done["weights_sha256"]
    return once_per_session(tmp_path_factory, "two-worker-reference", run)


# The suite's Ray: its own authentication mode and token, whatever an earlier run left in
# ~/.ray; on loopback only (the head's address, and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 so that
# Ray keeps 127.0.0.1 for a driver instead of mapping it to the machine's interface address).
RAY_TOKEN = "orchestrator-suite-" + os.urandom(8).hex()
LOOPBACK_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture(scope="module")
def reference_jax(tmp_path_factory):
    """The uninterrupted run on JAX as one process with 2 CPU devices: the 2-worker group
    (2 processes x 1 device), killed and restarted, must end exactly there."""
    tmp = tmp_path_factory.mktemp("ref-jax-1x2")
    job = _job(tmp, "backend: jax\nstandby: off\n")
    env = dict(os.environ, ORCHESTRATOR_CPU_DEVICES="2")
    p = _run(job, tmp / "run", "--workers", "1", env=env)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    journal = Journal(str(tmp / "run" / "events.jsonl"))
    ready = journal.events("worker_ready")[0]
    assert ready["backend"] == "jax" and ready["replicas"] == 2, ready
    assert ready["global_batch"] == 32 and ready["steps_per_epoch"] == 1438 // 32
    return journal.events("run_completed")[0]["weights_sha256"]


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """A one-node Ray head on 127.0.0.1 with token authentication, this suite's own: started
    with ``--block`` in a session of its own and stopped by its pid (SIGTERM: it drains and
    stops its processes), never by ``ray stop``, which stops every Ray of the machine."""
    pytest.importorskip("ray", reason="the ray engine needs Ray: pip install 'orchestrator[ray]'")
    tmp = tmp_path_factory.mktemp("ray")
    env = dict(os.environ, **LOOPBACK_ENV, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=RAY_TOKEN)
    with open(tmp / "head.log", "wb") as log:
        head = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
             "--num-cpus=4", "--include-dashboard=false", f"--temp-dir={tmp}", "--port=0",
             "--node-ip-address=127.0.0.1"], env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        current = tmp / "ray_current_cluster"
        wait_while_running(head, lambda: current.exists() and current.read_text().strip(),
                           what=f"the Ray head up (its log: {tmp / 'head.log'})")
        address = current.read_text().strip()
        assert address.startswith("127.0.0.1:"), address
        yield address
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # what did not stop with it
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()


def _ray_env(address, **more):
    """The supervisor's: the cluster's address and its token, not its mode (the supervisor
    finds the cluster's mode itself, supervise/rayconnect.py)."""
    env = dict(os.environ, **LOOPBACK_ENV, RAY_ADDRESS=address, RAY_AUTH_TOKEN=RAY_TOKEN, **more)
    env.pop("RAY_AUTH_MODE", None)
    return env


def _kill_rank_1_mid_epoch(job, run, engine, reference, env=None, args=()):
    ctl = live(job, run)
    journal = Journal(ctl.journal)
    p = _run(job, run, "--engine", engine, *args, env=env)
    started = _wait(p, lambda: next(journal.iter("attempt_started"), None), what="attempt 1")
    assert [w["rank"] for w in started["workers"]] == [0, 1] and started["engine"] == engine
    spe = _wait(p, lambda: next(journal.iter("worker_ready"), None),
                what="rank 0 ready")["steps_per_epoch"]
    target = spe + spe // 2 + 3  # the middle of epoch 2, past a mid-epoch checkpoint
    _wait(p, lambda: (heartbeat.read(ctl.control) or {}).get("step", 0) >= target, what="step")
    os.kill(started["workers"][1]["pid"], signal.SIGKILL)
    out, _ = p.communicate(timeout=900)  # a cap only: the supervisor bounds its own waits
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


def _fault_in_epoch_2(job, run, fault, kind, reference):
    """The group run with ``fault`` (at step 70, in the middle of epoch 2, past the mid-epoch
    checkpoint of step 60, in whichever rank claims it first): attempt 1 ends as ``kind``, the
    group is stopped, attempt 2 resumes mid-epoch and ends with the ``reference`` weights.
    One fault per test: a group attempt costs a framework start per rank, on a suite bound by
    its 2 cores (the SIGKILLed rank is the Ray test's: what follows a dead rank is the
    engine's, the same for both)."""
    p = _run(job, run, "--engine", "local", "--fault", fault)
    out, _ = p.communicate(timeout=900)  # a cap only: the supervisor bounds its own waits
    assert p.returncode == 0, out
    events = Journal(str(run / "events.jsonl")).events()
    assert [e["kind"] for e in events if e["event"] == "attempt_ended"] == [kind, None]
    starts = [e for e in events if e["event"] == "attempt_started"]
    assert [[w["rank"] for w in e["workers"]] for e in starts] == [[0, 1], [0, 1]]
    ready = [e for e in events if e["event"] == "worker_ready"]
    assert len(ready) == 2 and ready[1]["resumed_from_step"] > ready[0]["steps_per_epoch"]
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2]
    assert next(e for e in events if e["event"] == "run_completed")["weights_sha256"] == \
        reference
    return events


def test_local_engine_a_hung_rank_stops_the_group_and_it_ends_bit_identical(tmp_path,
                                                                            reference):
    """A rank hangs; the other blocks in a collective, rank 0's heartbeat stops, the group is
    dumped and killed, and the next attempt completes. (hang_timeout 20 s: the first step took
    12 s with the suite's four processes on 2 cores, when it counted as training.)"""
    events = _fault_in_epoch_2(_job(tmp_path, "hang_timeout: 20\n"), tmp_path / "run",
                               "hang@step=70", "hang", reference)
    hang = next(e for e in events if e["event"] == "hang_detected")
    assert hang["attempt"] == 1 and len(hang["workers"]) == 2


def test_ray_engine_rank_1_killed_mid_epoch_ends_bit_identical(tmp_path, reference,
                                                               ray_address):
    """Through a Ray cluster with token authentication, on loopback: the supervisor connects
    in the cluster's mode, journals the connection and the wait for placement, and every
    rank's address is on 127.0.0.1."""
    events = _kill_rank_1_mid_epoch(_job(tmp_path), tmp_path / "run", "ray", reference,
                                    _ray_env(ray_address))
    workers = next(e for e in events if e["event"] == "attempt_started")["workers"]
    assert all(w["pid"] and w["host"] and w["identity"] for w in workers)
    connected = [e for e in events if e["event"] == "engine_connected"]
    assert [(e["address"], e["auth"]) for e in connected] == [(ray_address, "token")]
    placing = [e for e in events if e["event"] == "group_placing"]
    placed = [e for e in events if e["event"] == "group_placed"]
    assert len(placing) == len(placed) >= 2 and placing[0]["timeout_s"] > 0
    assert all(e["placed"] for e in placed)
    assert all(a.startswith("127.0.0.1:") for e in placed for a in e["addresses"]), placed


def test_ray_without_the_clusters_token_is_one_line_and_an_exit(tmp_path, ray_address):
    """No token here for a cluster that requires one (nothing in the environment, an empty
    home): refused at once with one line and exit 2, journaled; no endless retry."""
    home = tmp_path / "home"
    home.mkdir()
    env = _ray_env(ray_address, HOME=str(home))
    del env["RAY_AUTH_TOKEN"]
    job, run = _job(tmp_path), tmp_path / "run"
    p = _run(job, run, "--engine", "ray", env=env)
    out, _ = p.communicate(timeout=120)  # the bound is the connection's, 60 s by default
    assert p.returncode == 2, out
    lines = [ln for ln in out.splitlines() if "token" in ln]
    assert len(lines) == 1 and "requires token authentication and no token was found" \
        in lines[0], out
    gone = Journal(str(live(job, run).journal)).events("engine_unavailable")
    assert len(gone) == 1 and "no token was found" in gone[0]["reason"]


def test_jax_local_engine_a_rank_s_error_stops_the_group_and_it_ends_bit_identical(
        tmp_path, reference_jax):
    """JAX, 2 processes x 1 device. A rank raises a storage error: it leaves at once (not
    after JAX's 300 s shutdown barrier, which the hang clock would call a hang) and the group is
    stopped. Attempt 2 joins a new coordination service and ends as 1 process x 2 devices
    would have, uninterrupted."""
    events = _fault_in_epoch_2(_job(tmp_path, "backend: jax\nhang_timeout: 20\n"),
                               tmp_path / "run", "raise=storage@step=70", "storage",
                               reference_jax)
    failed = [e for e in events if e["event"] == "group_member_failed"]
    assert len(failed) == 1 and failed[0]["attempt"] == 1, failed
    coordinators = [e["distributed"]["coordinator"] for e in events
                    if e["event"] == "worker_ready"]
    assert len(set(coordinators)) == 2, coordinators
    assert all(c.startswith("127.0.0.1:") for c in coordinators)

"""Failure kinds injected end to end through the supervisor with fake workers (no TF): the
classification, the action taken, the journal, and that the run completes or stops. A policy
that needs no real process (out of memory, a user error, an unknown exit) is proven in
process, in tests/test_supervisor_loop.py."""
import io
import json
import os
import stat

import pytest

from helpers import fake_commands, fake_env
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import pid_alive
from orchestrator.core.specload import load
from orchestrator.supervise.supervisor import Supervisor

# integration: the real supervisor with the fake worker: real processes, real waiting
pytestmark = pytest.mark.integration


FAST = "{max: 6, backoff: {initial: 0.01, max: 0.05}}"


def _run(job, plan=None, faults=(), env=None):
    out = io.StringIO()
    env = dict(fake_env(plan or {}), **(env or {}))
    sup = Supervisor(load(job), commands=fake_commands(), out=out, env=env, faults=faults)
    rc = sup.run()
    return rc, out.getvalue(), Journal(sup.rd.journal).events()


def _gone(pid: int) -> bool:
    """Dead, or a zombie waiting for init to reap it (what SIGKILL leaves of an orphan)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return not pid_alive(pid)


def _ev(events, name):
    return [e for e in events if e["event"] == name]


def _kinds(events):
    return [(e["kind"], e["signature"]) for e in _ev(events, "attempt_ended") if e["kind"]]


def _actions(events):
    return [e["action"] for e in _ev(events, "recovery")]


def _epochs(events):
    return [e["epoch"] for e in _ev(events, "epoch_completed")]


def _overrides(tmp_path, attempt):
    return json.loads((tmp_path / "run" / f"fake-{attempt}.env.json").read_text())


def test_killed_is_restarted_and_the_fault_fires_once_per_run(fake_job):
    rc, out, events = _run(fake_job(epochs=3, restarts=FAST), faults=["kill@step=15"])
    assert rc == 0, out
    assert _kinds(events) == [("killed", None)] and _actions(events) == ["restart"]
    assert [(e["fault"], e["attempt"]) for e in _ev(events, "fault_injected")] == \
        [("kill@step=15", 1)]
    assert _epochs(events) == [1, 2, 3]
    # a crash is noticed at once: the kill and its attempt_ended are milliseconds apart
    kill, ended = _ev(events, "fault_injected")[0], _ev(events, "attempt_ended")[0]
    assert ended["ts"] - kill["ts"] < 1.0


def test_hang_is_detected_dumped_and_its_whole_group_killed(fake_job, tmp_path):
    job = fake_job(epochs=3, restarts=FAST, extra="""
            hang_timeout: 1.5
            heartbeat_interval: 0.1
            stop_grace: 0.5
    """)
    rc, out, events = _run(job, {"child": ["1"], "ignore_sigterm": ["1"], "epoch_s": 0.3,
                            "batches": 10},
                           faults=["hang@step=12"])
    assert rc == 0, out
    hang = _ev(events, "hang_detected")
    assert len(hang) == 1 and hang[0]["attempt"] == 1
    assert 1.5 <= hang[0]["last_heartbeat_age_s"] < 1.5 + 2.0  # within hang_timeout + 2 s
    assert _kinds(events) == [("hang", None)] and _actions(events) == ["restart"]
    ended = _ev(events, "attempt_ended")[0]
    assert ended["signal"] == "SIGKILL"  # it ignored SIGTERM: killed after the grace
    log = (tmp_path / "run" / "attempts" / "1.log").read_text()
    assert "Current thread" in log and "in _fire" in log and "in train" in log
    child = int((tmp_path / "run" / "fake-1.child").read_text())
    assert _gone(child), "the worker's data-loader child survived"
    assert _epochs(events) == [1, 2, 3]


def test_a_worker_that_never_beats_is_a_hang_after_the_startup_timeout(fake_job):
    job = fake_job(epochs=2, restarts=FAST, extra="startup_timeout: 3\n            stop_grace: 0.2")
    rc, out, events = _run(job, {"sleep_forever": ["1"]})
    assert rc == 0, out
    assert _ev(events, "hang_detected")[0]["timeout_s"] == 3.0
    assert _kinds(events) == [("hang", None)]


def test_accelerator_context_restarts_then_reinitialises(fake_job, tmp_path):
    tpu = {"type": "NotFoundError", "message": "TPUs not found in the cluster. Failed in "
           "initialization: No OpKernel was registered to support Op 'ConfigureDistributedTPU'"}
    rc, out, events = _run(fake_job(epochs=2, restarts=FAST), {"error": {"1": tpu, "2": tpu}})
    assert rc == 0, out
    assert _kinds(events) == [("accelerator_context", "tpu_configure_distributed_no_kernel")] * 2
    assert _actions(events) == ["restart", "reinit_accelerator"]
    assert "ORCHESTRATOR_REINIT_ACCELERATOR" not in _overrides(tmp_path, 2)
    assert _overrides(tmp_path, 3)["ORCHESTRATOR_REINIT_ACCELERATOR"] == "1"


def test_accelerator_context_on_jax_clears_a_stale_libtpu_lock_instead(fake_job, tmp_path,
                                                                       monkeypatch):
    """On JAX the reinit rung is the supervisor's: a lock file no process holds is removed (a
    temp file here, standing in for /tmp/libtpu_lockfile), the journal says so, and the next
    worker gets no TensorFlow TPU-system shutdown. libtpu's words, as JAX raises them with the
    TPU platform named (openxla tpu_initialize_util.cc; jax xla_bridge.backends)."""
    from orchestrator.core import tpuvm

    lock = tmp_path / "libtpu_lockfile"
    lock.write_text("")
    monkeypatch.setattr(tpuvm, "lock_files", lambda: [str(lock)])
    monkeypatch.setattr(tpuvm, "DEVICE_GLOBS", (str(tmp_path / "no-chip*"),))
    stale = {"type": "RuntimeError", "message": (
        "Unable to initialize backend 'tpu': ABORTED: Internal error when accessing libtpu "
        "multi-process lockfile. The potential lock file locations are '/tmp/libtpu_lockfile' "
        "and '/tmp/libtpu_lock_0'. You can attempt to remove them with: \"$ rm "
        "/tmp/libtpu_lockfile\" and \"$ rm -rf /tmp/libtpu_lock_0\". Note: Only remove these "
        "files if you are certain no other legitimate process is using the TPU. (set "
        "JAX_PLATFORMS='' to automatically choose an available backend)")}
    rc, out, events = _run(fake_job(epochs=2, restarts=FAST, extra="backend: jax"),
                           {"error": {"1": stale, "2": stale}})
    assert rc == 0, out
    assert [k for k, _ in _kinds(events)] == ["accelerator_context"] * 2
    assert _actions(events) == ["restart", "reinit_accelerator"]
    reinit = _ev(events, "recovery")[1]
    assert reinit["libtpu_lock"] == [{"path": str(lock), "action": "removed", "why": (
        "no process holds a lock on it (/proc/locks) and none has a TPU device open")}]
    assert not lock.exists()
    assert "ORCHESTRATOR_REINIT_ACCELERATOR" not in _overrides(tmp_path, 3)


def test_accelerator_unavailable_waits_for_the_accelerator(fake_job):
    rc, out, events = _run(fake_job(epochs=2, restarts=FAST),
                           faults=["raise=accelerator_unavailable@step=3"])
    # the real class is tf.errors.UnavailableError: the fake worker imports TensorFlow for it
    assert rc == 0, out
    ended = _ev(events, "attempt_ended")[0]
    assert ended["kind"] == "accelerator_unavailable"
    assert ended["signature"] == "grpc_failed_to_connect"
    assert ended["error"]["type"] == "UnavailableError"
    rec = _ev(events, "recovery")[0]
    assert rec["action"] == "wait_accelerator" and rec["probe"]["state"] == "ok"


def _nvidia_smi(tmp_path, ok_flag):
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\nif [ -e {ok_flag} ]; then echo '0, Tesla T4, 0, 15360'; "
                   f"else echo 'No devices were found'; exit 6; fi\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{exe.parent}{os.pathsep}{os.environ['PATH']}"}


def test_lost_gpu_is_journaled_waited_for_then_the_strategy_falls_back(fake_job, tmp_path):
    flag = tmp_path / "gpu-ok"
    flag.write_text("")
    env = _nvidia_smi(tmp_path, flag)
    job = fake_job(epochs=3, restarts=FAST, extra="""
            strategy: gpu
            probe_interval: 0.2
            recovery:
              strategy_fallback: true
              wait: {initial: 0.05, max: 0.1, timeout: 0.3}
              ladders: {accelerator_unavailable: [wait_accelerator, fallback_strategy]}
    """)
    unavailable = {"type": "UnavailableError", "message": "CUDA_ERROR_LAUNCH_FAILED: "
                   "unspecified launch failure"}
    plan = {"epoch_s": 0.6, "exit_at_epoch": {"1": [3, 1]},
            "error": {"2": unavailable, "3": unavailable}}
    # attempt 1 trains while the GPU disappears; it dies at epoch 3
    import threading
    threading.Timer(0.5, flag.unlink).start()
    rc, out, events = _run(job, plan, env=env)
    assert rc == 0, out
    lost = _ev(events, "accelerator_lost")
    assert lost and lost[0]["attempt"] == 1 and "No devices were found" in lost[0]["detail"]
    probes = [(e["attempt"], e["accelerator"], e["state"]) for e in _ev(events,
                                                                        "accelerator_probe")]
    assert probes[0] == (1, "gpu", "ok")
    assert _actions(events) == ["restart", "wait_accelerator", "fallback_strategy"]
    assert "unavailable" in _ev(events, "recovery")[1]["detail"]
    assert _ev(events, "recovery")[2]["strategy"] == "cpu"
    assert "ORCHESTRATOR_STRATEGY" not in _overrides(tmp_path, 3)
    assert _overrides(tmp_path, 4)["ORCHESTRATOR_STRATEGY"] == "cpu"
    assert probes[-1] == (4, "cpu", "ok")


def test_accelerator_busy_waits(fake_job):
    rc, out, events = _run(fake_job(epochs=2, restarts=FAST),
                           faults=["raise=accelerator_busy@step=3"])
    assert rc == 0, out
    assert _kinds(events) == [("accelerator_busy", "libtpu_in_use")]
    assert _actions(events) == ["wait_accelerator"]




def test_storage_down_fails_commits_and_the_run_waits_it_out(fake_job):
    rc, out, events = _run(fake_job(epochs=3, restarts="{max: 8, backoff: {initial: 0.2, "
                                                        "max: 0.8}}"),
                           faults=["storage-down@step=12,for=1.5"])
    assert rc == 0, out
    kinds = _kinds(events)
    assert kinds and set(kinds) == {("storage", "drive_transport_endpoint")}
    assert set(_actions(events)) == {"restart"}
    assert _epochs(events) == [1, 2, 3]






def test_corrupt_checkpoint_is_skipped_on_resume(fake_job):
    rc, out, events = _run(fake_job(epochs=3, restarts=FAST),
                           faults=["corrupt-checkpoint@epoch=2", "kill@step=25"])
    assert rc == 0, out
    started = _ev(events, "attempt_started")
    # epoch 2's local copy is bad and skipped; whether the durable mirror had copied it
    # before the flip (then an intact copy, resumed from) or not is a race of milliseconds
    # (the mirror may also meet the bad local copy when it uploads it after the flip: it skips
    # it too, with source "mirror")
    skipped = _ev(events, "checkpoint_skipped")
    assert [e["step"] for e in skipped if e.get("source") != "mirror"] == [20], skipped
    assert {e["step"] for e in skipped} == {20}
    durable_first = any(e["event"] == "checkpoint_durable" and e["step"] == 20
                        for e in events[:events.index(started[1])])
    assert [e["from_epoch"] for e in started] == [0, 2 if durable_first else 1]
    ready = [e for e in _ev(events, "worker_ready") if e["attempt"] == 2]
    assert ready[0]["resumed_from_epoch"] == started[1]["from_epoch"]
    assert _epochs(events) == [1, 2, 3]
    assert sorted(e["fault"] for e in _ev(events, "fault_injected")) == \
        ["corrupt-checkpoint@epoch=2", "kill@step=25"]


def test_kill_in_the_middle_of_a_checkpoint_commit(fake_job, tmp_path):
    rc, out, events = _run(fake_job(epochs=3, restarts=FAST), faults=["kill@checkpoint=2"])
    assert rc == 0, out
    fired = _ev(events, "fault_injected")
    assert len(fired) == 1 and fired[0]["step"] == 20 and ".tmp-0000000020" in fired[0]["tmp"]
    assert [e["from_epoch"] for e in _ev(events, "attempt_started")] == [0, 1]
    assert _epochs(events) == [1, 2, 3]


def test_faults_already_fired_do_not_fire_again_when_the_run_is_resumed(fake_job):
    job = fake_job(epochs=2, restarts=FAST)
    _run(job, faults=["exit=3@step=5"])
    rc, out, events = _run(job, faults=["exit=3@step=5"])  # completed run: nothing to do
    assert rc == 0
    assert len(_ev(events, "fault_injected")) == 1

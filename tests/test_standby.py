"""The warm standby, supervisor side, with fake workers (no TensorFlow): when one starts, when
the next attempt is it, when it is discarded, and that none outlives the run."""
import os
import sys
import time

import pytest

from helpers import supervise
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import pid_alive
from orchestrator.supervise.standby import IMPORT_ONLY, WARM, Standby, mode_for

SLOW = {"epoch_s": 0.6}  # epochs long enough for a standby to be up before the kill at epoch 3


def _ev(events, name):
    return [e for e in events if e["event"] == name]


def _pid(run, name):
    with open(os.path.join(run, name)) as f:
        return int(f.read())


def _all_gone(events):
    for e in _ev(events, "standby_started"):
        deadline = time.time() + 2
        while pid_alive(e["pid"]) and time.time() < deadline:
            time.sleep(0.02)
        assert not pid_alive(e["pid"]), e


@pytest.mark.integration
def test_a_killed_worker_is_replaced_by_the_warm_standby_and_a_new_one_starts(fake_job, tmp_path):
    plan = dict(SLOW, exit_at_epoch={"1": [3, -9]}, await_standby=True)
    rc, out, events = supervise(fake_job(epochs=4, extra="standby: on"), plan, standby=True)
    assert rc == 0, out
    run = str(tmp_path / "run")
    started = _ev(events, "attempt_started")
    assert [e["path"] for e in started] == ["cold", "warm"]
    assert started[0]["cold_reason"] == "the first attempt"
    # attempt 2 is the standby's process, which trains and journals its own pid
    assert started[1]["pid"] == _pid(run, "fake-standby-2.pid") == _pid(run, "fake-2.pid")
    assert _ev(events, "worker_ready")[1]["pid"] == started[1]["pid"]
    # ... with the identity its spawn recorded (a later supervisor knows that pid by it)
    standby_2 = _ev(events, "standby_started")[0]
    assert started[1]["identity"] == standby_2["identity"]
    assert standby_2["identity"]["cmdline"][-2:] == ["--standby", "warm"]
    promoted = _ev(events, "standby_promoted")
    assert [(e["attempt"], e["mode"]) for e in promoted] == [(2, "warm")]
    # a new standby behind the promoted one, discarded at the end; none outlives the run
    assert [e["for_attempt"] for e in _ev(events, "standby_started")] == [2, 3]
    assert [e["reason"] for e in _ev(events, "standby_discarded")] == ["the run completed"]
    assert [e["epoch"] for e in _ev(events, "epoch_completed")] == [1, 2, 3, 4]
    assert os.path.exists(os.path.join(run, "attempts", "2.log"))  # its log became the attempt's
    _all_gone(events)


@pytest.mark.integration
def test_a_standby_starts_only_once_the_worker_trains(fake_job):
    _, _, events = supervise(fake_job(epochs=2, extra="standby: on"), SLOW, standby=True)
    names = [(e["event"], e.get("attempt", e.get("for_attempt"))) for e in events]
    assert names.index(("standby_started", 2)) > names.index(("first_step", 1))


@pytest.mark.integration
def test_a_standby_that_fails_to_warm_up_is_replaced_once_then_the_recovery_is_cold(fake_job):
    # the kill at epoch 7: time for both warm-ups to fail first, with the machine loaded (at
    # epoch 4 the replacement had not failed yet once, beside three other test processes)
    plan = dict(SLOW, exit_at_epoch={"1": [7, -9]}, standby_exit={"2": 1})
    rc, out, events = supervise(fake_job(epochs=8, extra="standby: on"), plan, standby=True)
    assert rc == 0, out
    lost = _ev(events, "standby_lost")
    assert [(e["for_attempt"], e["exit_code"]) for e in lost] == [(2, 1), (2, 1)]
    assert "failed to warm up (planned exit 1)" in lost[0]["detail"]
    started = _ev(events, "attempt_started")
    assert [e["path"] for e in started] == ["cold", "cold"]
    assert sum(e["event"] == "attempt_ended" for e in events) == 2  # no attempt lost to it
    # behind attempt 2 a standby (for attempt 3) starts again; the run never waited on one
    assert [e["for_attempt"] for e in _ev(events, "standby_started")] == [2, 2, 3]
    _all_gone(events)


@pytest.mark.integration
def test_a_standby_still_warming_up_is_adopted_and_trains_without_finishing_its_warm_up(
        fake_job, tmp_path):
    plan = dict(SLOW, exit_at_epoch={"1": [3, -9]}, standby_warm_s=30)
    rc, out, events = supervise(fake_job(epochs=4, extra="standby: on"), plan, standby=True)
    assert rc == 0, out
    started = _ev(events, "attempt_started")
    assert [e["path"] for e in started] == ["cold", "adopted"]
    # attempt 2 is the standby's process, promoted before it was ready
    assert started[1]["pid"] == _pid(tmp_path / "run", "fake-standby-2.pid")
    promoted = _ev(events, "standby_promoted")
    assert [(e["attempt"], e["adopted"]) for e in promoted] == [(2, True)]
    assert not [e for e in _ev(events, "standby_ready") if e["for_attempt"] == 2]
    assert [e["for_attempt"] for e in _ev(events, "standby_discarded")] == [3]  # the run's end
    assert [e["epoch"] for e in _ev(events, "epoch_completed")] == [1, 2, 3, 4]
    _all_gone(events)


@pytest.mark.parametrize("setting, strategy, accelerator, backend, mode", [
    ("auto", "cpu", "cpu", "tensorflow", WARM),
    ("auto", "gpu", "gpu", "jax", WARM),
    ("auto", "tpu", "tpu_node", "tensorflow", IMPORT_ONLY),
    ("auto", "tpu", "tpu_vm", "tensorflow", None),       # importing TensorFlow takes libtpu
    ("import_only", "tpu", "tpu_vm", "tensorflow", None),  # ... even when asked for
    ("auto", "tpu", "tpu_vm", "jax", IMPORT_ONLY),       # JAX takes it at its first device query
    ("import_only", "tpu", "tpu_vm", "jax", IMPORT_ONLY),
    ("off", "tpu", "tpu_vm", "jax", None),
    ("import_only", "cpu", "cpu", "tensorflow", IMPORT_ONLY),
    ("off", "cpu", "cpu", "tensorflow", None),
])
def test_the_mode_per_setting_strategy_and_backend(setting, strategy, accelerator, backend, mode):
    assert mode_for(setting, strategy, accelerator, backend)[0] == mode


@pytest.mark.integration
def test_a_discarded_standby_is_gone_when_discard_returns(tmp_path):
    """Not still exiting: a run that ends right after must not leave it behind (seen: a JAX
    standby, SIGKILLed at the run's end beside two busy loops, outlived the supervisor)."""
    import queue

    journal = Journal(str(tmp_path / "events.jsonl"))
    sb = Standby(2, WARM, [sys.executable, "-c", "import sys; sys.stdin.readline()"],
                 dict(os.environ), str(tmp_path), str(tmp_path / "standby.log"), queue.Queue(),
                 journal).start()
    sb.discard("the run completed")
    assert sb.proc.returncode == -9 and not os.path.exists(f"/proc/{sb.proc.pid}")
    assert journal.events("standby_discarded")[0]["was_alive"] is True


PRIORITY_CHILD = """
import os, threading
from orchestrator.train import standby

def nices():
    return sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')})

def score():
    return open('/proc/self/oom_score_adj').read().strip()

stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # a thread that exists before
before = standby.lower_priority()
late = threading.Thread(target=stop.wait, daemon=True)  # one made while lowered (a TF pool)
late.start()
print(before, nices(), score())
print(standby.restore_priority(before), nices(), score())
"""


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0, reason="restoring a priority needs root (as on Colab)")
def test_the_standby_lowers_every_thread_and_puts_them_back_when_promoted():
    import subprocess

    from helpers import ROOT

    out = subprocess.run([sys.executable, "-c", PRIORITY_CHILD], capture_output=True,
                         text=True, cwd=ROOT, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    lowered, restored = out.stdout.splitlines()
    assert lowered == "0 [19] 1000"
    assert restored == "None [0] 0"


def test_an_adopted_standby_whose_warm_up_then_fails_fails_as_the_attempt_with_its_record(
        monkeypatch):
    """Adopted while importing, it is the attempt: a failure in the rest of its start-up goes
    through the attempt's ``guarded`` (error record, exit status the supervisor classifies),
    not a standby's silent exit 1."""
    import io

    from orchestrator.train import attempt, outcome, standby

    monkeypatch.setattr(standby, "lower_priority", lambda: 0)
    monkeypatch.setattr(standby, "restore_priority", lambda before: None)
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"attempt": 4}\n'))  # the line comes at once
    guarded = []

    def configure(spec, t0):
        time.sleep(0.3)  # the promotion thread reads the line meanwhile
        raise OSError("the framework's import failed")

    def record(rd, attempt, progress, body):
        with pytest.raises(OSError) as raised:
            body()
        guarded.append((attempt, str(raised.value)))
        return 1

    monkeypatch.setattr(attempt, "configure", configure)
    monkeypatch.setattr(outcome, "guarded", record)
    rc = standby.serve(None, None, 3, WARM, None, time.time())
    assert rc == 1 and guarded == [(4, "the framework's import failed")]


def test_an_adopted_standby_reads_the_checkpoint_while_it_builds_the_model(fake_job,
                                                                           monkeypatch):
    """Adopted during the framework's import, it still has the model to build: the checkpoint
    is read beside that, in a thread, as a cold attempt reads it beside the import."""
    import io

    from helpers import run_with_a_checkpoint, watch_reads
    from orchestrator.train import attempt, outcome, standby

    spec, layout, _ = run_with_a_checkpoint(fake_job())
    monkeypatch.setattr(standby, "lower_priority", lambda: 0)
    monkeypatch.setattr(standby, "restore_priority", lambda before: None)
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"attempt": 4}\n'))  # the line comes at once
    seen, done = watch_reads(monkeypatch)

    class Built(Exception):
        pass

    def prepare(spec, t0, marks):  # the model's build: over once the read is (or 10 s passed)
        seen["read while building"] = done.wait(10)
        raise Built

    def configure(spec, t0):
        time.sleep(0.3)  # the promotion thread reads the line meanwhile: adopted
        return {}

    def record(rd, n, progress, body):
        with pytest.raises(Built):
            body()
        return 1

    monkeypatch.setattr(attempt, "configure", configure)
    monkeypatch.setattr(attempt, "prepare", prepare)
    monkeypatch.setattr(outcome, "guarded", record)
    assert standby.serve(spec, layout, 3, WARM, None, time.time()) == 1
    assert seen == {"thread": "checkpoint-read", "step": 30, "read while building": True}

"""The supervisor with two tiers (fake workers): Drive outages, a kill mid-upload, corrupt
checkpoints, retention, and the refusal of an incompatible resume."""
import errno
import json
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import ckarrays
from helpers import ROOT, fake_commands, fake_env
from drivefaults import DriveFaults
from orchestrator import cli
from orchestrator.checkpoint import tiers
from orchestrator.core.journal import Journal
from orchestrator.core.specload import load
from orchestrator.ops.status import format_status, run_status
from orchestrator.supervise.admission import IncompatibleResume
from orchestrator.supervise.supervisor import Supervisor

# integration: the real supervisor with the fake worker, a supervisor killed
# mid-upload: real processes, real waiting
pytestmark = pytest.mark.integration


CKPT = "checkpoint: {keep: 2, keep_every_epochs: 3, upload_backoff: {initial: 0.02, max: 0.1}}"


def _run(job, plan, **kw):
    out = io.StringIO()
    sup = Supervisor(load(job), commands=fake_commands(), out=out, env=fake_env(plan), **kw)
    rc = sup.run()
    return rc, out.getvalue(), Journal(sup.rd.journal).events()


def _count(events, kind):
    return sum(e["event"] == kind for e in events)


def _durable_steps(job):
    store = tiers.for_spec(load(job))
    return [c.step for c in store.durable.list() if store.durable.verify(c.path) is None]


def _wait_for(path, kind, n=1, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if sum(1 for _ in Journal(path).iter(kind)) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"no {n} x {kind} within {timeout} s")


def test_drive_down_mid_run_training_goes_on_and_everything_due_is_flushed(fake_job, tmp_path):
    job = fake_job(epochs=9, extra=CKPT)
    journal = str(tmp_path / "run" / "events.jsonl")
    remounts = []
    with DriveFaults(str(tmp_path / "run" / "checkpoints")) as drive:
        def outage():
            _wait_for(journal, "checkpoint_durable", 1)
            drive.down(errno.ENOTCONN)
            _wait_for(journal, "checkpoint_committed", 6)  # five epochs while Drive is gone
            # On a loaded machine the five epochs can be committed before the mirror next
            # tries: hold Drive down until the outage has been seen.
            _wait_for(journal, "durable_unreachable", 1)
            drive.up()

        t = threading.Thread(target=outage, daemon=True)
        t.start()
        rc, out, events = _run(job, {"epoch_s": 0.1}, remount=remounts.append)
        t.join(5)
    assert rc == 0, out
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == list(range(1, 10))
    assert _count(events, "attempt_started") == 1  # the worker never noticed
    assert _count(events, "durable_unreachable") == 1 and _count(events, "durable_restored") == 1
    assert any(e["event"] == "durable_backlog" and len(e["steps"]) >= 2 for e in events)
    assert remounts and remounts[0].endswith("checkpoints")
    # everything retention keeps (last 2 + every 3rd epoch) is durable and verifies
    assert _durable_steps(job) == [30, 60, 80, 90]
    assert events[-1]["event"] == "run_completed" and events[-1]["durable_pending"] == []
    assert "unreachable" in out and "is back" in out


def test_run_end_waits_for_the_durable_copies_then_warns(fake_job, tmp_path):
    job = fake_job(epochs=2, extra="checkpoint: {flush_timeout: 0.5, upload_backoff: "
                                   "{initial: 0.05, max: 0.1}}")
    with DriveFaults(str(tmp_path / "run" / "checkpoints")) as drive:
        drive.down(errno.EIO)
        rc, out, events = _run(job, {})
        s = run_status(str(tmp_path / "run"))
    assert rc == 0
    assert events[-1]["event"] == "run_completed" and events[-1]["durable_pending"] == [20, 10]
    assert "not durable after 0 s" in out and "Input/output error" in str(events)
    assert s["checkpoints_by_tier"]["run_dir"] is None
    assert "Input/output error" in s["durable_error"]
    assert s["checkpoints_by_tier"]["local"]["step"] == 20  # the local tier has it
    assert s["last_checkpoint"]["step"] == 20
    rc, out, events = _run(job, {})  # the same command again, Drive back: flushed
    assert rc == 0 and _durable_steps(job) == [10, 20]
    s = run_status(str(tmp_path / "run"))
    assert s["checkpoints_by_tier"]["run_dir"]["step"] == 20 and s["durable_error"] is None
    assert "last checkpoint (run_dir): epoch 2, step 20" in format_status(s)


def test_supervisor_killed_during_a_durable_upload_leaves_nothing_half_done(fake_job, tmp_path):
    job = fake_job(epochs=3, extra="checkpoint: {upload_backoff: {initial: 0.02, max: 0.1}}")
    durable = tmp_path / "run" / "checkpoints"
    code = ("import sys; sys.path.insert(0, %r); sys.path.insert(0, %r)\n"
            "from helpers import fake_commands\n"
            "from drivefaults import DriveFaults\n"
            "from orchestrator.core.specload import load\n"
            "from orchestrator.supervise.supervisor import Supervisor\n"
            "with DriveFaults(%r) as d:\n"
            "    d.delay = 0.3\n"
            "    sys.exit(Supervisor(load(%r), commands=fake_commands()).run())\n"
            % (os.path.join(ROOT, "tests"), ROOT, str(durable), job))
    p = subprocess.Popen([sys.executable, "-c", code], env=fake_env({}),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (durable.is_dir() and any(
            n.startswith(".tmp-") and os.listdir(durable / n) for n in os.listdir(durable))):
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)  # mid-copy: a partial durable directory is left behind
    p.communicate()
    assert any(n.startswith(".tmp-") for n in os.listdir(durable))
    store = tiers.for_spec(load(job))
    for c in store.durable.list():  # whatever is there under a final name verifies
        assert store.durable.verify(c.path) is None
    rc, out, events = _run(job, {})
    assert rc == 0, out
    assert not any(n.startswith(".tmp-") for n in os.listdir(durable))
    assert _durable_steps(job) == [10, 20, 30]
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2, 3]


def test_corrupt_newest_checkpoint_in_both_tiers_is_skipped_not_a_crash_loop(fake_job):
    job = fake_job(epochs=2, extra="checkpoint: {keep: 5}")
    rc, _, _ = _run(job, {})
    assert rc == 0
    store = tiers.for_spec(load(job))
    for tier in (store.local, store.durable):
        c20 = next(c for c in tier.list() if c.step == 20)
        with open(ckarrays.blob_path(c20), "r+b") as f:
            f.write(b"#")
    rc, out, events = _run(fake_job(epochs=4, extra="checkpoint: {keep: 5}"), {})
    assert rc == 0, out
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert {(e["step"], e["reason"]) for e in skipped} == {
        (20, f"blob {ckarrays.blob_hash(c20)} of model.0000: checksum mismatch")}
    assert len(skipped) == 2  # both copies, once, by the one attempt that then went on
    started = [e for e in events if e["event"] == "attempt_started"]
    assert [e["from_epoch"] for e in started] == [0, 1]  # the second run: from epoch 1
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2, 3, 4]
    assert _durable_steps(job) == [10, 20, 30, 40]  # the corrupt copy was replaced


def test_changed_model_data_or_optimizer_is_refused_unless_forced(fake_job, capsys):
    job = fake_job(epochs=2)
    assert _run(job, {})[0] == 0
    text = open(job).read()
    with open(job, "w") as f:
        f.write(text.replace("batch_size: 8", "batch_size: 16"))
    with pytest.raises(IncompatibleResume, match="batch_size changed since it was created"):
        Supervisor(load(job), commands=fake_commands()).run()
    assert cli.main(["run", job]) == 2
    err = capsys.readouterr().err
    assert "cannot resume the run" in err and "--force" in err and "Traceback" not in err
    rc, out, events = _run(job, {}, force=True)
    assert rc == 0 and "resuming despite changed batch_size (--force)" in out
    forced = [e for e in events if e["event"] == "resume_forced"]
    assert len(forced) == 1 and forced[0]["changed"] == ["batch_size"]
    assert _run(job, {})[0] == 0  # the forced hash is now the run's own


def test_a_resume_under_the_other_backend_is_refused_naming_both_unless_forced(fake_job):
    job = fake_job(epochs=2)
    assert _run(job, {})[0] == 0  # trained on TensorFlow (the suite's KERAS_BACKEND)
    assert json.load(open(os.path.join(load(job).run_dir, "run.json")))["backend"] == "tensorflow"
    with pytest.raises(IncompatibleResume, match=r"backend \(the run trained on tensorflow, "
                                                 r"this one would train on jax.*\) changed"):
        Supervisor(load(job, backend="jax"), commands=fake_commands()).run()
    sup = Supervisor(load(job, backend="jax"), commands=fake_commands(), force=True,
                     out=io.StringIO())
    assert sup.run() == 0
    info = json.load(open(os.path.join(load(job).run_dir, "run.json")))
    assert info["backend"] == "jax" and info["training"]["backend"] == "jax"


def test_changing_epochs_or_restarts_resumes_without_force(fake_job):
    assert _run(fake_job(epochs=2), {})[0] == 0
    rc, out, events = _run(fake_job(epochs=3, restarts="{max: 5}"), {})
    assert rc == 0, out
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2, 3]

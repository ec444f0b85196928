"""``orchestrator colab`` end to end, against the Colab CLI's simulator (tests/fakes/colab_sim.py):
the digits job carried through runtimes that are recycled at random moments, one while it
starts up, with one capacity refusal between them, ends with the weights of an uninterrupted
run, and the outer journal holds the three runtimes.

The simulator runs each runtime's code in mount and UTS namespaces of its own (``unshare``):
root is needed, as on CI here.
"""
import json
import os
import random
import subprocess
import sys
import time

import pytest

from colabsim import SIM, control, namespaces_work, sim
from helpers import ROOT, wait_while_running
from test_e2e import DIGITS_JOB, _completed, digits_reference, write_job_files  # noqa: F401
from orchestrator.core import hosts
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.ops.status import run_status

pytestmark = pytest.mark.e2e

RUN_DIR = "/content/drive/MyDrive/runs/digits"
# a lost runtime's lock may be taken over 3 s after its last refresh (Colab: 120 s); no
# standby (it would import TensorFlow a second time in a runtime, for nothing here)
COLAB_JOB = DIGITS_JOB + "lock_stale_after: 3\nstandby: off\n"


def _drive_events(home):
    return Journal(str(home / "drive" / "MyDrive" / "runs" / "digits" / "events.jsonl")).events()


@pytest.mark.skipif(not namespaces_work(), reason="the simulator's runtimes need `unshare` "
                                                   "(root)")
def test_a_run_survives_two_recycled_runtimes_and_a_refusal_with_the_uninterrupted_weights(
        tmp_path, backend, digits_reference):  # noqa: F811
    rng = random.Random(int(os.environ.get("COLAB_E2E_SEED", "2025")))
    home, local = tmp_path / "sim", tmp_path / "local"
    home.mkdir()
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    write_job_files(job_dir)
    job = job_dir / "job.yaml"
    job.write_text(COLAB_JOB + f"backend: {backend}\n")
    env = dict(os.environ, COLAB_SIM_HOME=str(home), COLAB_SIM_PYTHON=sys.executable,
               ORCHESTRATOR_COLAB_CLI=SIM, PYTHONPATH=ROOT)
    driver = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "colab", str(job), "--run-dir", RUN_DIR,
         "--local-dir", str(local), "--poll", "2", "--lock-retry", "1", "--backoff", "0.5",
         "--unreachable", "30"], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    recycled = []
    try:
        # 1. while the first runtime starts up: its supervisor has started, no step is done
        first = "orc-digits-e2e-1"
        wait_while_running(driver, lambda: (home / "runtimes" / first / "orchestrator-colab" /
                                            "run.log").exists(),
                           "the first runtime's supervisor started", cap=180)
        time.sleep(rng.uniform(0.0, 1.5))
        assert not [e for e in _drive_events(home) if e["event"] == Event.FIRST_STEP]
        control(home, refuse=["capacity"])  # the next `colab new` is refused
        assert sim(home, "_recycle", first).returncode == 0
        recycled.append((first, time.time()))

        # 2. the second runtime, mid-training at a random step
        second = "orc-digits-e2e-2"
        target = rng.randint(15, 90)  # 3 epochs of margin: the run must not end first
        wait_while_running(driver, lambda: any(
            e["event"] == Event.CHECKPOINT_COMMITTED and e["step"] >= target
            and e["ts"] > recycled[0][1] for e in _drive_events(home)),
            f"a checkpoint at step {target} or later on the second runtime", cap=300)
        assert sim(home, "_recycle", second).returncode == 0
        recycled.append((second, time.time()))

        out, _ = driver.communicate(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()  # we started it
            driver.wait()
    assert driver.returncode == 0, out
    assert "refused (capacity)" in out

    # the outer journal: three runtimes, two lost, the last completed; kept here and on Drive
    runtimes = hosts.hosts(Journal(str(local / hosts.FILE)).events())
    assert [(h.session, h.why) for h in runtimes] == [
        (first, "lost"), (second, "lost"), ("orc-digits-e2e-3", "completed")]
    assert [h.refusals for h in runtimes] == [0, 1, 0]
    on_drive = home / "drive" / "MyDrive" / "runs" / "digits" / hosts.FILE
    assert len(hosts.hosts(Journal(str(on_drive)).events())) == 3

    # the run: the weights of the uninterrupted run; each supervisor on its runtime's host,
    # none started before the runtime before it was gone (never two trainers)
    events = _drive_events(home)
    ref = digits_reference["events"]
    assert _completed(events)["weights_sha256"] == _completed(ref)["weights_sha256"]
    assert _completed(events)["state_sha256"] == _completed(ref)["state_sha256"]
    starts = [e for e in events if e["event"] in (Event.RUN_STARTED, Event.RUN_RESUMED)]
    by_host = {e["host"]: e["ts"] for e in starts}
    assert by_host.get(second, 0) > recycled[0][1] and by_host["orc-digits-e2e-3"] > recycled[1][1]
    assert any(e["event"] == Event.LOCK_TAKEN_OVER for e in events)

    # status counts the time between runtimes; the export came home
    s = run_status(str(home / "drive" / "MyDrive" / "runs" / "digits"))
    assert [r["why"] for r in s["runtimes"]] == ["lost", "lost", "completed"]
    assert s["time_by_cause_s"]["between_runtimes"] > 0 and s["away_s"] == 0
    assert (local / "export" / "model.weights.h5").is_file()
    assert json.loads((home / "backend.json").read_text()) == {}  # every runtime freed

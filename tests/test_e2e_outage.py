"""Real training (on JAX only: the run directory's mirrors never pass through the backend): the
whole run directory (a Drive mount) gone for 6 s in the middle of an epoch. The run completes with the weights of an uninterrupted run, and the run directory's
journal ends with the same events as the local one. Before the control state was local-first,
the supervisor died with a NotADirectoryError traceback (issue: Drive going away)."""
import os
import subprocess
import sys
import time

import pytest

from helpers import ONE_BACKEND, ROOT
from test_e2e import DIGITS_JOB, digits_reference, write_job_files  # noqa: F401
from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.core.journal import Journal
from orchestrator.core.rundir import RunDir
from orchestrator.core.specload import load

pytestmark = pytest.mark.e2e


def _run(job, run_dir, *args):
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                             str(run_dir), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@ONE_BACKEND
def test_the_run_directory_gone_for_6_s_mid_epoch_changes_nothing_in_the_weights(
        tmp_path, backend, digits_reference):
    # the digits job, compared with the session's uninterrupted run of it; its steps slowed
    # (the same weights) so that training and its checkpoints go on through the outage
    write_job_files(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(DIGITS_JOB + f"backend: {backend}\n")
    ref_done = [e for e in digits_reference["events"] if e["event"] == "run_completed"][0]

    run = tmp_path / "run"
    rd = RunDir.for_spec(load(str(job), run_dir=str(run)))
    p = _run(str(job), run, "--fault", "slow-steps@step=1,for=0.03")
    deadline = time.time() + 120
    while time.time() < deadline and not any(
            e["epoch"] == 1 for e in Journal(rd.journal).events("epoch_completed")):
        time.sleep(0.05)
    away = tmp_path / "run-away"
    os.rename(run, away)
    run.write_text("not a directory: the Drive mount is gone")
    time.sleep(6)
    run.unlink()
    os.rename(away, run)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "Traceback" not in out
    with open(rd.journal, "rb") as f, open(run / "events.jsonl", "rb") as g:
        assert f.read() == g.read()
    events = Journal(str(run / "events.jsonl")).events()
    names = [e["event"] for e in events]
    assert "run_dir_unreachable" in names and "run_dir_restored" in names
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2, 3, 4, 5]
    done = next(e for e in events if e["event"] == "run_completed")
    assert done["weights_sha256"] == ref_done["weights_sha256"]
    final = CheckpointStore(str(run / "checkpoints")).latest_valid()
    assert final.epoch == 5 and final.manifest["weights_sha256"] == ref_done["weights_sha256"]

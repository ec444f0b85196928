"""Real TensorFlow: the whole run directory (a Drive mount) gone for 6 s in the middle of an
epoch. The run completes with the weights of an uninterrupted run, and the run directory's
journal ends with the same events as the local one. Before the control state was local-first,
the supervisor died with a NotADirectoryError traceback (issue: Drive going away)."""
import os
import subprocess
import sys
import time

import pytest

from helpers import BOTH_BACKENDS, ROOT
from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.core.journal import Journal
from orchestrator.core.rundir import RunDir
from orchestrator.core.specload import load

pytestmark = pytest.mark.e2e

JOB = """
name: digits-outage
model: digits_job:build_model
data: digits_job:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}
epochs: 3
batch_size: 16
strategy: cpu
seed: 9
deterministic: true
checkpoint: {every_epochs: 1, every_steps: 40}
heartbeat_interval: 0.05
"""


def _run(job, run_dir):
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@BOTH_BACKENDS
def test_the_run_directory_gone_for_6_s_mid_epoch_changes_nothing_in_the_weights(tmp_path):
    import shutil

    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    ref = _run(str(job), tmp_path / "ref")
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out
    ref_done = Journal(str(tmp_path / "ref" / "events.jsonl")).events("run_completed")[0]

    run = tmp_path / "run"
    rd = RunDir.for_spec(load(str(job), run_dir=str(run)))
    p = _run(str(job), run)
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
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2, 3]
    done = next(e for e in events if e["event"] == "run_completed")
    assert done["weights_sha256"] == ref_done["weights_sha256"]
    final = CheckpointStore(str(run / "checkpoints")).latest_valid()
    assert final.epoch == 3 and final.manifest["weights_sha256"] == ref_done["weights_sha256"]

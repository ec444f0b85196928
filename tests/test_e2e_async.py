"""Real TensorFlow: checkpoints written in the background while training goes on.

A kill that lands during a background write (training already steps past it) leaves the
previous checkpoint intact and the run ends bit-identical to an uninterrupted one; a background
write that fails with ENOSPC fails the attempt as ``storage`` (raised at a later step boundary,
from the writer's thread), and the run goes on.
"""
import json

import pytest

from helpers import JAX_THEN_TF_IN_SOAK, ONE_BACKEND, ROOT
from orchestrator.core.journal import Journal
from test_e2e import (DIGITS_JOB, EVERY_STEPS, _completed, digits_reference,  # noqa: F401
                      write_job_files)

pytestmark = pytest.mark.e2e


@pytest.fixture
def reference(digits_reference):
    """The uninterrupted digits run (test_e2e's, run once for the session): the background
    writer said here is the default it ran with."""
    return digits_reference["events"]


def _job(where):
    write_job_files(where)
    # the background writer is the default; said here since it is what these tests are about
    # (no standby: `auto` would start one after the kill that nothing uses; the reference ran
    # with none either, its run had no failure)
    (where / "job.yaml").write_text(DIGITS_JOB.replace("checkpoint: {",
                                                       "checkpoint: {background: true, ", 1)
                                    + "standby: off\n")
    return str(where / "job.yaml")


def _run_with_faults(tmp_path, *faults):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "orchestrator", "run", _job(tmp_path), "--run-dir",
           str(tmp_path / "run")]
    for f in faults:
        cmd += ["--fault", f]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return Journal(str(tmp_path / "run" / "events.jsonl")).events()


def _same_training(events, ref_events):
    assert _completed(events)["weights_sha256"] == _completed(ref_events)["weights_sha256"]
    assert _completed(events)["state_sha256"] == _completed(ref_events)["state_sha256"]
    epochs = [e for e in events if e["event"] == "epoch_completed"]
    ref_epochs = [e for e in ref_events if e["event"] == "epoch_completed"]
    assert [(e["epoch"], e["metrics"]) for e in epochs] == \
        [(e["epoch"], e["metrics"]) for e in ref_epochs]


# The writer's thread and the commit protocol are the backend's only through the snapshot's
# host copy, which every TensorFlow run in the suite takes (its kills: test_e2e's, the GAN's):
# TensorFlow's run of this one (21 CPU-s) is in the soak tier.
@JAX_THEN_TF_IN_SOAK
def test_a_kill_during_a_background_write_keeps_the_previous_checkpoint_and_exact_weights(
        reference, tmp_path):
    # the 2nd commit (step 20, or 30 when the first write was still busy at 20) takes 1.5 s
    # more after its payload, then the worker is killed
    events = _run_with_faults(tmp_path, "delay-checkpoint@checkpoint=2,for=1.5",
                              "kill@checkpoint=2")
    kill = json.loads((tmp_path / "run" / "faults" / "kill_checkpoint_2.json").read_text())
    assert kill["step"] in (2 * EVERY_STEPS, 3 * EVERY_STEPS) and kill["attempt"] == 1
    # training went on beside the write: the next periodic checkpoint fell due while it was
    # still being written and was skipped (a write made in line would have held training)
    busy = [e for e in events if e["event"] == "checkpoint_skipped_busy" and e["attempt"] == 1]
    assert any(b["writing_step"] == kill["step"] and b["step"] > kill["step"] for b in busy)
    ended = next(e for e in events if e["event"] == "attempt_ended" and e["attempt"] == 1)
    assert ended["kind"] == "killed"
    # the write in flight never got its marker: the next attempt resumes at the one before
    ready = next(e for e in events if e["event"] == "worker_ready" and e["attempt"] == 2)
    assert ready["resumed_from_step"] == EVERY_STEPS  # the first checkpoint, committed
    assert not [e for e in events if e["event"] == "resume_not_exact"]
    _same_training(events, reference)


@ONE_BACKEND
def test_enospc_in_the_background_writer_fails_the_attempt_as_storage(reference, tmp_path):
    events = _run_with_faults(tmp_path, "disk-full@checkpoint=2")
    fault = json.loads((tmp_path / "run" / "faults" / "disk-full_checkpoint_2.json").read_text())
    record = json.loads((tmp_path / "run" / "attempts" / "1.error.json").read_text())
    assert record["type"] == "OSError" and "[Errno 28] No space left on device" in \
        record["message"]
    # raised on the training thread at a later step boundary, not in the step that took it
    # (the second checkpoint is step 20, or 30 when the writer was still busy at 20)
    assert record["step"] > fault["step"] and fault["step"] % EVERY_STEPS == 0
    ended = next(e for e in events if e["event"] == "attempt_ended" and e["attempt"] == 1)
    assert ended["kind"] == "storage", ended
    ready = next(e for e in events if e["event"] == "worker_ready" and e["attempt"] == 2)
    assert ready["resumed_from_step"] == EVERY_STEPS  # the first checkpoint, committed  # the failed checkpoint left nothing
    _same_training(events, reference)

"""Models that ``fit`` trains with a ``train_step``, ``compile`` or ``compute_loss`` of their
own (issue 24), SIGKILLed twice mid-epoch, end bit-identical to their uninterrupted runs.

The jobs are in tests/fixtures/anymodel (written from keras-io's examples, not copied): a GAN
with two optimizers held as attributes, fed by a generator function of the epoch; a VAE whose
sampling layer has its own SeedGenerator and no compiled loss; a WGAN-GP with three critic steps
per generator step; and a classifier with a compute_loss of its own, fed by a PyDataset of dict
inputs and sample weights (issue 24's item 5: data the job batches itself). Each runs on the backends its code is
written for. Cost: one reference run and one killed run (three attempts) per case, started side
by side; a few epochs of 8 steps on 256 digits; no standby.
"""
import os
import shutil

import pytest

from helpers import JAX_THEN_TF_IN_SOAK, ROOT, SOAK, finished_run, only_event, start_run

pytestmark = pytest.mark.e2e

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "anymodel")
JOB = """
name: {name}
model: {module}:build_model
data: {module}:load_data
{compile}
epochs: 3
batch_size: 32
strategy: cpu
seed: 5
deterministic: true
standby: "off"
backend: {backend}
checkpoint: {{every_epochs: 1, every_steps: 3, keep: 2, background: false}}
restarts: {{max: 4, backoff: {{initial: 0.1, max: 0.5}}}}
heartbeat_interval: 0.2
export: {{saved_model: false}}
"""  # helpers.NO_SAVED_MODEL, in a format string
# 8 steps an epoch: both kills fall mid-epoch (epoch 1 at step 5, epoch 2 at step 14), each
# after a mid-epoch checkpoint the next attempt resumes from (written in line: committed before
# the next step, so the resume points are steps 3 and 12 whatever the disk's speed)
KILLS = ("kill@step=5", "kill@step=14")
CLASSIFIER = "compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}"
# Data the job batches itself (train/epochdata.py) is two of these jobs': the GAN's, a generator
# function of the epoch (which TensorFlow's fit wraps in tf.data), and the compute_loss
# classifier's, a PyDataset with set_epoch read by two threads (which JAX's fit reads as it is),
# not cases of their own: each case costs four framework starts, on a suite bound by its 2 cores.
CASES = [
    pytest.param("gan_job", "", "tensorflow", ("optimizer@d_optimizer", "optimizer@g_optimizer"),
                 id="gan-tensorflow"),
    pytest.param("vae_job", "", "tensorflow", (), id="vae-tensorflow", marks=SOAK),
    pytest.param("vae_job", "", "jax", (), id="vae-jax"),
    pytest.param("wgan_job", "", "tensorflow", ("optimizer@d_optimizer", "optimizer@g_optimizer"),
                 id="wgan_gp-tensorflow", marks=SOAK),
    pytest.param("closs_job", CLASSIFIER, "jax", (), id="compute_loss-jax"),
]


@pytest.mark.parametrize("module, compile_, backend, groups", CASES)
def test_a_model_fit_trains_resumes_bit_identical_after_two_kills(module, compile_, backend,
                                                                  groups, tmp_path):
    for name in (module + ".py", "anymodel_data.py"):
        shutil.copy(os.path.join(FIXTURES, name), tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(name=module.replace("_", "-"), module=module, compile=compile_,
                              backend=backend))
    ref = start_run(str(job), tmp_path / "ref")  # side by side: the kills are by step, not time
    run = start_run(str(job), tmp_path / "run", KILLS)
    ref_events, events = finished_run(ref, tmp_path / "ref"), finished_run(run, tmp_path / "run")

    assert len([e for e in events if e["event"] == "fault_injected"]) == 2
    ready = [e for e in events if e["event"] == "worker_ready"]
    assert len(ready) == 3 and all(r["backend"] == backend for r in ready)
    assert [(r["resumed_from_epoch"], r["resumed_from_batch"]) for r in ready] == [
        (0, 0), (0, 3), (1, 4)]  # both mid-epoch
    assert not [e for e in events if e["event"] == "resume_not_exact"]
    # the last worker exported what it could (no exporter process: its cost is not the test's)
    assert [e.get("source") for e in events if e["event"] == "exported"] == ["worker"]
    done, ref_done = only_event(events, "run_completed"), only_event(ref_events, "run_completed")
    assert done["weights_sha256"] == ref_done["weights_sha256"]
    assert done["state_sha256"] == ref_done["state_sha256"]
    # every optimizer the model holds is a group of its own in the checkpoints, with the
    # variables it was built over (what a restore builds it with before the first step)
    from orchestrator.checkpoint.store import CheckpointStore

    last = CheckpointStore(str(tmp_path / "run" / "checkpoints")).latest_valid()
    held = last.manifest["holders"]
    assert {"model", "optimizer", *groups} <= set(held)
    for g in groups:
        assert held[g]["built_over"] and -1 not in held[g]["built_over"]


@JAX_THEN_TF_IN_SOAK
def test_a_frozen_backbone_killed_three_times_resumes_bit_identical_writing_only_the_head(
        backend, tmp_path):
    """Issue 37: the frozen layers' blobs are written once per tier; every later checkpoint
    (those after a kill included) writes no more than the arrays that are not frozen (the
    head, its optimizer slots, the step counters and metrics)."""
    for name in ("frozen_job.py", "anymodel_data.py"):
        shutil.copy(os.path.join(FIXTURES, name), tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(name="frozen", module="frozen_job", compile=CLASSIFIER,
                              backend=backend))
    ref = start_run(str(job), tmp_path / "ref")
    run = start_run(str(job), tmp_path / "run", KILLS + ("kill@step=20",))
    ref_events, events = finished_run(ref, tmp_path / "ref"), finished_run(run, tmp_path / "run")

    assert len([e for e in events if e["event"] == "fault_injected"]) == 3
    ready = [e for e in events if e["event"] == "worker_ready"]
    assert [(r["resumed_from_epoch"], r["resumed_from_batch"]) for r in ready] == [
        (0, 0), (0, 3), (1, 4), (2, 2)]
    assert not [e for e in events if e["event"] == "resume_not_exact"]
    done, ref_done = only_event(events, "run_completed"), only_event(ref_events, "run_completed")
    assert done["weights_sha256"] == ref_done["weights_sha256"]
    assert done["state_sha256"] == ref_done["state_sha256"]

    from orchestrator.checkpoint.store import CheckpointStore

    last = CheckpointStore(str(tmp_path / "run" / "checkpoints")).latest_valid()
    paths = {d["key"]: d["path"] for d in last.manifest["variables"]}
    frozen = {k for k, p in paths.items() if "frozen_1/" in p or "frozen_2/" in p}
    assert len(frozen) == 4  # two kernels, two biases
    size = {k: sum(n for _, n in r["chunks"]) for k, r in last.manifest["arrays"].items()}
    others = sum(n for k, n in size.items() if k not in frozen)
    assert sum(size[k] for k in frozen) > 10 * others  # what is frozen dominates the state
    for evs in (ref_events, events):
        written = [e["bytes_written"] for e in evs if e["event"] == "checkpoint_committed"]
        assert written[0] >= sum(size[k] for k in frozen) and len(written) > 5
        # a mid-epoch checkpoint holds the epoch's running metric state too: a few scalars
        assert all(0 < b <= others + 64 for b in written[1:]), (written, others)

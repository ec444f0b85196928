"""The KerasHub LoRA job (jobs/lora, issue 37): a BERT backbone built from its config, LoRA on
its attention, a head, on synthetic tokens. Killed twice mid-epoch, it ends bit-identical to
its uninterrupted run on both backends; and, once checkpoints store each array once per tier,
its checkpoints after the first hold only what LoRA trains (factors, head, optimizer).

Needs KerasHub installed without its TensorFlow deps (``pip install --no-deps keras-hub regex
tokenizers``: jobs/lora/job.yaml says why); skipped, saying so, where it is not. Cost: a
reference run and a killed run (three attempts) per backend, side by side; 2 epochs of 14 steps.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from helpers import (JAX_THEN_TF_IN_SOAK, NO_SAVED_MODEL, ROOT, finished_run, only_event,
                     start_run)
from orchestrator.checkpoint.store import CheckpointStore

pytestmark = [pytest.mark.e2e, JAX_THEN_TF_IN_SOAK]

JOB_DIR = os.path.join(ROOT, "jobs", "lora")
# 14 steps an epoch (448 examples, batch 32), a checkpoint every 5 steps, written in line
# (committed before the next step): the kills at steps 8 and 19 resume from steps 5 and 15,
# both mid-epoch
KILLS = ("kill@step=8", "kill@step=19")
OVERRIDES = {"epochs": 2, "standby": "off", "heartbeat_interval": 0.2,
             "checkpoint": {"every_epochs": 1, "every_steps": 5, "keep": 3, "background": False},
             "restarts": {"max": 4, "backoff": {"initial": 0.1, "max": 0.5}},
             **yaml.safe_load(NO_SAVED_MODEL)}
# "the size of the LoRA weights and their optimizer state, give or take the manifest" (issue 37)
NEW_BYTES_RATIO = 1.1


@pytest.fixture(autouse=True)
def _keras_hub():
    pytest.importorskip("keras_hub", reason="KerasHub is not installed: pip install --no-deps "
                                            "keras-hub regex tokenizers (jobs/lora/job.yaml)")


def _job(tmp_path, backend: str) -> str:
    shutil.copy(os.path.join(JOB_DIR, "lora_job.py"), tmp_path)
    with open(os.path.join(JOB_DIR, "job.yaml"), encoding="utf-8") as f:
        job = yaml.safe_load(f)
    job.update(OVERRIDES, backend=backend)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return str(path)


def trainable_and_optimizer_bytes(job: str, backend: str) -> dict:
    """What LoRA changes from one checkpoint to the next, from the job's own model (built in a
    process of its own, on ``backend``): the trainable variables, and the optimizer's
    variables built over them (Adam: two slots each, its iteration count and rate)."""
    code = f"""
import json, sys
sys.path.insert(0, {os.path.dirname(job)!r})
import keras, yaml
import lora_job
job = yaml.safe_load(open({job!r}))
model = lora_job.build_model(**job["model"]["args"])
model.compile(optimizer=keras.optimizers.get(job["compile"]["optimizer"]),
              loss=job["compile"]["loss"])
model.optimizer.build(model.trainable_variables)
size = lambda vs: sum(int(keras.ops.convert_to_numpy(v).nbytes) for v in vs)
print(json.dumps({{"trainable": size(model.trainable_variables),
                  "optimizer": size(model.optimizer.variables),
                  "all": size(model.weights)}}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, KERAS_BACKEND=backend))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_lora_job_resumes_bit_identical_and_checkpoints_what_lora_trains(backend, tmp_path):
    job = _job(tmp_path, backend)
    # The reference first: on JAX, building the backbone compiles each of its initialisers
    # (35 s of a first attempt beside the suite), and three processes doing it at once did it
    # three times; after it, the killed run and the sizes' process find them in the session's
    # compile cache (conftest), side by side (the kills are by step, not time).
    ref_events = finished_run(start_run(job, tmp_path / "ref"), tmp_path / "ref")
    run = start_run(job, tmp_path / "run", KILLS)
    sizes = trainable_and_optimizer_bytes(job, backend)
    events = finished_run(run, tmp_path / "run")

    assert len([e for e in events if e["event"] == "fault_injected"]) == 2
    ready = [e for e in events if e["event"] == "worker_ready"]
    assert len(ready) == 3 and all(r["backend"] == backend for r in ready)
    assert [(r["resumed_from_epoch"], r["resumed_from_batch"]) for r in ready] == [
        (0, 0), (0, 5), (1, 1)]  # both mid-epoch
    assert not [e for e in events if e["event"] == "resume_not_exact"]
    done, ref_done = only_event(events, "run_completed"), only_event(ref_events, "run_completed")
    assert done["weights_sha256"] == ref_done["weights_sha256"]
    assert done["state_sha256"] == ref_done["state_sha256"]
    # LoRA froze the backbone: what trains is a small part of the model
    assert sizes["trainable"] * 10 < sizes["all"], sizes

    manifest = CheckpointStore(str(tmp_path / "ref" / "checkpoints")).latest_valid().manifest
    if "format" not in manifest:
        pytest.skip("checkpoints are today's format (one state.npz with every array, no "
                    "manifest 'format'): each holds the frozen backbone again, so the size of "
                    "a checkpoint after the first is not what LoRA changed")
    durable = [e for e in ref_events if e["event"] == "checkpoint_durable"]
    assert len(durable) >= 2 and "bytes_uploaded" in durable[1], durable[:2]
    changed = sizes["trainable"] + sizes["optimizer"]
    # give or take the manifest (its variables' description and the history: tens of KB)
    new_bytes = durable[1]["bytes_uploaded"] - durable[1]["manifest_bytes"]
    assert new_bytes <= NEW_BYTES_RATIO * changed, (durable[1], sizes)

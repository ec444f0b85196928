"""On both backends: a job whose functions are defined in a script's ``__main__`` (as in a notebook
cell), carried to the worker by value, its worker SIGKILLed once mid-run, the run completing;
the same script run again (a new process: a recycled VM running the cell again) finds the same
code and the completed run; the script with a changed function is refused."""
import os
import stat
import subprocess
import sys
import time

import pytest

from helpers import JAX_THEN_TF_IN_SOAK, ROOT
from orchestrator.core.journal import Journal

pytestmark = pytest.mark.e2e

SCRIPT = '''
import sys

import orchestrator

N = 480  # a tiny slice of digits: 15 steps an epoch


def load_data():
    import numpy as np
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images.astype("float32") / 16.0)[..., None][:N + 120]
    y = d.target.astype("int32")[:N + 120]
    return {"train": (x[:N], y[:N]), "validation": (x[N:], y[N:])}


def build_model():
    import keras

    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                             keras.layers.Dense(UNITS, activation="relu"),
                             keras.layers.Dense(10, activation="softmax")])


if __name__ == "__main__":
    sys.exit(orchestrator.run(
        model=build_model, data=load_data, name="cell", epochs=2, batch_size=32,
        run_dir=sys.argv[1], faults=sys.argv[2:], strategy="cpu", seed=3, deterministic=True,
        compile={"optimizer": "adam", "loss": "sparse_categorical_crossentropy",
                 "metrics": ("accuracy",)},
        checkpoint={"every_epochs": 1, "every_steps": 5, "background": False},
        heartbeat_interval=0.1,
        export={"saved_model": False},  # helpers.NO_SAVED_MODEL
        standby="off"))
'''


def _script(tmp_path, units=16):
    p = tmp_path / "cell_job.py"
    p.write_text(SCRIPT.replace("UNITS", str(units)))
    return p


def _run(script, run_dir, *faults):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(script), str(run_dir), *faults], cwd=script.parent,
                       env=env, capture_output=True, text=True, timeout=180)
    return p.returncode, p.stdout + p.stderr


@JAX_THEN_TF_IN_SOAK
def test_a_cell_job_survives_a_killed_worker_and_the_same_cell_resumes_it(tmp_path, backend):
    # backend: auto in the cell, resolved through KERAS_BACKEND (the backend fixture)
    script, run = _script(tmp_path), tmp_path / "run"
    t0 = time.time()
    rc, out = _run(script, run, "kill@step=8")
    took = time.time() - t0
    assert rc == 0, out
    events = Journal(str(run / "events.jsonl")).events()
    ended = [e for e in events if e["event"] == "attempt_ended"]
    assert [(e["signal"], e["kind"]) for e in ended] == [("SIGKILL", "killed"), (None, None)]
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2]
    ready = [e for e in events if e["event"] == "worker_ready"]
    assert {e["backend"] for e in ready} == {backend}
    assert ready[1]["resumed_from_step"] == 5  # the second worker resumed, mid-epoch
    assert "the job's functions (build_model, load_data) are carried in" in out
    code, job = run / "code.pkl", run / "job.yaml"
    assert stat.S_IMODE(code.stat().st_mode) == 0o600 and stat.S_IMODE(job.stat().st_mode) == 0o600
    assert "model: __cell__:build_model" in job.read_text()
    assert (run / "export" / "model.keras").exists()
    print(f"cell job on {backend} with one SIGKILL: {took:.1f} s")

    # the same cell again, in a new process: the same code, so the run is this run
    rc, out = _run(script, run)
    assert rc == 0, out
    assert "IncompatibleResume" not in out

    # a changed function is another training: refused, naming the code, unless forced
    rc, out = _run(_script(tmp_path, units=24), run)
    assert rc != 0 and "IncompatibleResume" in out and "code changed" in out, out

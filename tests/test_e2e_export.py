"""Export on JAX where TensorFlow cannot be imported (a Colab TPU VM has none): the run's model
as ``model.keras`` and its weights, and ``export.json`` saying why there is no SavedModel, from
the last worker and from the exporter process alike."""
import json
import os
import shutil
import subprocess
import sys

import pytest

import noimport
from helpers import ROOT, unlisted_in_run_dir
from orchestrator.core.journal import Journal

pytestmark = pytest.mark.e2e


def _digits_job(tmp_path) -> str:
    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), tmp_path)
    text = open(os.path.join(ROOT, "jobs", "digits", "job.yaml")).read()
    for was, now in (("epochs: 10", "epochs: 1"), ("strategy: auto", "strategy: cpu"),
                     ("run_dir: runs/digits", f"run_dir: {tmp_path / 'run'}")):
        assert was in text
        text = text.replace(was, now)
    job = tmp_path / "job.yaml"
    job.write_text(text + "backend: jax\n")
    return str(job)


def test_without_tensorflow_the_export_is_keras_and_weights_and_export_json_says_why(tmp_path):
    env = noimport.env_without(tmp_path / "site", "tensorflow")
    env["KERAS_BACKEND"] = "jax"
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "orchestrator", "run", _digits_job(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    events = Journal(str(run / "events.jsonl")).events()
    assert [e.get("source") for e in events if e["event"] == "exported"] == ["worker"]
    final_sha = next(e["weights_sha256"] for e in events if e["event"] == "run_completed")
    again = tmp_path / "again"  # the exporter process, as `orchestrator export` starts it
    p = subprocess.run([sys.executable, "-m", "orchestrator", "export", str(run), "--out",
                        str(again)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "-> " + str(again) + ": model.keras, model.weights.h5\n" in p.stdout, p.stdout
    for exp in (run / "export", again):
        facts = json.loads((exp / "export.json").read_text())
        assert (facts["backend"], facts["weights_sha256"]) == ("jax", final_sha)
        assert "cannot be imported in the exporter process" in facts["saved_model"]
        assert "No module named 'tensorflow'" in facts["saved_model"]
        assert sorted(os.listdir(exp)) == ["export.json", "model.keras", "model.weights.h5"]
    assert "tensorflow" in noimport.attempted(tmp_path / "site")  # it was tried, and refused
    assert unlisted_in_run_dir(run) == []  # a real completed run holds what the README lists

    # what was written is the run's model: the same predictions from both files (in this
    # process, which may be on either backend)
    import keras
    import numpy as np

    sys.path.insert(0, str(tmp_path))
    import digits_job as job

    x = job.load_data()["validation"][0][:13]
    whole = keras.saving.load_model(str(again / "model.keras"))
    weights_only = job.build_model()
    weights_only.load_weights(str(again / "model.weights.h5"))
    np.testing.assert_allclose(weights_only.predict(x, verbose=0), whole.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
    first = keras.saving.load_model(str(run / "export" / "model.keras"))
    for a, b in zip(first.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # the worker's export and the exporter's

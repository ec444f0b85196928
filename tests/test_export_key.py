"""The job's ``export`` key: what the end of a run writes for inference. A SavedModel from a JAX
run costs a TensorFlow import in the worker; a gigabyte model is written once per format."""
import json
import os
import sys

import pytest

from helpers import fake_env, fake_worker_cmd
from orchestrator.checkpoint.store import Checkpoint
from orchestrator.core.spec import ExportSpec, SpecError
from orchestrator.core.specload import load
from orchestrator.train import backends, export, state

JOB = "name: d\nmodel: a:b\ndata: a:c\nepochs: 1\nbatch_size: 1\n"


def test_everything_is_exported_at_the_end_by_default_and_false_means_no_export(write_job):
    assert load(write_job(JOB)).export == ExportSpec(at_end=True, saved_model=True)
    assert load(write_job(JOB + "export: false\n")).export == ExportSpec(at_end=False)
    assert load(write_job(JOB + "export: true\n")).export == ExportSpec()
    s = load(write_job(JOB + "export: {saved_model: false}\n"))
    assert s.export == ExportSpec(at_end=True, saved_model=False)
    assert s.training_hash() == load(write_job(JOB)).training_hash()  # not the model's


@pytest.mark.parametrize("value, key, expected", [
    ("3", "export", "expected true, false or a mapping {at_end: BOOL, saved_model: BOOL}"),
    ("{saved_model: maybe}", "export.saved_model", "expected true or false"),
    ("{formats: [keras]}", "export.formats", "unknown key; expected one of: at_end, saved_model"),
])
def test_a_wrong_export_value_names_the_file_the_key_and_what_was_expected(write_job, value,
                                                                           key, expected):
    path = write_job(JOB + f"export: {value}\n")
    with pytest.raises(SpecError) as e:
        load(path)
    assert e.value.key == key and expected in str(e.value) and path in str(e.value)


def _never_asked(self):
    """Fails the test: on JAX the question imports TensorFlow."""
    raise AssertionError("asked for a SavedModel the job turned off")


def test_without_a_saved_model_the_backend_is_not_asked_and_export_json_says_why(
        write_job, tmp_path, monkeypatch):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    final = Checkpoint(4, str(tmp_path / "ckpt-4"),
                       {"epoch": 1, "weights_sha256": state.fingerprint(model)})
    monkeypatch.setattr(type(backends.current()), "can_export_saved_model", _never_asked)
    spec = load(write_job(JOB + "export: {saved_model: false}\n"))
    facts = export.write(model, spec, final, str(tmp_path / "export"))
    assert facts["saved_model"] == "the job's export.saved_model is false"
    assert sorted(os.listdir(tmp_path / "export")) == ["export.json", "model.keras",
                                                       "model.weights.h5"]
    assert json.loads((tmp_path / "export" / "export.json").read_text())["step"] == 4
    with pytest.raises(AssertionError, match="turned off"):  # the default asks
        export.write(model, load(write_job(JOB)), final, str(tmp_path / "again"))


@pytest.mark.integration
@pytest.mark.parametrize("extra, exported", [("", True), ("export: false", False)])
def test_the_supervisor_runs_the_exporter_at_the_end_unless_the_job_says_false(
        fake_job, tmp_path, extra, exported):
    from orchestrator.supervise.compose import Commands
    from orchestrator.supervise.supervisor import Supervisor

    marker = tmp_path / "exporter-ran"
    exporter = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    sup = Supervisor(load(fake_job(epochs=2, extra=extra)),
                     commands=Commands(fake_worker_cmd, None, lambda spec: exporter),
                     out=open(os.devnull, "w"), env=fake_env({}))
    assert sup.run() == 0
    assert marker.exists() is exported
    events = [json.loads(line) for line in open(sup.rd.journal)]
    assert any(e["event"] == "run_completed" for e in events)
    assert any(e["event"] == "exported" for e in events) is exported


# In a JAX process that blocks TensorFlow's import and records every attempt (tests/noimport.py)
_SAVE_ON_JAX = """
import json, sys
import keras
from orchestrator.checkpoint.store import Checkpoint
from orchestrator.core.specload import load
from orchestrator.train import backends, export, state

backends.for_name("jax")
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
model.compile(optimizer="adam", loss="mse")
final = Checkpoint(4, "ckpt-4", {"epoch": 1, "weights_sha256": state.fingerprint(model)})
facts = export.write(model, load(sys.argv[1]), final, sys.argv[2])
print(json.dumps(sorted(facts["files"])))
"""


@pytest.mark.integration
def test_a_jax_export_without_a_saved_model_never_tries_to_import_tensorflow(write_job,
                                                                              tmp_path):
    """Keras's .keras writer asks whether TensorFlow imports (``tf.available``): asked in a JAX
    process it imported TensorFlow, 1.7 s and half the worker's peak memory at a run's end."""
    import subprocess

    import noimport

    env = noimport.env_without(tmp_path / "site", "tensorflow")
    env["KERAS_BACKEND"] = "jax"
    job = write_job(JOB + "export: {saved_model: false}\n")
    p = subprocess.run([sys.executable, "-c", _SAVE_ON_JAX, job, str(tmp_path / "export")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout.splitlines()[-1]) == ["model.keras", "model.weights.h5"]
    assert noimport.attempted(tmp_path / "site") == []

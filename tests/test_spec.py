import os

import pytest

from orchestrator.core import spec as spec_mod
from orchestrator.cli import main as cli_main
from orchestrator.core.spec import SpecError
from orchestrator.core.specload import load

VALID = """
name: demo
model: my_job:build_model
data:
  factory: my_job:load_data
  args: {synthetic: true}
compile:
  optimizer: adam
  loss: sparse_categorical_crossentropy
  metrics: [accuracy]
epochs: 3
batch_size: 16
strategy: cpu
seed: 7
checkpoint: {every_epochs: 2, keep: 4}
restarts: {max: 5, backoff: {initial: 0.5, max: 10, multiplier: 3}}
"""


def test_valid_job_loads_every_key(write_job, tmp_path):
    s = load(write_job(VALID), run_dir=str(tmp_path / "r"))
    assert (s.name, s.epochs, s.batch_size, s.strategy, s.seed) == ("demo", 3, 16, "cpu", 7)
    assert s.model.target == "my_job:build_model" and s.data.args == {"synthetic": True}
    assert s.compile.metrics == ("accuracy",)
    assert (s.checkpoint.every_epochs, s.checkpoint.keep) == (2, 4)
    assert (s.restarts.max, s.restarts.backoff_initial, s.restarts.backoff_multiplier) == (5, 0.5, 3)
    assert s.run_dir == str(tmp_path / "r")
    assert s.job_dir == str(tmp_path)


def test_defaults_and_relative_run_dir(write_job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = load(write_job("name: d\nmodel: a:b\ndata: a:c\nepochs: 1\nbatch_size: 1\n"))
    assert s.run_dir == os.path.join(str(tmp_path), "runs", "d")
    assert s.strategy == "auto" and s.restarts.max == 3 and s.checkpoint.every_epochs == 1


@pytest.mark.parametrize("text, line, key, expected", [
    (VALID.replace("seed: 7", "seed: 7\nepoch: 3"), 15, "epoch", "unknown key"),
    (VALID.replace("epochs: 3", "epochs: ten"), 11, "epochs", "expected an integer >= 1, got 'ten'"),
    (VALID.replace("epochs: 3", "epochs: 0"), 11, "epochs", "expected an integer >= 1"),
    (VALID.replace("strategy: cpu", "strategy: tpuv4"), 13, "strategy", "expected one of auto, tpu"),
    (VALID.replace("keep: 4", "keep: -1"), 15, "checkpoint.keep", "expected an integer >= 1"),
    (VALID.replace("max: 10", "max: soon"), 16, "restarts.backoff.max", "expected a number"),
    (VALID.replace("model: my_job:build_model", "model: my_job.build_model"), 3, "model",
     "expected 'module:function'"),
    (VALID.replace("args: {synthetic: true}", "args: [1]"), 6, "data.args", "expected a mapping"),
    (VALID.replace("loss: sparse_categorical_crossentropy", "loss: [mse]"), 9, "compile.loss",
     "expected a loss name"),
    (VALID.replace("metrics: [accuracy]", "metrics: accuracy"), 10, "compile.metrics",
     "expected a list"),
])
def test_errors_name_file_line_key_and_expectation(write_job, text, line, key, expected):
    path = write_job(text)
    with pytest.raises(SpecError) as e:
        load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{line}: key '{key}'"), msg
    assert expected in msg


def test_a_compile_section_may_leave_the_loss_to_the_model(write_job):
    """A VAE's train_step computes its own loss: compile: {optimizer: adam} is all it needs."""
    spec = load(write_job(VALID.replace("  loss: sparse_categorical_crossentropy\n", "")))
    assert spec.compile.loss is None and spec.compile.optimizer


def test_missing_required_key(write_job):
    path = write_job("name: d\nmodel: a:b\ndata: a:c\nbatch_size: 1\n")
    with pytest.raises(SpecError, match=r"key 'epochs': required key is missing"):
        load(path)


def test_invalid_yaml_gives_line(write_job):
    path = write_job("name: d\nmodel: [a:b\n")
    with pytest.raises(SpecError, match=rf"^{path}:\d+: invalid YAML"):
        load(path)


def test_python_tags_are_refused_not_executed(write_job, tmp_path):
    marker = tmp_path / "pwned"
    path = write_job(f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(SpecError, match="invalid YAML"):
        load(path)
    assert not marker.exists()


def test_empty_and_missing_file(write_job, tmp_path):
    with pytest.raises(SpecError, match="empty"):
        load(write_job(""))
    with pytest.raises(SpecError, match="cannot read the job file"):
        load(str(tmp_path / "nope.yaml"))


def test_cli_reports_spec_error_without_traceback(write_job, capsys):
    path = write_job(VALID.replace("epochs: 3", "epochs: -2"))
    assert cli_main(["run", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}:11: key 'epochs'" in err and "Traceback" not in err


def test_training_hash_ignores_epochs_but_not_model(write_job):
    a = load(write_job(VALID, "a.yaml"))
    b = load(write_job(VALID.replace("epochs: 3", "epochs: 30"), "b.yaml"))
    c = load(write_job(VALID.replace("batch_size: 16", "batch_size: 32"), "c.yaml"))
    assert a.training_hash() == b.training_hash() != c.training_hash()


def test_spec_module_never_uses_unsafe_yaml_load():
    from orchestrator.core import specload

    src = open(spec_mod.__file__).read() + open(specload.__file__).read()
    assert "yaml.load(" not in src and "SafeLoader" in src


EXACT = VALID + """deterministic: true
learning_rate: {schedule: cosine, initial: 0.1, warmup_epochs: 2, minimum: 0.001}
callbacks:
  - early_stopping: {monitor: val_loss, patience: 3}
  - terminate_on_nan
  - my_job:make_logger
  - {factory: my_job:make_other, args: {every: 2}}
"""


def test_exact_resume_keys_load(write_job):
    s = load(write_job(EXACT.replace("{every_epochs: 2, keep: 4}",
                                     "{every_epochs: 2, keep: 4, every_steps: 50, "
                                     "every_seconds: 30}")))
    assert s.deterministic is True
    assert (s.checkpoint.every_steps, s.checkpoint.every_seconds) == (50, 30.0)
    assert s.learning_rate.schedule == "cosine"
    assert s.learning_rate.params == {"initial": 0.1, "minimum": 0.001, "warmup_epochs": 2}
    assert [(c.name, c.args) for c in s.callbacks[:2]] == [
        ("early_stopping", {"monitor": "val_loss", "patience": 3}), ("terminate_on_nan", {})]
    assert s.callbacks[2].factory.target == "my_job:make_logger"
    assert s.callbacks[3].factory.args == {"every": 2}
    fn = load(write_job(VALID + "learning_rate: my_job:rate\n", "f.yaml")).learning_rate
    assert (fn.schedule, fn.function.target) == ("function", "my_job:rate")
    pw = load(write_job(VALID + "learning_rate: {schedule: piecewise, boundaries: [2, 5], "
                        "values: [0.1, 0.01, 0.001]}\n", "p.yaml")).learning_rate
    assert pw.params == {"boundaries": [2, 5], "values": [0.1, 0.01, 0.001]}
    assert load(write_job(VALID, "v.yaml")).deterministic is False


def test_exact_resume_keys_change_the_training_hash(write_job):
    a = load(write_job(VALID, "a.yaml"))
    b = load(write_job(VALID + "deterministic: true\n", "b.yaml"))
    c = load(write_job(VALID + "learning_rate: my_job:rate\n", "c.yaml"))
    assert len({a.training_hash(), b.training_hash(), c.training_hash()}) == 3


@pytest.mark.parametrize("extra, line, key, expected", [
    ("deterministic: yes please", 17, "deterministic", "expected true or false"),
    ("learning_rate: {schedule: linear}", 17, "learning_rate.schedule",
     "expected one of step_decay, cosine, piecewise"),
    ("learning_rate: {schedule: step_decay, every: 0}", 17, "learning_rate.every",
     "expected an integer >= 1"),
    ("learning_rate: {schedule: step_decay, boundaries: [1]}", 17, "learning_rate.boundaries",
     "unknown key"),
    ("learning_rate: {schedule: piecewise, boundaries: [3, 2], values: [1, 2, 3]}", 17,
     "learning_rate.boundaries", "expected a rising list"),
    ("learning_rate: {schedule: piecewise, boundaries: [2], values: [0.1]}", 17,
     "learning_rate.values", "expected 2 learning rates"),
    ("learning_rate: my_job.rate", 17, "learning_rate", "expected 'module:function'"),
    ("learning_rate: 0.1", 17, "learning_rate", "expected a schedule mapping"),
    ("callbacks: early_stopping", 17, "callbacks", "expected a list"),
    ("callbacks: [{early_stoping: {}}]", 17, "callbacks[0]", "expected one of early_stopping"),
    ("callbacks: [{early_stopping: 3}]", 17, "callbacks[0]",
     "early_stopping: expected a mapping of keyword"),
    ("callbacks: [my_job.make]", 17, "callbacks[0]", "expected 'module:function'"),
    ("checkpoint2: 1", 17, "checkpoint2", "unknown key"),
])
def test_exact_resume_key_errors(write_job, extra, line, key, expected):
    path = write_job(VALID + extra + "\n")
    with pytest.raises(SpecError) as e:
        load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{line}: key '{key}'"), msg
    assert expected in msg


def test_checkpoint_every_steps_must_be_positive(write_job):
    with pytest.raises(SpecError, match=r"key 'checkpoint.every_steps': expected an integer >= 1"):
        load(write_job(VALID.replace("keep: 4}", "keep: 4, every_steps: 0}")))


TIERS = VALID.replace("checkpoint: {every_epochs: 2, keep: 4}", """checkpoint:
  keep: 2
  keep_every_epochs: 5
  keep_best: {metric: val_accuracy, mode: max}
  local_dir: ~/fast/ckpt
  remount: colab
  flush_timeout: 30
  upload_backoff: {initial: 0.5, max: 8}
  durable_cache: writeback
  durable_max_bytes: 5000000000
  writeback: {quiet_s: 12, bytes_per_s: 20000000, margin: 3}""")


def test_checkpoint_tiers_and_retention_keys(write_job, tmp_path):
    s = load(write_job(TIERS), run_dir=str(tmp_path / "r"))
    c = s.checkpoint
    assert c.local_dir == os.path.expanduser("~/fast/ckpt") and c.remount == "colab"
    assert (c.flush_timeout, c.upload_backoff_initial, c.upload_backoff_max) == (30, 0.5, 8)
    r = c.retention
    assert (r.keep, r.every_epochs, r.best_metric, r.best_mode) == (2, 5, "val_accuracy", "max")
    assert (c.durable_cache, c.durable_max_bytes) == ("writeback", 5_000_000_000)
    assert (c.writeback_quiet_s, c.writeback_bytes_per_s, c.writeback_margin) == (12, 2e7, 3)


def test_default_local_tier_is_per_run_and_stable(write_job, tmp_path):
    import tempfile

    a = load(write_job(VALID), run_dir=str(tmp_path / "r1")).checkpoint.local_dir
    assert a == load(write_job(VALID), run_dir=str(tmp_path / "r1")).checkpoint.local_dir
    assert a != load(write_job(VALID), run_dir=str(tmp_path / "r2")).checkpoint.local_dir
    assert a.startswith(os.path.join(tempfile.gettempdir(), "orchestrator", "demo-"))


@pytest.mark.parametrize("old, new, key, expected", [
    ("mode: max", "mode: biggest", "checkpoint.keep_best.mode", "expected one of min, max"),
    ("{metric: val_accuracy, mode: max}", "val_accuracy", "checkpoint.keep_best",
     "expected a mapping"),
    ("remount: colab", "remount: drive", "checkpoint.remount", "expected 'colab' or 'module:"),
    ("keep_every_epochs: 5", "keep_every_epochs: 0", "checkpoint.keep_every_epochs",
     "expected an integer >= 1"),
    ("local_dir: ~/fast/ckpt", "local_dir: RUN/checkpoints", "checkpoint.local_dir",
     "the durable tier"),
    ("flush_timeout: 30", "flush_timeout: later", "checkpoint.flush_timeout", "expected a number"),
    ("durable_cache: writeback", "durable_cache: lazy", "checkpoint.durable_cache",
     "expected one of auto, writeback, none"),
    ("durable_max_bytes: 5000000000", "durable_max_bytes: 0", "checkpoint.durable_max_bytes",
     "expected an integer >= 1"),
    ("margin: 3}", "margin: 0.5}", "checkpoint.writeback.margin", "expected a number >= 1"),
    ("margin: 3}", "margin: 3, delay: 1}", "checkpoint.writeback.delay", "unknown key"),
])
def test_checkpoint_key_errors(write_job, tmp_path, old, new, key, expected):
    path = write_job(TIERS.replace(old, new.replace("RUN", str(tmp_path / "r"))))
    with pytest.raises(SpecError) as e:
        load(path, run_dir=str(tmp_path / "r"))
    assert f"key '{key}'" in str(e.value) and expected in str(e.value), str(e.value)
    assert str(e.value).startswith(f"{path}:")


@pytest.mark.parametrize("url", ["gs://ckpt/runs/a", "s3://ckpt/runs/a"])
def test_checkpoint_durable_may_be_a_bucket(write_job, tmp_path, url):
    path = write_job(TIERS.replace("remount: colab", f"remount: colab\n  durable: {url}"))
    c = load(path, run_dir=str(tmp_path / "r")).checkpoint
    assert c.durable == url


@pytest.mark.parametrize("url, expected", [
    ("az://ckpt/a", "expected gs://bucket/prefix or s3://bucket/prefix, got 'az://ckpt/a'"),
    ("/mnt/ckpt", "expected gs://bucket/prefix or s3://bucket/prefix"),
    ("gs://", "expected gs://bucket/prefix"),
    ("gs://ckpt/a", "needs no_such_gcs_library: pip install 'orchestrator[gcs]'"),
])
def test_checkpoint_durable_errors(write_job, tmp_path, monkeypatch, url, expected):
    """An unknown scheme, or a bucket whose library is not installed: the file, the key and
    the command that installs it."""
    monkeypatch.setitem(spec_mod.OBJECT_STORES, "gs", ("no_such_gcs_library", "gcs"))
    path = write_job(TIERS.replace("remount: colab", f"remount: colab\n  durable: {url}"))
    with pytest.raises(SpecError) as e:
        load(path, run_dir=str(tmp_path / "r"))
    assert str(e.value).startswith(f"{path}:") and "key 'checkpoint.durable'" in str(e.value)
    assert expected in str(e.value), str(e.value)


def test_every_mistake_of_a_job_file_is_reported_at_once(write_job, capsys):
    from orchestrator.core import specload

    path = write_job("""\
        name: j
        model: m:build
        data: m:data
        epochs: -2
        batch_size: 32
        strategy: quantum
        restarts: {max: lots}
        hang_timout: 30
        """)
    with pytest.raises(SpecError) as e:
        load(path)
    lines = str(e.value).splitlines()
    assert lines[0] == f"4 problems in {path}:"
    assert lines[1:] == [
        f"{path}:4: key 'epochs': expected an integer >= 1, got -2",
        f"{path}:6: key 'strategy': expected one of auto, tpu, gpu, cpu, got 'quantum'",
        f"{path}:7: key 'restarts.max': expected an integer >= 0, got 'lots'",
        f"{path}:8: key 'hang_timout': unknown key; expected one of: " + ", ".join(
            sorted(specload.TOP_KEYS)),
    ]  # in the file's order
    assert (e.value.line, e.value.key) == (4, "epochs") and len(e.value.errors) == 4
    assert cli_main(["run", path]) == 2
    err = capsys.readouterr().err
    assert "4 problems" in err and "key 'restarts.max'" in err and "key 'hang_timout'" in err


def test_a_field_missing_from_the_job_file_takes_its_dataclass_default(write_job):
    import dataclasses

    from orchestrator.core.spec import CheckpointSpec, JobSpec, RecoverySpec, RestartSpec

    spec = load(write_job("""\
        name: j
        model: m:build
        data: m:data
        epochs: 1
        batch_size: 8
        restarts: {}
        recovery: {}
        checkpoint: {}
        """))
    assert spec.restarts == RestartSpec() and spec.recovery == RecoverySpec()
    assert dataclasses.replace(spec.checkpoint, local_dir="") == CheckpointSpec()
    for f in dataclasses.fields(JobSpec):
        if f.default is not dataclasses.MISSING and f.name not in ("run_dir", "job_path", "checkpoint",
                                                                   "backend"):
            assert getattr(spec, f.name) == f.default, f.name
    # the backend's default, auto, is resolved as the job loads: a run never says "auto"
    assert JobSpec.__dataclass_fields__["backend"].default == "auto"
    assert spec.backend in ("tensorflow", "jax")


@pytest.mark.parametrize("value, mode", [("off", "off"), ("'off'", "off"), ("auto", "auto"),
                                         ("import_only", "import_only"), ("on", "on"),
                                         ("'on'", "on")])
def test_standby_modes_load_and_a_bare_off_is_the_word_not_false(write_job, value, mode):
    assert load(write_job(VALID + f"standby: {value}\n")).standby == mode


def test_standby_mode_errors_name_the_key_and_the_modes(write_job):
    path = write_job(VALID + "standby: 2\n")
    with pytest.raises(SpecError) as e:
        load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:17: key 'standby'"), msg
    assert "expected one of auto, on, off, import_only, got 2" in msg


def _resolve(requested, env, tmp_path, have=("tensorflow", "jax")):
    from orchestrator.core import backends

    return backends.resolve(requested, env=env, home=str(tmp_path),
                            is_installed=lambda name: name in have)


def test_backend_auto_follows_keras_env_then_keras_json_then_tensorflow(tmp_path):
    assert _resolve("auto", {"KERAS_BACKEND": "jax"}, tmp_path)[0] == "jax"
    assert _resolve("auto", {}, tmp_path)[0] == "tensorflow"
    (tmp_path / ".keras").mkdir()
    (tmp_path / ".keras" / "keras.json").write_text('{"backend": "jax", "floatx": "float32"}')
    backend, why = _resolve("auto", {}, tmp_path)
    assert backend == "jax" and "keras.json" in why
    assert _resolve("auto", {"KERAS_BACKEND": "tensorflow"}, tmp_path)[0] == "tensorflow"
    assert _resolve("tensorflow", {"KERAS_BACKEND": "jax"}, tmp_path)[0] == "tensorflow"


def test_backend_auto_takes_the_installed_one_on_a_tpu_vm_without_tensorflow(tmp_path):
    backend, why = _resolve("auto", {}, tmp_path, have=("jax",))
    assert backend == "jax" and "not installed" in why
    # torch is Keras's choice there: we train on the other two only
    assert _resolve("auto", {"KERAS_BACKEND": "torch"}, tmp_path, have=("jax",))[0] == "jax"
    # neither installed: Keras's default, and the worker names the extra
    assert _resolve("auto", {}, tmp_path, have=())[0] == "tensorflow"


_MINIMAL = "name: b\nmodel: m:f\ndata: m:g\nepochs: 1\nbatch_size: 8\n"


def test_the_backend_is_in_the_training_hash_unless_tensorflow(write_job):
    job = write_job(_MINIMAL)
    tf_spec = load(job, backend="tensorflow")
    jax_spec = load(job, backend="jax")
    assert "backend" not in tf_spec.training_relevant()  # a TensorFlow run keeps its old hash
    assert jax_spec.training_relevant()["backend"] == "jax"
    assert tf_spec.training_hash() != jax_spec.training_hash()


def test_an_unknown_backend_names_the_key_and_the_choices(write_job):
    job = write_job(_MINIMAL + "backend: torch\n")
    with pytest.raises(SpecError) as e:
        load(job)
    assert "key 'backend'" in str(e.value) and "auto, tensorflow, jax" in str(e.value)


THREE_MISTAKES = """\
name: j
model: m:build
data: m:data
epochs: ten
batch_size: 32
strategy: quantum
hang_timout: 30
"""


def test_the_schema_and_the_doctor_both_name_the_three_mistakes_of_a_job_file(
        write_job, capsys, monkeypatch):
    """What an editor checking against `orchestrator schema` sees, the doctor says with the
    file:line of each mistake."""
    import json

    import jsonschema
    import yaml

    from orchestrator.ops import doctor

    assert cli_main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(schema)
    path = write_job(THREE_MISTAKES)

    found = jsonschema.Draft202012Validator(schema).iter_errors(yaml.safe_load(THREE_MISTAKES))
    where = sorted((".".join(map(str, e.absolute_path)), e.message) for e in found)
    assert [key for key, _ in where] == ["", "epochs", "strategy"], where
    assert "'hang_timout' was unexpected" in where[0][1]
    monkeypatch.setattr(doctor, "check_runtime", lambda *a, **kw: [])  # the job's check only
    job = next(c for c in doctor.run(path, run_probe=False) if c.name == "job")
    assert job.level == doctor.FAIL
    assert f"{path}:4: key 'epochs': expected an integer >= 1, got 'ten'" in job.detail
    assert f"{path}:6: key 'strategy': expected one of auto, tpu, gpu, cpu" in job.detail
    assert f"{path}:7: key 'hang_timout': unknown key" in job.detail


def test_the_schema_describes_every_key_with_its_default(capsys):
    import json

    assert cli_main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    restarts = schema["$defs"]["Restarts"]["properties"]
    assert restarts["max"]["default"] == 3 and restarts["max"]["minimum"] == 0
    assert restarts["max"]["description"]
    checkpoint = schema["$defs"]["Checkpoint"]["properties"]
    assert checkpoint["durable_cache"]["enum"] == ["auto", "writeback", "none"]
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == {"name", "model", "data", "epochs", "batch_size"}


@pytest.mark.parametrize("value, ok", [("gs://bucket/runs", True), ("s3://b/p", True),
                                       ("https://b/p", False), ("gs://", False), ("3", False)])
def test_a_durable_url_is_gs_or_s3(write_job, value, ok):
    path = write_job(VALID.replace("checkpoint: {every_epochs: 2, keep: 4}",
                                   f"checkpoint: {{durable: '{value}', durable_cache: writeback}}"))
    if ok:
        c = load(path).checkpoint
        assert (c.durable, c.durable_cache) == (value, "writeback")
    else:
        with pytest.raises(SpecError, match=r":15: key 'checkpoint.durable': expected gs://bucket/prefix or s3://bucket/prefix"):
            load(path)

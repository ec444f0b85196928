"""Job mistakes named by their key, with real Keras (train/jobcode.py): a factory's TypeError,
compile identifiers Keras does not know, a model and data whose shapes do not fit.

Keras is imported by the tests, not at collection: other tests check that pytest's own process
stays free of TensorFlow.
"""
import textwrap

import pytest

from orchestrator.core.specload import load

pytestmark = pytest.mark.e2e
jobcode = None

# A job module: a dense model over 4 features, data with 4 or 6 features, factories that take
# arguments (or break).
JOB_MODULE = """
import numpy as np


def build_model(width=8, classes=3):
    import keras
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(classes, activation="softmax")])


def load_data(features=4, examples=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, features)).astype("float32")
    return {"train": (x, (x.sum(axis=1) > 0).astype("int32"))}


def broken_data():
    return len(5)


def tf_data():  # what a tf.data job meets on a TPU VM, where TensorFlow is not installed
    raise ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow")
"""


@pytest.fixture(autouse=True)
def _keras():
    global jobcode
    pytest.importorskip("keras")
    from orchestrator.train import jobcode


@pytest.fixture
def job(tmp_path, write_job):
    """A job file over JOB_MODULE; keyword arguments replace its top-level keys (YAML text)."""
    (tmp_path / "toy_job.py").write_text(JOB_MODULE)

    def make(**keys):
        base = {"name": "toy", "model": "toy_job:build_model", "data": "toy_job:load_data",
                "compile": "{optimizer: adam, loss: sparse_categorical_crossentropy, "
                           "metrics: [accuracy]}",
                "epochs": "1", "batch_size": "4"}
        base.update(keys)
        return load(write_job("".join(f"{k}: {v}\n" for k, v in base.items())))

    return make


def _build(spec):
    import tensorflow as tf

    return jobcode.build_model(spec, tf.distribute.get_strategy(), jobcode.load_data(spec))


def test_a_factory_called_with_args_it_does_not_take_names_the_key_and_the_args(job):
    spec = job(model="{factory: toy_job:build_model, args: {depth: 3}}")
    with pytest.raises(jobcode.JobError) as e:
        _build(spec)
    msg = str(e.value)
    assert e.value.key == "model"
    assert "job.yaml: key 'model'" in msg and "toy_job:build_model(depth=3)" in msg
    assert "build_model(width=8, classes=3)" in msg  # its signature
    assert "unexpected keyword argument 'depth'" in msg


def test_a_type_error_raised_inside_a_factory_names_the_key_and_the_args(job):
    spec = job(data="{factory: toy_job:broken_data, args: {}}")
    with pytest.raises(jobcode.JobError) as e:
        jobcode.load_data(spec)
    assert e.value.key == "data"
    assert "key 'data': toy_job:broken_data() raised TypeError" in str(e.value)
    assert "has no len()" in str(e.value)


@pytest.mark.parametrize("compile_, key, wanted", [
    ("{optimizer: adamm, loss: sparse_categorical_crossentropy}", "compile.optimizer", "adam"),
    ("{optimizer: adam, loss: sparse_categorical_crossentropie}", "compile.loss",
     "sparse_categorical_crossentropy"),
    ("{optimizer: adam, loss: mse, metrics: [accuracy, mean_absolut_error]}",
     "compile.metrics[1]", "mean_absolute_error"),
])
def test_an_identifier_keras_does_not_know_is_named_with_its_key_and_what_keras_accepts(
        job, compile_, key, wanted):
    spec = job(compile=compile_)
    with pytest.raises(jobcode.JobError) as e:
        jobcode.check_compile(spec)
    msg = str(e.value)
    assert e.value.key == key and f"key '{key}': Keras does not accept" in msg
    assert f"did you mean '{wanted}'" in msg
    accepted = msg.split("Keras accepts ")[1]
    assert wanted in accepted and accepted.count(",") >= 5  # the list, not one name
    with pytest.raises(jobcode.JobError, match=key.replace("[", r"\[")):
        _build(spec)  # the worker's build checks them before the first step


def test_identifiers_keras_accepts_pass_in_every_form(job):
    for compile_ in ("{optimizer: Adam, loss: SparseCategoricalCrossentropy, metrics: [acc]}",
                     "{optimizer: {class_name: sgd, config: {learning_rate: 0.1}}, "
                     "loss: ce, metrics: [accuracy, sparse_top_k_categorical_accuracy]}"):
        jobcode.check_compile(job(compile=compile_))
    with pytest.raises(jobcode.JobError) as e:  # a mapping whose config Keras refuses
        jobcode.check_compile(job(compile="{optimizer: {class_name: adam, config: {lr: 0.1}}, "
                                          "loss: mse}"))
    assert e.value.key == "compile.optimizer" and "lr" in str(e.value)


def test_a_model_and_data_that_do_not_fit_name_both_keys(job):
    spec = job(data="{factory: toy_job:load_data, args: {features: 6}}")
    with pytest.raises(jobcode.JobError) as e:
        _build(spec)
    msg = str(e.value)
    assert e.value.key == "model, data"
    assert "keys 'model' and 'data' do not fit" in msg and "(None, 4)" in msg
    assert "x (2, 6)" in msg and "first step" in msg
    # labels that do not fit the loss: the loss of the first step says so
    spec = job(compile="{optimizer: adam, loss: categorical_crossentropy}")
    with pytest.raises(jobcode.JobError, match="keys 'model' and 'data' do not fit.*rank"):
        _build(spec)


def test_a_model_that_fits_its_data_builds_with_every_variable_a_checkpoint_holds(job):
    model = _build(job())
    assert model.built and model.optimizer.built
    assert [v.path for v in model.metrics_variables] == [
        "loss/total", "loss/count", "accuracy/total", "accuracy/count"]
    assert all(float(v.numpy()) == 0 for v in model.metrics_variables)  # not moved


def test_an_error_that_is_not_a_mismatch_keeps_its_own_class(job, tmp_path):
    (tmp_path / "odd_job.py").write_text(textwrap.dedent("""
        import keras

        class Odd(keras.Model):
            def call(self, x):
                raise ValueError("the weather is wrong")

        def build_model():
            return Odd()
    """))
    with pytest.raises(ValueError, match="the weather is wrong") as e:
        _build(job(model="odd_job:build_model"))
    assert not isinstance(e.value, jobcode.JobError)


def test_a_module_that_does_not_compile_is_named_with_its_key(job, tmp_path):
    (tmp_path / "typo_job.py").write_text("def build_model(:\n    pass\n")
    with pytest.raises(jobcode.JobError) as e:
        jobcode.factories(job(model="typo_job:build_model"))
    assert e.value.key == "model" and "typo_job.py:1" in str(e.value)


def test_a_job_that_imports_tensorflow_on_jax_without_it_is_told_before_training(job):
    spec = job(data="toy_job:tf_data", backend="jax")
    with pytest.raises(jobcode.JobError) as e:
        jobcode.load_data(spec)
    assert e.value.key == "data"
    assert "toy_job:tf_data() failed: No module named 'tensorflow'" in str(e.value)
    assert "trains on JAX" in str(e.value) and "give NumPy arrays" in str(e.value)
    # on TensorFlow the same error is TensorFlow's own missing install: not the job's
    with pytest.raises(ModuleNotFoundError):
        jobcode.load_data(job(data="toy_job:tf_data", backend="tensorflow"))


ANYMODEL = ("gan_job", "vae_job", "wgan_job", "closs_job")


def _fixture_job(job, tmp_path, module, **keys):
    """A job over one of tests/fixtures/anymodel's modules (the e2e test's jobs)."""
    import shutil

    from helpers import ROOT

    for name in (module + ".py", "anymodel_data.py"):
        shutil.copy(f"{ROOT}/tests/fixtures/anymodel/{name}", tmp_path)
    return job(model=f"{module}:build_model", data=f"{module}:load_data", **keys)


@pytest.mark.parametrize("module", ANYMODEL)
def test_the_first_step_check_never_refuses_a_model_fit_trains(job, tmp_path, module):
    """A train_step of the model's own, its own compile(d_optimizer, g_optimizer, loss_fn) with
    no compile section, no compiled loss, optimizers as attributes, x-only data, dict inputs
    and sample weights: the check builds what fit builds and refuses none of them."""
    import dataclasses

    spec = _fixture_job(job, tmp_path, module)
    if module != "closs_job":
        spec = dataclasses.replace(spec, compile=None)  # the factory compiles
    model = _build(spec)
    assert model.variables and model.optimizer.built
    if module in ("gan_job", "wgan_job"):
        assert not model.built  # no call(): fit builds nothing either, its train_step runs
        assert not model.d_optimizer.built  # at its first step, as under fit
    assert all(float(v.numpy()) == 0 for v in model.metrics_variables)


def test_a_compile_section_the_model_s_own_compile_does_not_take_is_named(job, tmp_path):
    with pytest.raises(jobcode.JobError) as e:
        _build(_fixture_job(job, tmp_path, "gan_job"))
    assert e.value.key == "compile"
    msg = str(e.value)
    assert "(d_optimizer, g_optimizer, loss_fn)" in msg and "drop the 'compile' section" in msg


def test_keras_s_train_step_with_no_loss_at_all_is_named_by_compile_loss(job):
    with pytest.raises(jobcode.JobError) as e:
        _build(job(compile="{optimizer: adam}"))
    assert e.value.key == "compile.loss" and "has no loss" in str(e.value)


def test_a_train_step_of_the_model_s_own_is_never_refused_for_what_x_is(job, tmp_path, capsys):
    """The model's call takes a dict its train_step makes from the batch: the check cannot
    build it from x, says so, and leaves it to the step (TensorFlow's fit builds nothing
    before the step either)."""
    (tmp_path / "picky_job.py").write_text(textwrap.dedent("""
        import keras

        class Picky(keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(3, activation="softmax")

            def call(self, inputs):
                return self.dense(inputs["features"])

            def train_step(self, data):
                x, y = data
                return super().train_step(({"features": x}, y))

        def build_model():
            return Picky()
    """))
    model = _build(job(model="picky_job:build_model"))
    assert not model.built
    assert "is not built before its first step" in capsys.readouterr().out

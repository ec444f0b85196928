"""What holds a model's training state (train/holders.py) and the checkpoint built from it
(train/state.py), with real Keras in this process and no training: every optimizer, seed
generator and metric a model holds is a named group, a restore builds an optimizer that a
custom train_step builds only at its first step, and a checkpoint of a different model is
refused naming the group that is missing or extra.

Keras is imported by the tests, not at collection (other tests check that pytest's own process
stays free of TensorFlow until then)."""
import os
import random
import sys

import numpy as np
import pytest

from helpers import ROOT

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "anymodel")
keras = holders = state = None


@pytest.fixture(scope="module", autouse=True)
def _keras_imported():
    """Keras imported once for the module, before the fast tier's per-test guard against
    processes: the first import of TensorFlow asks ``uname -p`` (``platform.uname()``, cached
    after), which is not a process any test here starts. On the backend the suite's tests get
    (conftest's ``backend`` fixture)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERAS_BACKEND", "tensorflow")
        pytest.importorskip("keras")


@pytest.fixture(autouse=True)
def _keras(monkeypatch):
    global keras, holders, state
    keras = pytest.importorskip("keras")
    from orchestrator.train import holders, state

    monkeypatch.syspath_prepend(FIXTURES)


def _gan():
    import gan_job

    keras.utils.set_random_seed(1)
    return gan_job.build_model()


def _step(optimizer, variables, seed):
    """One optimizer step with made-up gradients, eagerly: what a train_step's apply does to
    an optimizer (built at its first apply), without tracing a training function."""
    rng = np.random.default_rng(seed)
    grads = [rng.normal(size=v.shape).astype("float32") for v in variables]
    optimizer.apply_gradients(zip(grads, variables))


def _trained_gan():
    gan = _gan()
    gan.optimizer.build(gan.trainable_variables)  # what the worker does (fit would, too)
    _step(gan.d_optimizer, gan.discriminator.trainable_weights, 1)
    _step(gan.g_optimizer, gan.generator.trainable_weights, 2)
    _step(gan.d_optimizer, gan.discriminator.trainable_weights, 3)
    gan.seed_generator.next()
    return gan


def test_every_optimizer_of_a_gan_is_a_group_named_by_its_attribute():
    gan = _gan()
    found = holders.discover(gan)
    assert [(g.name, g.kind, g.where, g.cls) for g in found.groups] == [
        ("model", "model", "model.variables", "GAN"),
        ("optimizer", "optimizer", "model.optimizer", "RMSprop"),  # super().compile()'s
        ("optimizer@d_optimizer", "optimizer", "model.d_optimizer", "Adam"),
        ("optimizer@g_optimizer", "optimizer", "model.g_optimizer", "Adam"),
        # compile()'s loss tracker, which the model's metrics property leaves out: fit never
        # resets it (Keras's own train_step would update it), so it is state of its own
        ("metric@_loss_tracker", "metric", "model._loss_tracker", "Mean"),
    ]
    # the seed generator is an attribute Keras tracks: its state is a model variable
    assert any(v is gan.seed_generator.state for v in found.groups[0].variables)
    assert found.outside == []


def test_state_keras_does_not_track_is_found_and_what_no_checkpoint_holds_is_named():
    gan = _gan()
    object.__setattr__(gan, "noise", keras.random.SeedGenerator(3))  # past Keras's tracking
    object.__setattr__(gan, "extra", [keras.metrics.Mean(name="steps_seen")])
    gan.generator.rng = np.random.default_rng(0)
    gan.discriminator.coin = random.Random(1)
    found = holders.discover(gan)
    names = [g.name for g in found.groups]
    assert "seed@noise" in names and "metric@extra[0]" in names
    assert "optimizer@loss_fn" not in names  # a loss is no holder
    assert sorted(o.split(":")[0] for o in found.outside) == [
        "model.discriminator.coin (random Random)", "model.generator.rng (numpy Generator)"]


def test_a_python_number_the_job_s_model_changes_is_seen():
    gan = _gan()
    before = holders.user_scalars(gan)
    assert before == {f"{gan.name}.latent_dim": 8}  # Keras's own attributes are not counted
    gan.steps_taken = 0
    gan.steps_taken += 5
    assert holders.user_scalars(gan)[f"{gan.name}.steps_taken"] == 5


def test_a_checkpoint_builds_the_optimizers_a_train_step_builds_late_then_restores_exactly():
    gan = _trained_gan()
    arrays, layout = state.capture(gan), state.layout(gan)
    assert layout["optimizer@d_optimizer"]["built_over"] == [
        i for i, v in enumerate(gan.variables)
        if any(v is w for w in gan.discriminator.trainable_weights)]
    fresh = _gan()
    fresh.optimizer.build(fresh.trainable_variables)
    assert not fresh.d_optimizer.built
    n = state.restore(fresh, arrays, layout)
    assert n == len(arrays) and fresh.d_optimizer.built and fresh.g_optimizer.built
    assert state.state_fingerprint(fresh) == state.state_fingerprint(gan)
    assert int(fresh.d_optimizer.iterations.numpy()) == 2
    # the next step from the restored state is the next step from the original one
    _step(gan.d_optimizer, gan.discriminator.trainable_weights, 4)
    _step(fresh.d_optimizer, fresh.discriminator.trainable_weights, 4)
    assert state.state_fingerprint(fresh) == state.state_fingerprint(gan)


def test_a_checkpoint_without_an_optimizer_s_group_is_refused_naming_it():
    """The break check: a checkpoint that leaves one optimizer out is not restored as if it
    held everything (the Adam moments of the generator would start from zero, silently)."""
    gan = _trained_gan()
    arrays, layout = state.capture(gan), state.layout(gan)
    partial = {k: a for k, a in arrays.items() if not k.startswith("optimizer@g_optimizer.")}
    with pytest.raises(state.StateMismatch) as e:
        state.restore(_gan(), partial, layout)
    msg = str(e.value)
    assert "the job's model has optimizer@g_optimizer (Adam at model.g_optimizer)" in msg
    assert "which the checkpoint does not hold" in msg


def test_a_checkpoint_of_a_model_with_more_holders_is_refused_naming_what_is_missing():
    gan = _trained_gan()
    object.__setattr__(gan, "noise", keras.random.SeedGenerator(3))
    arrays, layout = state.capture(gan), state.layout(gan)
    fresh = _gan()
    with pytest.raises(state.StateMismatch) as e:
        state.restore(fresh, arrays, layout)
    assert ("the checkpoint holds seed@noise (SeedGenerator at model.noise, 1 variables), "
            "which the job's model does not have") in str(e.value)
    assert not fresh.d_optimizer.built  # refused before anything was built or assigned


def test_an_unbuilt_optimizer_with_no_record_of_its_variables_is_refused():
    gan = _trained_gan()
    arrays = state.capture(gan)
    fresh = _gan()
    fresh.optimizer.build(fresh.trainable_variables)  # as the worker does before a restore
    with pytest.raises(state.StateMismatch, match=r"optimizer model.d_optimizer \(Adam\) is "
                                                  r"not built yet .*built_over"):
        state.restore(fresh, arrays)  # an old manifest: no 'holders'


def test_a_classic_model_keeps_the_keys_its_checkpoints_always_had():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.1), keras.layers.Dense(2)])
    m.compile(optimizer="adam", loss="mse")
    m.optimizer.build(m.trainable_variables)
    keys = state.capture(m)
    assert {state.group_of(k) for k in keys} == {"model", "optimizer"}
    assert state.group_of("metrics.0001") is None and state.group_of("callbacks.00.0001") is None
    assert state.group_of("optimizer@gen.opt.0003") == "optimizer@gen.opt"

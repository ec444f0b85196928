"""Worker-side state with real Keras, in process: learning rate through a wrapped optimizer, and
the callbacks' state saved as JSON + arrays and put back after Keras resets it.

Keras is imported by the tests, not at collection: other tests check that pytest's own process
stays free of TensorFlow.
"""
import json
import time

import numpy as np
import pytest

pytestmark = pytest.mark.e2e
keras = state = CallbackStates = LearningRateCallback = get_learning_rate = None


@pytest.fixture(autouse=True)
def _keras():
    global keras, state, CallbackStates, LearningRateCallback, get_learning_rate
    keras = pytest.importorskip("keras")
    from orchestrator.train import state
    from orchestrator.train.callbacks import CallbackStates, LearningRateCallback, get_learning_rate

X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
Y = (X.sum(axis=1) > 0).astype("int32")


def _model():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    m.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
              loss="sparse_categorical_crossentropy")
    m(X[:2])
    m.optimizer.build(m.trainable_variables)
    return m


def _rates_recorder():
    class Rates(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.rates = {}

        def on_epoch_begin(self, epoch, logs=None):
            self.rates[epoch] = get_learning_rate(self.model.optimizer)

    return Rates()


def _halve(epoch, lr):
    return lr * 0.5 if epoch else lr


def test_schedule_sets_the_rate_of_a_wrapped_optimizer_and_survives_a_resume():
    m, rec = _model(), _rates_recorder()
    m.fit(X, Y, epochs=4, verbose=0, shuffle=False,
          callbacks=[LearningRateCallback(_halve), rec])
    assert rec.rates == pytest.approx({0: 0.1, 1: 0.05, 2: 0.025, 3: 0.0125})
    inner = m.optimizer.inner_optimizer  # the rate reached the optimizer that applies it
    assert float(keras.ops.convert_to_numpy(inner.learning_rate)) == pytest.approx(0.0125)

    # stopped after 2 epochs, restored into a new model: the same rates for epochs 2 and 3
    a = _model()
    a.fit(X, Y, epochs=2, verbose=0, shuffle=False, callbacks=[LearningRateCallback(_halve)])
    b, rec_b = _model(), _rates_recorder()
    state.restore(b, state.capture(a))
    b.fit(X, Y, epochs=4, initial_epoch=2, verbose=0, shuffle=False,
          callbacks=[LearningRateCallback(_halve), rec_b])
    assert rec_b.rates == {k: rec.rates[k] for k in (2, 3)}
    # resumed in the middle of epoch 3: the restored rate stands, the rule is not applied twice
    c, rec_c = _model(), _rates_recorder()
    state.restore(c, state.capture(a))
    c.fit(X, Y, epochs=2, initial_epoch=1, verbose=0, shuffle=False,
          callbacks=[LearningRateCallback(_halve, skip_epoch=1), rec_c])
    assert rec_c.rates == {1: rec.rates[1]}
    assert state.fingerprint(b) == state.fingerprint(m)


def test_callback_state_round_trips_as_json_and_arrays_without_pickle(tmp_path):
    m = _model()
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=50, restore_best_weights=True)
    rop = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, min_delta=10.0)
    m.fit(X, Y, epochs=3, verbose=0, shuffle=False, callbacks=[es, rop])
    assert es.best_weights is not None and rop.wait == 0 and rop.cooldown_counter == 0
    states, arrays = CallbackStates([es, rop]).capture()
    np.savez(tmp_path / "s.npz", **arrays)
    blob = json.dumps(states)

    es2 = keras.callbacks.EarlyStopping(monitor="loss", patience=50, restore_best_weights=True)
    rop2 = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, min_delta=10.0)
    for cb in (es2, rop2):
        cb.set_model(m)
        cb.on_train_begin()  # what Keras does at the start of every fit
    with np.load(tmp_path / "s.npz", allow_pickle=False) as z:
        CallbackStates([es2, rop2]).apply(json.loads(blob), {k: z[k] for k in z.files})
    for a in ("wait", "stopped_epoch", "best", "best_epoch"):
        assert getattr(es2, a) == getattr(es, a), a
    assert [np.array_equal(x, y) for x, y in zip(es2.best_weights, es.best_weights)] == [True] * 2
    assert (rop2.wait, rop2.cooldown_counter, rop2.best) == (rop.wait, rop.cooldown_counter,
                                                           rop.best)


def test_a_callback_without_state_protocol_is_named():
    class Mine(keras.callbacks.Callback):
        pass

    class WithState(keras.callbacks.Callback):
        def get_state(self):
            return {"n": 1}

        def set_state(self, s):
            self.n = s["n"]

    cbs = [Mine(), WithState(), keras.callbacks.TerminateOnNaN()]
    assert CallbackStates(cbs).unknown() == ["Mine"]
    states, _ = CallbackStates(cbs).capture()
    assert [s["state"] for s in states] == [None, {"n": 1}, None]


class _Clock:
    """A monotonic clock that moves 0.1 s per training batch (timing without sleeping)."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    @staticmethod
    def perf_counter():  # the stall is still measured for real
        return time.perf_counter()


@pytest.mark.parametrize("background", [True, False])
def test_checkpoints_every_n_seconds_within_epochs_and_once_at_the_end(tmp_path, monkeypatch,
                                                                        background):
    from orchestrator.train import callbacks as cbm
    from orchestrator.checkpoint.store import CheckpointStore
    from orchestrator.core.heartbeat import Position
    from orchestrator.core.spec import CheckpointSpec

    clock = _Clock()
    monkeypatch.setattr(cbm, "time", clock)

    class Tick(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            clock.now += 0.1

    m, progress, store = _model(), Position(), CheckpointStore(str(tmp_path / "ck"))
    ckpt = CheckpointSpec(every_epochs=5, keep=100, every_seconds=0.25, background=background)
    # a writer that is never busy when the next one falls due: the steps are the schedule's
    ckpt_cb = cbm.CheckpointCallback(store, ckpt, progress, steps_per_epoch=8, last_epoch=2,
                                     history=[], base_manifest={}, states=CallbackStates([]))

    class Settle(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ckpt_cb.writer.drain()

    training = cbm.OneTraining([Tick(), cbm.ProgressCallback(progress), ckpt_cb, Settle()])
    m.fit(X, Y, batch_size=4, epochs=2, verbose=0, shuffle=False, callbacks=[training])
    assert store.list() and all(c.manifest["epoch"] < 2 for c in store.list())
    training.finish()
    got = [(c.step, c.manifest["epoch"], c.manifest["batch"]) for c in store.list()]
    # every 3rd batch (0.3 s >= 0.25 s), never at an epoch's last batch, then the final one
    assert got == [(3, 0, 3), (6, 0, 6), (9, 1, 1), (12, 1, 4), (15, 1, 7), (16, 2, 0)]
    final = store.list()[-1].manifest
    assert final["stopped_early"] is False and [h["epoch"] for h in final["history"]] == [1, 2]
    assert final["state_sha256"] == state.state_fingerprint(m)
    mid = state.load_arrays(store.list()[0].path)
    assert any(k.startswith("metrics.") for k in mid)  # the epoch's running metrics


def _noisy_model():
    """Unseeded keras.random draws in a layer: Keras's global seed generator holds their state."""

    class Noisy(keras.layers.Layer):
        def call(self, x, training=False):
            return x + (keras.random.normal(keras.ops.shape(x)) if training else 0)

    keras.utils.set_random_seed(3)
    m = keras.Sequential([keras.Input((4,)), Noisy(), keras.layers.Dense(2)])
    m.compile(optimizer="adam", loss="mse")
    m.optimizer.build(m.trainable_variables)
    return m


def test_the_global_seed_generator_of_unseeded_draws_is_in_the_checkpoint():
    """On TensorFlow unseeded keras.random calls draw from a global SeedGenerator: a resumed
    process creates it and restores its state, so the next draws are the uninterrupted run's
    (without its group in the checkpoint the weights differ: checked when written)."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    if keras.backend.backend() != "tensorflow":
        pytest.skip("JAX refuses unseeded draws in a traced step")
    y = np.stack([X.sum(1), X[:, 0]], axis=1)
    a = _noisy_model()
    a.fit(X, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    arrays, layout = state.capture(a), state.layout(a)
    assert "seed@global" in {state.group_of(k) for k in arrays}
    a.fit(X, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)  # a new process
    b = _noisy_model()
    state.restore(b, arrays, layout)
    b.fit(X, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    assert state.fingerprint(a) == state.fingerprint(b)


def test_a_checkpoint_names_the_state_it_cannot_hold(tmp_path):
    """A NumPy generator on the model and a Python counter its train_step moves: the manifest
    says both (the worker journals them as resume_not_exact when it resumes from it)."""
    from orchestrator.train import callbacks as cbm
    from orchestrator.checkpoint.store import CheckpointStore
    from orchestrator.core.heartbeat import Position
    from orchestrator.core.spec import CheckpointSpec

    class Counting(keras.Model):
        def train_step(self, data):
            self.steps_taken += 1  # run eagerly: once a step
            return super().train_step(data)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    m = Counting(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
    m.steps_taken = 0
    m.rng = np.random.default_rng(0)
    m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", run_eagerly=True)
    progress, store = Position(), CheckpointStore(str(tmp_path / "ck"))
    ckpt_cb = cbm.CheckpointCallback(store, CheckpointSpec(every_epochs=1, keep=5,
                                                           background=False),
                                     progress, steps_per_epoch=4, last_epoch=1, history=[],
                                     base_manifest={}, states=CallbackStates([]))
    training = cbm.OneTraining([cbm.ProgressCallback(progress), ckpt_cb])
    m.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[training])
    training.finish()
    outside = store.list()[-1].manifest["outside_state"]
    assert len(outside) == 2, outside
    assert outside[0].startswith("model.rng (numpy Generator): a random generator outside Keras")
    assert outside[1].startswith(f"{m.name}.steps_taken (a Python number on the model, 0 when "
                                 f"training began, 4 now)")


def test_a_sigterm_during_a_skipped_periodic_checkpoint_still_saves_the_step_it_stops_at(
        tmp_path):
    """Seen beside two busy loops: the periodic checkpoint of step 30 was skipped (the write of
    23 still in flight) and the notice came meanwhile; the worker stopped saying step 23, and
    the 7 steps since were lost. The step it stops at is the one it saves."""
    from orchestrator.train import callbacks as cbm
    from orchestrator.checkpoint.store import CheckpointStore
    from orchestrator.core.heartbeat import Position
    from orchestrator.core.spec import CheckpointSpec
    from orchestrator.train.preemption import Preempted, PreemptionNotice

    m, progress, store = _model(), Position(), CheckpointStore(str(tmp_path / "ck"))
    notice = PreemptionNotice()  # not installed: the test sets the time it was received
    ckpt_cb = cbm.CheckpointCallback(store, CheckpointSpec(every_epochs=1, every_steps=2, keep=9,
                                                           background=True),
                                     progress, steps_per_epoch=8, last_epoch=2, history=[],
                                     base_manifest={}, states=CallbackStates([]), notice=notice)
    admit = ckpt_cb.writer.admit

    def admit_then_notice(step, reason):
        if step == 4 and reason == "periodic":  # skipped busy, and SIGTERM arrives meanwhile
            notice.received_at = time.time()
            return None
        return admit(step, reason)

    ckpt_cb.writer.admit = admit_then_notice
    training = cbm.OneTraining([cbm.ProgressCallback(progress), ckpt_cb])
    with pytest.raises(Preempted) as stopped:
        m.fit(X, Y, batch_size=4, epochs=2, verbose=0, shuffle=False, callbacks=[training])
    assert stopped.value.step == 4
    assert [c.step for c in store.list()] == [2, 4]
    assert store.list()[-1].manifest["batch"] == 4


def test_a_snapshot_is_a_copy_the_training_leaves_alone_held_in_buffers_the_next_one_reuses():
    m = _model()
    snap = state.Snapshot(m)
    first = snap.take()
    before = {k: a.copy() for k, a in first.items()}
    m.fit(X, Y, batch_size=32, epochs=1, verbose=0)  # one step: the weights and iterations move
    assert all(np.array_equal(first[k], before[k]) for k in first), "a view of the variables"
    second = snap.take()
    assert all(second[k] is first[k] for k in first), "host buffers allocated again"
    now = state.capture(m)
    assert all(np.array_equal(second[k], now[k]) for k in second)
    assert any(not np.array_equal(second[k], before[k]) for k in second)


def test_the_snapshot_warm_up_is_handed_to_the_writer_after_the_first_step_once(tmp_path):
    """Issue 38: the warm-up traced the snapshot's reader in the writer's thread as training
    began, taking the GIL from the first step's own tracing (a cold recovery's first step was
    0.2-0.45 s longer for it). It is handed over once the first step has been told, once."""
    from orchestrator.train import callbacks as cbm
    from orchestrator.checkpoint.store import CheckpointStore
    from orchestrator.core.heartbeat import Position
    from orchestrator.core.spec import CheckpointSpec

    m, progress, order = _model(), Position(), []
    ckpt_cb = cbm.CheckpointCallback(CheckpointStore(str(tmp_path / "ck")),
                                     CheckpointSpec(every_epochs=1, keep=5, background=True),
                                     progress, steps_per_epoch=8, last_epoch=2, history=[],
                                     base_manifest={}, states=CallbackStates([]))
    ckpt_cb.writer.prepare = lambda work: order.append(("warm-up", progress.step))
    training = cbm.OneTraining([cbm.ProgressCallback(
        progress, on_first_step=lambda: order.append(("first step", progress.step))), ckpt_cb])
    m.fit(X, Y, batch_size=4, epochs=2, verbose=0, shuffle=False, callbacks=[training])
    training.finish()
    assert order == [("first step", 1), ("warm-up", 1)]

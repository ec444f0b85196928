"""The baseline: the same job as a plain Keras script, what a user writes without this tool.

It reads the job's YAML only to train exactly the same thing (factories, compile settings,
epochs, batch size, seed, op determinism, the learning-rate schedule as a Keras
``LearningRateScheduler``), then calls ``model.fit`` on the arrays with ``shuffle=True``. With
``--backup-dir`` it adds Keras ``BackupAndRestore`` at the job's checkpoint frequency (each
epoch, or every ``every_steps`` batches), and run again by a shell loop
(``bench/restart_loop.sh``) it is what users do today to survive a preemption. A job setting it
cannot mirror (job callbacks, time-based checkpoints) is refused rather than silently dropped.

Bench instrumentation, kept apart: ``--events FILE`` appends one JSON line at start, after the
TensorFlow import, after the model is built, when training begins (after the backup's restore),
at the first step, about once a second with the epoch and batch reached, at each epoch end, and
at the end with the weights' fingerprint (``orchestrator.checkpoint.store.weights_fingerprint``, the
function the orchestrator's manifests use).

The backend is Keras's own choice (``KERAS_BACKEND``), as for a user's script: the bench runs it
on TensorFlow and on JAX. On JAX it is what a Keras user on JAX writes: no TensorFlow import of
its own and no ``enable_op_determinism`` (TensorFlow's; XLA on the CPU is deterministic), the
same ``keras.utils.set_random_seed`` (which imports TensorFlow where it is installed: a user with
both installed pays that; the orchestrator's JAX worker seeds without it) and
``fit(shuffle=True)``, which on JAX draws each epoch's order from NumPy's global generator. No
persistent compile cache either: a plain script does not set one, so every restart compiles.
The ``tf_imported`` line marks the framework's import (Keras and JAX on JAX), as the
orchestrator's worker journals it.
"""
import argparse
import importlib
import json
import os
import sys
import time


class Events:
    def __init__(self, path):
        self.path = path

    def __call__(self, event, **fields):
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"ts": round(time.time(), 4), "event": event,
                                    "pid": os.getpid(), **fields}) + "\n")


def factory(spec, job_dir):
    """``module:function`` or ``{factory: module:function, args: {...}}`` -> (function, args)."""
    target, args = (spec["factory"], spec.get("args") or {}) if isinstance(spec, dict) else (spec, {})
    module, func = target.split(":")
    sys.path.insert(0, job_dir)
    return getattr(importlib.import_module(module), func), args


def learning_rate_schedule(job_path, base_lr):
    """The job's schedule as the ``(epoch, lr) -> lr`` a LearningRateScheduler takes: the
    orchestrator's own formulas (``orchestrator.train.schedules``), so both arms use the same rates."""
    from orchestrator.train import schedules
    from orchestrator.core.specload import load

    spec = load(job_path)
    if spec.learning_rate is None:
        return None
    if spec.learning_rate.function is not None:
        fn, args = factory({"factory": spec.learning_rate.function.target,
                            "args": spec.learning_rate.function.args}, spec.job_dir)
        return lambda epoch, lr: float(fn(epoch, lr, **args))
    return schedules.build(spec.learning_rate, base_lr, spec.epochs)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("job", help="the job's YAML file")
    p.add_argument("--backup-dir", help="use keras.callbacks.BackupAndRestore in this directory")
    p.add_argument("--events", help="bench instrumentation: append JSON lines to this file")
    p.add_argument("--orbax-dir", help="JAX only: an Orbax CheckpointManager (async) saving "
                                       "the model and optimizer variables at the job's "
                                       "checkpoint frequency, in this directory")
    args = p.parse_args()
    emit = Events(args.events)
    emit("start")

    import yaml

    with open(args.job, encoding="utf-8") as f:
        job = yaml.safe_load(f)
    ckpt = job.get("checkpoint") or {}
    if job.get("callbacks") or ckpt.get("every_seconds"):
        sys.exit(f"{args.job}: 'callbacks' and 'checkpoint.every_seconds' have no plain-Keras "
                 f"twin here; the baseline would train something else")
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf
    else:
        import jax  # noqa: F401  (Keras imports it on JAX; the mark is the framework imported)
    emit("tf_imported", backend=backend)
    keras.utils.set_random_seed(job.get("seed", 0))
    if job.get("deterministic") and backend == "tensorflow":
        tf.config.experimental.enable_op_determinism()
    job_dir = os.path.dirname(os.path.abspath(args.job))
    load_data, data_args = factory(job["data"], job_dir)
    build_model, model_args = factory(job["model"], job_dir)
    data = load_data(**data_args)
    model = build_model(**model_args)
    c = job["compile"]
    model.compile(optimizer=c.get("optimizer", "adam"), loss=c["loss"], metrics=c.get("metrics"))
    emit("model_built")

    x, y = data["train"]
    batch, epochs = job["batch_size"], job["epochs"]
    steps_per_epoch = -(-len(x) // batch)
    callbacks = []
    if args.backup_dir:
        every = ckpt.get("every_epochs", 1)
        freq = ckpt.get("every_steps") or ("epoch" if every == 1 else every * steps_per_epoch)
        callbacks.append(timed_backup(emit)(args.backup_dir, save_freq=freq))
    if args.orbax_dir:
        callbacks.append(make_orbax(emit, args.orbax_dir, ckpt.get("every_steps")
                                    or ckpt.get("every_epochs", 1) * steps_per_epoch))
    schedule = learning_rate_schedule(args.job, float(model.optimizer.learning_rate.numpy()))
    if schedule is not None:
        callbacks.append(keras.callbacks.LearningRateScheduler(schedule))
    if args.events:
        callbacks.append(make_instrument(emit, steps_per_epoch))
    model.fit(x, y, batch_size=batch, epochs=epochs, validation_data=data.get("validation"),
              shuffle=True, callbacks=callbacks, verbose=2)
    emit("train_end")

    from orchestrator.checkpoint.store import weights_fingerprint
    import numpy as np

    emit("end", weights_sha256=weights_fingerprint(np.asarray(w.numpy()) for w in model.weights))


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path)
               for n in names)


def timed_backup(emit):
    """BackupAndRestore whose each save is timed (it blocks the training thread: what it costs
    is its stall) and sized; bench instrumentation, the callback's behaviour unchanged."""
    import keras

    class TimedBackupAndRestore(keras.callbacks.BackupAndRestore):
        def _save_model(self):
            t0 = time.perf_counter()
            super()._save_model()
            emit("checkpoint_saved", ms=round((time.perf_counter() - t0) * 1000, 2),
                 bytes=_dir_bytes(self.backup_dir))

    return TimedBackupAndRestore


def make_orbax(emit, directory, every_steps):
    """Orbax's CheckpointManager, async, saving every variable of the model and its optimizer
    every ``every_steps`` steps: what a JAX user would write (issue 37's anchor). The save
    call's time is its stall (the writing goes on in Orbax's threads); each checkpoint's bytes
    are read from disk once the manager has finished."""
    import keras
    import orbax.checkpoint as ocp

    class OrbaxSave(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.step = 0
            self.manager = ocp.CheckpointManager(
                os.path.abspath(directory), options=ocp.CheckpointManagerOptions(
                    max_to_keep=2, enable_async_checkpointing=True))

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if self.step % every_steps:
                return
            state = {"model": [v.value for v in self.model.variables],
                     "optimizer": [v.value for v in self.model.optimizer.variables]}
            t0 = time.perf_counter()
            self.manager.save(self.step, args=ocp.args.StandardSave(state))
            emit("checkpoint_saved", ms=round((time.perf_counter() - t0) * 1000, 2))

        def on_train_end(self, logs=None):
            self.manager.wait_until_finished()
            for step in self.manager.all_steps():
                emit("checkpoint_sized", step=step, bytes=_dir_bytes(
                    os.path.join(os.path.abspath(directory), str(step))))
            self.manager.close()

    return OrbaxSave()


def make_instrument(emit, steps_per_epoch):
    """A Callback class needs keras, which this script imports late, to time the import."""
    import keras

    class _Instrument(keras.callbacks.Callback):
        """Bench only: when training begins, its first step, progress, epoch ends."""

        def on_train_begin(self, logs=None):
            self.epoch, self.last, self.first = 0, 0.0, True
            emit("train_begin", steps_per_epoch=steps_per_epoch)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if self.first:
                self.first = False
                emit("first_step", epoch=self.epoch)
            now = time.time()
            if now - self.last >= 1.0:
                self.last = now
                emit("progress", epoch=self.epoch, batch=batch + 1)

        def on_epoch_end(self, epoch, logs=None):
            emit("epoch_end", epoch=epoch + 1)

    return _Instrument()


if __name__ == "__main__":
    main()

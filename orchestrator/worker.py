"""One training attempt, in its own process: ``python -m orchestrator.worker``.

Resolve the strategy, build and compile the job's model in its scope, restore the newest valid
checkpoint (weights, optimizer and RNG state), train from the next epoch with the checkpoint and
heartbeat callbacks, and on any exception write an error record before exiting non-zero.
Exit ``EXIT_CONFIG`` says "this will fail the same way again": the supervisor does not retry it.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import threading
import time
import traceback

from .checkpoints import CheckpointStore
from .heartbeat import HeartbeatWriter, Progress
from .journal import Journal
from .osutil import write_json_atomic
from .rundir import EXIT_CONFIG, RunDir
from .spec import JobSpec, SpecError, load



class JobError(Exception):
    """The job's configuration or code is wrong; retrying will not help."""


def _import_tensorflow():
    try:
        import tensorflow as tf  # noqa: F401
        import keras  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name not in ("tensorflow", "keras"):
            raise
        raise JobError(
            f"TensorFlow is not installed for {sys.executable}: install the extra "
            f"`pip install 'orchestrator[cpu]'` (or '[tensorflow]' for GPU); on a Colab TPU "
            f"runtime install the pinned tensorflow-tpu instead, never plain tensorflow") from None


def _call_factory(spec: JobSpec, key: str, **extra):
    factory = getattr(spec, key)
    module_name, func_name = factory.target.split(":")
    if spec.job_dir not in sys.path:
        sys.path.insert(0, spec.job_dir)
    where = f"{spec.job_path}: key '{key}'"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise JobError(f"{where}: cannot import module '{module_name}' "
                       f"(looked in {spec.job_dir} and sys.path): {exc}") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise JobError(f"{where}: module '{module_name}' has no function '{func_name}'")
    return func(**factory.args, **extra)


def _compile(model, spec: JobSpec):
    if spec.compile is not None:
        model.compile(optimizer=spec.compile.optimizer, loss=spec.compile.loss,
                      metrics=list(spec.compile.metrics))
    elif not getattr(model, "compiled", False) or model.optimizer is None:
        raise JobError(f"{spec.job_path}: the model factory returned an uncompiled model and "
                       f"the job has no 'compile' section (give compile: {{optimizer, loss}})")


def _watch_parent(poll: float = 0.5) -> None:
    """Exit when the supervisor that started us dies: an orphan must not keep training."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(poll)
            if os.getppid() != parent:
                print("[worker] supervisor is gone; exiting", file=sys.stderr, flush=True)
                os._exit(EXIT_CONFIG + 1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def train(spec: JobSpec, rd: RunDir, attempt: int, progress, t_start: float) -> dict:
    """The attempt itself; returns a summary. Raises on any failure."""
    import keras
    import tensorflow as tf

    from . import datasets, state
    from .accelerators import resolve_strategy
    from .callbacks import CheckpointCallback, HeartbeatCallback, ProgressCallback

    journal = Journal(rd.journal)
    heart = HeartbeatWriter(rd.root, attempt, spec.heartbeat_interval)
    heart.beat(force=True, phase="starting")
    keras.utils.set_random_seed(spec.seed)

    strategy, described = resolve_strategy(spec.strategy)
    replicas = strategy.num_replicas_in_sync
    global_batch = spec.batch_size * replicas
    is_tpu = isinstance(strategy, tf.distribute.TPUStrategy)

    data = datasets.normalise(_call_factory(spec, "data"), f"{spec.job_path}: key 'data'")
    spe = datasets.steps_per_epoch(data.num_examples, global_batch, drop_remainder=is_tpu)

    with strategy.scope():
        model = _call_factory(spec, "model")
        if not isinstance(model, keras.Model):
            raise JobError(f"{spec.job_path}: key 'model': the factory returned "
                           f"{type(model).__name__}, expected a keras.Model")
        _compile(model, spec)
        if not model.built:
            model(datasets.sample_batch(data, 2))
        model.optimizer.build(model.trainable_variables)

    store = CheckpointStore(rd.checkpoints)
    store.remove_partial()
    skipped = []
    latest = store.latest_valid(on_skip=lambda c, why: skipped.append((c, why)))
    for c, why in skipped:
        journal.append("checkpoint_skipped", source="worker", attempt=attempt, step=c.step,
                       reason=why)
    start_epoch, history = 0, []
    if latest is not None:
        try:
            with strategy.scope():
                state.restore(model, state.load_arrays(latest.path))
        except state.StateMismatch as exc:
            raise JobError(f"cannot resume from {latest.path}: {exc}") from exc
        start_epoch, history = latest.epoch, latest.manifest.get("history", [])
    progress.epoch = start_epoch
    journal.append("worker_ready", source="worker", attempt=attempt, strategy=described,
                   replicas=replicas, global_batch=global_batch, steps_per_epoch=spe,
                   resumed_from_epoch=start_epoch, startup_s=round(time.time() - t_start, 3))
    print(f"[worker] attempt {attempt}: {described}, {replicas} replica(s), global batch "
          f"{global_batch}, resuming at epoch {start_epoch}/{spec.epochs}", flush=True)
    if start_epoch >= spec.epochs:
        return {"epochs": start_epoch, "fingerprint": state.fingerprint(model)}

    train_ds = datasets.train_dataset(data, spec.seed, start_epoch, spec.epochs, global_batch,
                                      drop_remainder=is_tpu)
    val_ds = datasets.validation_dataset(data, global_batch, drop_remainder=is_tpu)
    base_manifest = {"job": spec.name, "training_hash": spec.training_hash(), "attempt": attempt,
                     "global_batch": global_batch, "replicas": replicas}
    callbacks = [
        ProgressCallback(progress, on_first_step=lambda: journal.append(
            "first_step", source="worker", attempt=attempt, since_start_s=round(
                time.time() - t_start, 3))),
        HeartbeatCallback(heart, progress),
        CheckpointCallback(store, spec.checkpoint.every_epochs, spec.epochs,
                           spec.checkpoint.keep, history, base_manifest),
    ]
    model.fit(train_ds, validation_data=val_ds, epochs=spec.epochs, initial_epoch=start_epoch,
              steps_per_epoch=spe, callbacks=callbacks, verbose=2)
    return {"epochs": spec.epochs, "fingerprint": state.fingerprint(model)}


def write_error_record(rd: RunDir, attempt: int, exc: BaseException, progress,
                       fatal: bool) -> None:
    record = {
        "time": round(time.time(), 3),
        "attempt": attempt,
        "pid": os.getpid(),
        "type": type(exc).__name__,
        "qualified_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "fatal": fatal,
        **(progress.as_dict() if progress else {}),
    }
    try:
        write_json_atomic(rd.error_record(attempt), record)
    except OSError as write_exc:  # the run dir itself may be what failed (Drive gone)
        print(f"[worker] could not write the error record: {write_exc}", file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.worker")
    p.add_argument("job")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--attempt", type=int, required=True)
    args = p.parse_args(argv)
    t_start = time.time()
    _watch_parent()
    try:
        spec = load(args.job, run_dir=args.run_dir)
    except SpecError as exc:
        print(f"[worker] {exc}", file=sys.stderr)
        return EXIT_CONFIG
    rd = RunDir(spec.run_dir).make()

    progress = Progress()
    try:
        _import_tensorflow()
        from . import datasets, state

        try:
            summary = train(spec, rd, args.attempt, progress, t_start)
        except (datasets.DataError, state.StateMismatch) as exc:
            raise JobError(str(exc)) from exc
    except JobError as exc:
        write_error_record(rd, args.attempt, exc, progress, fatal=True)
        print(f"[worker] error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except Exception as exc:  # noqa: BLE001 - every failure is recorded for the supervisor
        write_error_record(rd, args.attempt, exc, progress, fatal=False)
        traceback.print_exc()
        return 1
    print(f"[worker] done: {summary['epochs']} epochs, weights sha256 {summary['fingerprint']}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One training attempt, in its own process: ``python -m orchestrator.train.worker``.

Resolve the strategy, build and compile the job's model in its scope, restore the newest valid
checkpoint (weights, optimizer, RNG, metric and callback state), train from the next batch with
the checkpoint and heartbeat callbacks, and on any exception write an error record before
exiting non-zero.
Exit ``EXIT_CONFIG`` says "this will fail the same way again": the supervisor does not retry it.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import sys
import threading
import time
import traceback

from orchestrator.checkpoint import tiers
from orchestrator.recovery.faults import Injector
from orchestrator.core.heartbeat import HeartbeatWriter, Position, register_stack_dump
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import write_json_atomic
from orchestrator.core.rundir import (CPU_DEVICES_ENV, ENV_BATCH_SIZE, ENV_REINIT, ENV_STRATEGY, EXIT_CONFIG,
                     RunDir)
from orchestrator.core.spec import JobSpec, SpecError, load
from orchestrator.core.events import Event


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


def _resolve(spec: JobSpec, factory, key: str):
    """Import ``module:function`` of the job (from its directory); return it with its args."""
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
    return functools.partial(func, **factory.args)


def _call_factory(spec: JobSpec, key: str, **extra):
    return _resolve(spec, getattr(spec, key), key)(**extra)


def _compile(model, spec: JobSpec):
    if spec.compile is not None:
        model.compile(optimizer=spec.compile.optimizer, loss=spec.compile.loss,
                      metrics=list(spec.compile.metrics))
    elif not getattr(model, "compiled", False) or model.optimizer is None:
        raise JobError(f"{spec.job_path}: the model factory returned an uncompiled model and "
                       f"the job has no 'compile' section (give compile: {{optimizer, loss}})")


def _job_callbacks(spec: JobSpec) -> list:
    """The job's own callbacks: built-ins by name, or whatever its factories return."""
    import keras

    builtins = {"early_stopping": keras.callbacks.EarlyStopping,
                "reduce_lr_on_plateau": keras.callbacks.ReduceLROnPlateau,
                "terminate_on_nan": keras.callbacks.TerminateOnNaN}
    out = []
    for i, c in enumerate(spec.callbacks):
        where = f"{spec.job_path}: key 'callbacks[{i}]'"
        try:
            made = (builtins[c.name](**c.args) if c.name else
                    _resolve(spec, c.factory, f"callbacks[{i}]")())
        except TypeError as exc:
            raise JobError(f"{where}: {exc}") from exc
        for cb in made if isinstance(made, (list, tuple)) else [made]:
            if not isinstance(cb, keras.callbacks.Callback):
                raise JobError(f"{where}: expected a keras.callbacks.Callback, got "
                               f"{type(cb).__name__}")
            out.append(cb)
    return out


def _schedule(spec: JobSpec, optimizer):
    """The spec's learning-rate schedule, or None; checks the optimizer's rate can be set."""
    from orchestrator.train import schedules
    from orchestrator.train.callbacks import get_learning_rate

    if spec.learning_rate is None:
        return None
    base = get_learning_rate(optimizer)  # as compiled, before any checkpoint is restored
    try:
        optimizer.learning_rate = base
    except TypeError as exc:  # built with a keras LearningRateSchedule: not settable
        raise JobError(f"{spec.job_path}: key 'learning_rate': the optimizer's rate cannot be "
                       f"set ({exc}); drop the spec's schedule or the optimizer's") from exc
    fn = (_resolve(spec, spec.learning_rate.function, "learning_rate")
          if spec.learning_rate.function else None)
    return schedules.build(spec.learning_rate, base, spec.epochs, fn)


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


def apply_overrides(spec: JobSpec, env=None) -> tuple[JobSpec, bool]:
    """The supervisor's recovery actions for this attempt: strategy, batch, reinitialise."""
    env = os.environ if env is None else env
    changes = {}
    if env.get(ENV_STRATEGY):
        changes["strategy"] = env[ENV_STRATEGY]
    if env.get(ENV_BATCH_SIZE):
        changes["batch_size"] = int(env[ENV_BATCH_SIZE])
    return dataclasses.replace(spec, **changes), env.get(ENV_REINIT) == "1"


def _build_model(spec: JobSpec, strategy, data):
    """Build and compile the job's model in ``strategy``'s scope, with every variable a
    checkpoint holds created now (model, metrics, optimizer), so that it can be restored."""
    import keras

    from orchestrator.train import datasets

    with strategy.scope():
        model = _call_factory(spec, "model")
        if not isinstance(model, keras.Model):
            raise JobError(f"{spec.job_path}: key 'model': the factory returned "
                           f"{type(model).__name__}, expected a keras.Model")
        _compile(model, spec)
        x, y = datasets.sample_batch(data, 2)
        y_pred = model(x, training=False)  # builds the model (no RNG, no statistics moved)
        try:  # and the metrics, whose running state a mid-epoch checkpoint holds
            model.compute_metrics(x, y, y_pred)
            model.reset_metrics()
        except Exception as exc:  # noqa: BLE001 - built at the first step instead
            print(f"[worker] metrics not built before training ({exc}); a mid-epoch resume "
                  f"then restarts the epoch's metrics", flush=True)
        model.optimizer.build(model.trainable_variables)
    return model


def train(spec: JobSpec, rd: RunDir, attempt: int, progress, t_start: float,
          marks: dict | None = None) -> dict:
    """The attempt itself; returns a summary. Raises on any failure.

    ``marks`` collects seconds since ``t_start`` at each start-up phase (``tf_imported``,
    ``model_built``, ``restored``), journaled with ``worker_ready``: where a recovery's time goes.
    """
    marks = {} if marks is None else marks
    from orchestrator.train.accelerators import split_cpu

    split_cpu(os.environ.get(CPU_DEVICES_ENV))  # before TensorFlow initialises its devices
    import keras
    import tensorflow as tf

    from orchestrator.train import datasets

    from orchestrator.train import resume

    from orchestrator.train import state
    from orchestrator.train.accelerators import resolve_strategy
    from orchestrator.train.callbacks import (CallbackStates, CheckpointCallback, FaultCallback, HeartbeatCallback,
                            LearningRateCallback, OneTraining, ProgressCallback, ResumeState)

    journal = Journal(rd.journal)
    heart = HeartbeatWriter(rd.root, attempt, spec.heartbeat_interval)
    heart.beat(force=True, phase="starting")
    keras.utils.set_random_seed(spec.seed)
    if spec.deterministic:
        tf.config.experimental.enable_op_determinism()
    spec, reinitialise = apply_overrides(spec)
    injector = Injector.from_env(rd.root, attempt, journal)

    strategy, described = resolve_strategy(spec.strategy, reinitialise=reinitialise)
    replicas = strategy.num_replicas_in_sync
    global_batch = spec.batch_size * replicas
    is_tpu = isinstance(strategy, tf.distribute.TPUStrategy)

    data = datasets.normalise(_call_factory(spec, "data"), f"{spec.job_path}: key 'data'")
    spe = datasets.steps_per_epoch(data.num_examples, global_batch, drop_remainder=is_tpu)

    model = _build_model(spec, strategy, data)
    with strategy.scope():
        schedule = _schedule(spec, model.optimizer)
    job_callbacks = _job_callbacks(spec)
    states = CallbackStates(job_callbacks)
    marks["model_built"] = round(time.time() - t_start, 3)

    store = injector.wrap_store(tiers.for_spec(spec))  # commits: local tier
    store.remove_partial()
    skipped = []
    latest = store.latest_valid(on_skip=lambda c, why: skipped.append((c, why)))
    for c, why in skipped:
        journal.append(Event.CHECKPOINT_SKIPPED, source="worker", attempt=attempt, step=c.step,
                       path=c.path, reason=why)
    at = resume.plan(latest.manifest if latest else None, global_batch=global_batch,
                     steps_per_epoch=spe, deterministic=spec.deterministic)
    arrays: dict = {}
    restored = None
    if latest is not None:
        arrays = state.load_arrays(latest.path)
        try:
            with strategy.scope():
                state.restore(model, arrays)
        except state.StateMismatch as exc:
            raise JobError(f"cannot resume from {latest.path}: {exc}") from exc
        restored = state.state_fingerprint(model)
        if latest.manifest.get("state_sha256") not in (None, restored):
            at.not_exact.append(f"the restored state (sha256 {restored[:12]}) differs from the "
                                f"checkpoint's ({latest.manifest['state_sha256'][:12]})")
        unknown = states.unknown()
        if unknown:
            at.not_exact.append(f"callback(s) {', '.join(unknown)} have no get_state/set_state: "
                                f"their state starts afresh")
        if at.mid_epoch and getattr(model.optimizer, "use_ema", False):
            at.not_exact.append("the optimizer uses EMA, whose weights Keras swaps in at the end "
                                "of each fit call (finalize_variable_values): the resumed epoch "
                                "ends one call early")
    marks["restored"] = round(time.time() - t_start, 3)
    progress.epoch, progress.batch, progress.step = at.epoch, at.batch, at.step
    journal.append(Event.WORKER_READY, source="worker", attempt=attempt, strategy=described,
                   strategy_kind=described.split()[0].lower(), reinitialised=reinitialise,
                   batch_size=spec.batch_size, replicas=replicas, global_batch=global_batch,
                   steps_per_epoch=spe,
                   resumed_from_epoch=at.epoch, resumed_from_batch=at.batch,
                   resumed_from_step=at.step, deterministic=spec.deterministic,
                   restored_state_sha256=restored,
                   startup_s=round(time.time() - t_start, 3), started_at=round(t_start, 3),
                   phases_s=marks)

    def not_exact(reasons):
        journal.append(Event.RESUME_NOT_EXACT, source="worker", attempt=attempt, step=at.step,
                       reasons=list(reasons))
        for r in reasons:
            print(f"[worker] resume not exact: {r}", flush=True)

    if at.not_exact:
        not_exact(at.not_exact)
    print(f"[worker] attempt {attempt}: {described}, {replicas} replica(s), global batch "
          f"{global_batch}, resuming at epoch {at.epoch}/{spec.epochs} batch {at.batch}/{spe}",
          flush=True)
    if at.stopped_early or at.epoch >= spec.epochs:
        return {"epochs": at.epoch, "fingerprint": state.fingerprint(model)}

    val_ds = datasets.validation_dataset(data, global_batch, drop_remainder=is_tpu)
    base_manifest = {"job": spec.name, "training_hash": spec.training_hash(), "attempt": attempt,
                     "global_batch": global_batch, "replicas": replicas,
                     "steps_per_epoch": spe, "deterministic": spec.deterministic}
    prog_cb = ProgressCallback(progress, on_first_step=lambda: journal.append(
        Event.FIRST_STEP, source="worker", attempt=attempt, since_start_s=round(
            time.time() - t_start, 3)))
    inner = [prog_cb]
    if schedule is not None:
        inner.append(LearningRateCallback(schedule, skip_epoch=at.epoch if at.mid_epoch else None))
    inner += job_callbacks
    inner += [
        ResumeState(states, latest.manifest.get("callbacks") if latest else None, arrays,
                    at.epoch if at.mid_epoch else None,
                    on_metrics_lost=lambda: not_exact([
                        f"the checkpoint has no metric state for epoch {at.epoch + 1}: its "
                        f"reported metrics cover batches {at.batch + 1}.. only"])),
        HeartbeatCallback(heart, progress),
        CheckpointCallback(store, spec.checkpoint, progress, spe, spec.epochs, at.history,
                           base_manifest, states),
    ]
    if injector:
        inner.append(FaultCallback(injector, progress))
    training = OneTraining(inner)
    for begin, end, skip in at.segments(spec.epochs):
        prog_cb.batch_offset = skip
        train_ds = datasets.train_dataset(data, spec.seed, begin, end, global_batch,
                                          drop_remainder=is_tpu, skip_batches=skip)
        model.fit(train_ds, validation_data=val_ds, epochs=end, initial_epoch=begin,
                  steps_per_epoch=spe - skip if skip else spe, callbacks=[training], verbose=2)
        if model.stop_training:
            break
    training.finish()
    if strategy is tf.distribute.get_strategy():  # the default strategy: the plain CPU model
        _export_at_end(spec, rd, store, model, journal, heart, attempt, injector)
    return {"epochs": progress.epoch, "fingerprint": state.fingerprint(model)}


def _export_at_end(spec: JobSpec, rd: RunDir, store, model, journal, heart, attempt,
                   injector) -> None:
    """Export the model just trained when the run is complete, saving the exporter process's
    TensorFlow import and model build (seconds, at the end of every run). Only for a model
    trained on the CPU with no distribution strategy, which is what the exporter process would
    build; otherwise (TPU, GPU, replicas), and when this fails, the supervisor runs the
    exporter process (it sees no export of the final weights)."""
    from orchestrator.train import export

    final = store.latest_valid()
    if final is None or not final.ends_run(spec.epochs):
        return
    injector.at_export()
    t0 = time.time()
    try:
        with heart.beating(phase="exporting", epoch=final.epoch, step=final.step):
            export.write(model, spec, final, rd.export)
    except Exception as exc:  # noqa: BLE001 - the run is done; the supervisor's exporter retries
        print(f"[worker] export failed, the supervisor will retry it in its own process: "
              f"{type(exc).__name__}: {exc}", flush=True)
        journal.append(Event.EXPORT_FAILED, source="worker", attempt=attempt, error=str(exc))
        return
    journal.append(Event.EXPORTED, source="worker", attempt=attempt, path=rd.export,
                   step=final.step, seconds=round(time.time() - t0, 3))


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
    p = argparse.ArgumentParser(prog="python -m orchestrator.train.worker")
    p.add_argument("job")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--attempt", type=int, required=True)
    args = p.parse_args(argv)
    t_start = time.time()
    register_stack_dump()
    _watch_parent()
    try:
        spec = load(args.job, run_dir=args.run_dir)
    except SpecError as exc:
        print(f"[worker] {exc}", file=sys.stderr)
        return EXIT_CONFIG
    rd = RunDir(spec.run_dir).make()

    progress = Position()
    try:
        _import_tensorflow()
        marks = {"tf_imported": round(time.time() - t_start, 3)}
        from orchestrator.train import datasets
        from orchestrator.train import state

        try:
            summary = train(spec, rd, args.attempt, progress, t_start, marks)
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

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
import os
import sys
import threading
import time
import traceback

from orchestrator.checkpoint import tiers
from orchestrator.checkpoint.writer import CheckpointWriter
from orchestrator.train import jobcode
from orchestrator.train.jobcode import JobError
from orchestrator.recovery.faults import Injector
from orchestrator.core.heartbeat import HeartbeatWriter, Position, register_stack_dump
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import write_json_atomic
from orchestrator.core.rundir import (CPU_DEVICES_ENV, ENV_BATCH_SIZE, ENV_REINIT, ENV_STRATEGY, EXIT_CONFIG, EXIT_PREEMPTED,
                     RunDir)
from orchestrator.core.spec import JobSpec, SpecError, load
from orchestrator.core.events import Event
from orchestrator.train.preemption import Preempted, PreemptionNotice


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


def train(spec: JobSpec, rd: RunDir, attempt: int, progress, t_start: float,
          marks: dict | None = None, notice: PreemptionNotice | None = None) -> dict:
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
    notice = notice or PreemptionNotice()
    heart = HeartbeatWriter(rd.control, attempt, spec.heartbeat_interval)
    heart.beat(force=True, phase="starting")
    keras.utils.set_random_seed(spec.seed)
    if spec.deterministic:
        tf.config.experimental.enable_op_determinism()
    spec, reinitialise = apply_overrides(spec)
    injector = Injector.from_env(rd.control, attempt, journal)

    strategy, described = resolve_strategy(spec.strategy, reinitialise=reinitialise)
    replicas = strategy.num_replicas_in_sync
    global_batch = spec.batch_size * replicas
    is_tpu = isinstance(strategy, tf.distribute.TPUStrategy)

    data = jobcode.load_data(spec)
    spe = datasets.steps_per_epoch(data.num_examples, global_batch, drop_remainder=is_tpu)

    model = jobcode.build_model(spec, strategy, data)
    with strategy.scope():
        schedule = jobcode.schedule(spec, model.optimizer)
    job_callbacks = jobcode.job_callbacks(spec)
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
    ckpt_writer = CheckpointWriter(
        background=spec.checkpoint.background,
        journal=lambda event, **f: journal.append(event, source="worker", attempt=attempt, **f))
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
                           base_manifest, states, notice, writer=ckpt_writer),
    ]
    if injector:
        inner.append(FaultCallback(injector, progress))
    training = OneTraining(inner)
    failing = True
    try:
        with notice.training():
            for begin, end, skip in at.segments(spec.epochs):
                prog_cb.batch_offset = skip
                train_ds = datasets.train_dataset(data, spec.seed, begin, end, global_batch,
                                                  drop_remainder=is_tpu, skip_batches=skip)
                model.fit(train_ds, validation_data=val_ds, epochs=end, initial_epoch=begin,
                          steps_per_epoch=spe - skip if skip else spe, callbacks=[training],
                          verbose=2)
                if model.stop_training:
                    break
            training.finish()  # commits the last checkpoint and waits for its write
        failing = False
    finally:  # a failed attempt still finishes the write in flight: work the next one keeps
        ckpt_writer.close(failing=failing)
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


def _journal_preempted(rd: RunDir, attempt: int, exc: Preempted, progress) -> None:
    try:
        Journal(rd.journal).append(Event.PREEMPTED, source="worker", attempt=attempt,
                                   step=exc.step, epoch=progress.epoch, batch=progress.batch,
                                   seconds=round(time.time() - exc.received_at, 3))
    except OSError as write_exc:  # the run dir may be what is going away
        print(f"[worker] could not journal the preemption: {write_exc}", file=sys.stderr)
    print(f"[worker] {exc}", file=sys.stderr, flush=True)


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
    notice = PreemptionNotice().install()
    register_stack_dump()
    _watch_parent()
    try:
        spec = load(args.job, run_dir=args.run_dir)
    except SpecError as exc:
        print(f"[worker] {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except Preempted:
        return EXIT_PREEMPTED
    rd = RunDir.for_spec(spec).make()

    progress = Position()
    try:
        jobcode.import_tensorflow()
        marks = {"tf_imported": round(time.time() - t_start, 3)}
        from orchestrator.train import datasets
        from orchestrator.train import state

        try:
            summary = train(spec, rd, args.attempt, progress, t_start, marks, notice)
        except (datasets.DataError, state.StateMismatch) as exc:
            raise JobError(str(exc)) from exc
    except Preempted as exc:
        _journal_preempted(rd, args.attempt, exc, progress)
        return EXIT_PREEMPTED
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

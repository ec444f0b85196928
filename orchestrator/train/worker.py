"""One training attempt, in its own process: ``python -m orchestrator.train.worker``.

Resolve the strategy, build and compile the job's model in its scope, restore the newest valid
checkpoint (weights, optimizer, RNG, metric and callback state), train from the next batch with
the checkpoint and heartbeat callbacks, and on any exception write an error record before
exiting non-zero.
Exit ``EXIT_CONFIG`` says "this will fail the same way again": the supervisor does not retry it.
With ``--standby`` it is a standby instead (standby.py): ``prepare`` now, ``run`` once promoted.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import threading
import time
import traceback
from types import SimpleNamespace

from orchestrator.checkpoint import tiers
from orchestrator.checkpoint.writer import CheckpointWriter
from orchestrator.train import jobcode
from orchestrator.train.jobcode import JobError
from orchestrator.recovery.faults import Injector
from orchestrator.core.heartbeat import HeartbeatWriter, Phase, Position, register_stack_dump
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import write_json_atomic
from orchestrator.core import logs
from orchestrator.core.rundir import (CPU_DEVICES_ENV, ENV_BATCH_SIZE, ENV_REINIT, ENV_STRATEGY,
                                      EXIT_CONFIG, EXIT_PREEMPTED, JOURNAL_FILE, RunDir)
from orchestrator.core.backends import ENV_BACKEND
from orchestrator.core.spec import JobSpec, SpecError
from orchestrator.core.specload import load
from orchestrator.core.standbymode import StandbyMode
from orchestrator.core.events import Event
from orchestrator.train.preemption import Preempted, PreemptionNotice

log = logging.getLogger("orchestrator.train.worker")  # its name as __main__ too (python -m)


def _watch_parent(poll: float = 0.5) -> None:
    """Exit when the supervisor that started us dies: an orphan must not keep training."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(poll)
            if os.getppid() != parent:
                log.warning("supervisor is gone; exiting")
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


@dataclasses.dataclass
class Prepared:
    """What an attempt builds before it knows where to resume: everything a standby holds
    while it waits (``prepare``). ``run`` takes it from here, in a cold attempt right away, in
    a promoted standby later: one code path for both, so a warm recovery cannot drift."""

    spec: JobSpec
    reinitialise: bool
    strategy: object
    described: str
    replicas: int
    global_batch: int
    is_tpu: bool
    data: object
    spe: int
    model: object
    schedule: object
    job_callbacks: list
    val_ds: object
    rank: int = 0  # in a multi-worker group (train/multiworker.py); 0 alone
    placement: object = None  # backends.Placement: plain (export here) and drop_remainder
    backend: object = None    # train/backends: the framework under Keras


def prepare(spec: JobSpec, t_start: float, marks: dict) -> Prepared:
    """Resolve the strategy, load the data, build and compile the model in its scope (every
    variable a checkpoint holds exists afterwards). Nothing here depends on the checkpoint or
    on the attempt number; ``marks['model_built']`` is set."""
    from orchestrator.train import backends, datasets, multiworker

    backend = backends.current()
    group = multiworker.cluster()
    backend.seed(spec.seed, spec.deterministic)
    spec, reinitialise = apply_overrides(spec)
    placement = backend.placement(spec, group, reinitialise)
    strategy, described, replicas = placement.strategy, placement.described, placement.replicas
    global_batch = spec.batch_size * replicas
    is_tpu = placement.is_tpu

    data = jobcode.load_data(spec)
    global_batch, spe = datasets.batching(data, global_batch, placement.drop_remainder,
                                          replicas, group is not None)

    model = jobcode.build_model(spec, strategy, data)
    with strategy.scope():
        schedule = jobcode.schedule(spec, model.optimizer)
    job_callbacks = jobcode.job_callbacks(spec)
    val_ds = backend.validation_data(data, global_batch, placement.drop_remainder)
    marks["model_built"] = round(time.time() - t_start, 3)
    return Prepared(spec, reinitialise, strategy, described, replicas, global_batch, is_tpu,
                    data, spe, model, schedule, job_callbacks, val_ds,
                    group.rank if group else 0, placement, backend)


def configure(spec: JobSpec, t_start: float) -> dict:
    """Import the run's framework with its devices set up first (what the framework reads when
    it initialises them); returns the start-up marks so far."""
    from orchestrator.train import backends

    if spec.tensorboard:
        from orchestrator.train import tensorboard

        # before the framework's import (seconds): one line naming the key and the extra
        tensorboard.require()
    backend = backends.for_name(spec.backend)
    # a standby beside the worker needs device memory left to it (GPU memory growth, no
    # preallocation of 75 % of the GPU by JAX)
    backend.configure(spec, os.environ.get(CPU_DEVICES_ENV), standby=spec.standby != "off")
    jobcode.import_framework(spec)
    return {"tf_imported": round(time.time() - t_start, 3)}


def train(spec: JobSpec, rd: RunDir, attempt: int, progress, t_start: float,
          marks: dict | None = None, notice: PreemptionNotice | None = None) -> dict:
    """A cold attempt: prepare, then run. Returns a summary. Raises on any failure.

    ``marks`` collects seconds since ``t_start`` at each start-up phase (``tf_imported``,
    ``model_built``, ``restored``), journaled with ``worker_ready``: where a recovery's time goes.
    """
    marks = {} if marks is None else marks
    rank = _rank()
    os.makedirs(rd.for_rank(rank), exist_ok=True)
    heart = HeartbeatWriter(rd.for_rank(rank), attempt, spec.heartbeat_interval)
    heart.beat(force=True, phase=Phase.STARTING)
    prep = prepare(spec, t_start, marks)
    return run(prep, rd, attempt, progress, t_start, marks, notice, heart)


def run(prep: Prepared, rd: RunDir, attempt: int, progress, t_start: float, marks: dict,
        notice: PreemptionNotice | None = None, heart: HeartbeatWriter | None = None,
        standby: dict | None = None) -> dict:
    """Restore the newest verified checkpoint into the prepared model, journal
    ``worker_ready`` and train from the next batch. ``standby``: this process was a standby,
    promoted (journaled with ``worker_ready``, whose ``warm`` tells a recovery that found the
    model built and the step traced from a cold one); ``t_start`` is then the promotion, so
    ``startup_s`` is what the recovery waited for."""
    import keras

    from orchestrator.train import resume
    from orchestrator.train import state
    from orchestrator.train.callbacks import (CallbackStates, CheckpointCallback, FaultCallback, HeartbeatCallback,
                            LearningRateCallback, OneTraining, ProgressCallback, ResumeState)

    spec, strategy, model = prep.spec, prep.strategy, prep.model
    described, replicas, global_batch = prep.described, prep.replicas, prep.global_batch
    spe, data, schedule = prep.spe, prep.data, prep.schedule
    backend, placement = prep.backend, prep.placement
    job_callbacks, val_ds, rank = prep.job_callbacks, prep.val_ds, prep.rank
    os.makedirs(rd.for_rank(rank), exist_ok=True)
    journal = Journal(os.path.join(rd.for_rank(rank), JOURNAL_FILE))
    notice = notice or PreemptionNotice()
    if heart is None:
        heart = HeartbeatWriter(rd.for_rank(rank), attempt, spec.heartbeat_interval)
        heart.beat(force=True, phase=Phase.STARTING)
    # a group's claims in the run directory, which every rank on every node sees (faults.py)
    injector = Injector.from_env(rd.root if _in_group() else rd.control, attempt, journal,
                                 rank=rank)
    states = CallbackStates(job_callbacks)

    if _in_group():
        _sees_run_dir(rd, rank)
    own = tiers.for_spec(spec)
    store = injector.wrap_store(own)  # commits: local tier
    store.remove_partial()
    skipped = []
    latest = resume.restore_point(store, rank, skipped)
    for c, why in skipped:
        journal.append(Event.CHECKPOINT_SKIPPED, source="worker", attempt=attempt, step=c.step,
                       path=c.path, reason=why)
    at = resume.plan(latest.manifest if latest else None, global_batch=global_batch,
                     steps_per_epoch=spe, deterministic=spec.deterministic)
    arrays: dict = {}
    restored = None
    if latest is not None:
        arrays = state.load_arrays(latest)  # hashed as it is read
        try:
            with strategy.scope():
                state.restore(model, arrays, latest.manifest.get("holders"))
        except state.StateMismatch as exc:
            raise JobError(f"cannot resume from {latest.path}: {exc}") from exc
        restored = state.state_fingerprint(model)
        if latest.manifest.get("state_sha256") not in (None, restored):
            at.not_exact.append(f"the restored state (sha256 {restored[:12]}) differs from the "
                                f"checkpoint's ({latest.manifest['state_sha256'][:12]})")
        at.not_exact.extend(latest.manifest.get("outside_state") or [])
        unknown = states.unknown()
        if unknown:
            at.not_exact.append(f"callback(s) {', '.join(unknown)} have no get_state/set_state: "
                                f"their state starts afresh")
        if at.mid_epoch and getattr(model.optimizer, "use_ema", False):
            at.not_exact.append("the optimizer uses EMA, whose weights Keras swaps in at the end "
                                "of each fit call (finalize_variable_values): the resumed epoch "
                                "ends one call early")
    marks["restored"] = round(time.time() - t_start, 3)
    from orchestrator.train.backends import exactness

    unpromised = exactness(placement, spec.deterministic, backend.exact_on)
    if unpromised and spec.deterministic:
        log.info(unpromised)
    progress.epoch, progress.batch, progress.step = at.epoch, at.batch, at.step
    journal.append(Event.WORKER_READY, source="worker", attempt=attempt, strategy=described,
                   strategy_kind=described.split()[0].lower(), reinitialised=prep.reinitialise,
                   batch_size=spec.batch_size, replicas=replicas, global_batch=global_batch,
                   steps_per_epoch=spe, backend=backend.name, versions=backend.versions(),
                   **backend.facts(), exact_resume_not_promised=unpromised,
                   resumed_from_epoch=at.epoch, resumed_from_batch=at.batch,
                   resumed_from_step=at.step, deterministic=spec.deterministic,
                   restored_state_sha256=restored,
                   startup_s=round(time.time() - t_start, 3), started_at=round(t_start, 3),
                   phases_s=marks, warm=bool(standby and standby["mode"] == StandbyMode.WARM
                                             and not standby.get("adopted")),
                   **({"standby": standby} if standby else {}))

    def not_exact(reasons):
        journal.append(Event.RESUME_NOT_EXACT, source="worker", attempt=attempt, step=at.step,
                       reasons=list(reasons))
        for r in reasons:
            log.info(f"resume not exact: {r}")

    if at.not_exact:
        not_exact(at.not_exact)
    if spec.tensorboard:
        from orchestrator.train import tensorboard

        dropped = tensorboard.repair(spec.tensorboard.dir, at.step)
        if dropped:
            log.info(f"tensorboard: dropped {dropped} point(s) past step {at.step} "
                     f"written by an earlier attempt ({spec.tensorboard.dir})")
    log.info(f"attempt {attempt}: {described}, {replicas} replica(s), global batch "
             f"{global_batch}, resuming at epoch {at.epoch}/{spec.epochs} batch {at.batch}/{spe}"
             f"{' (a promoted standby)' if standby else ''}")
    if at.stopped_early or at.epoch >= spec.epochs:
        return {"epochs": at.epoch, "fingerprint": state.fingerprint(model)}

    base_manifest = {"job": spec.name, "training_hash": spec.training_hash(), "attempt": attempt,
                     "global_batch": global_batch, "replicas": replicas,
                     "steps_per_epoch": spe, "deterministic": spec.deterministic}
    ckpt_writer = CheckpointWriter(  # a group writes in line: no rank skips alone
        background=spec.checkpoint.background and not _in_group(),
        journal=lambda event, **f: journal.append(event, source="worker", attempt=attempt, **f))
    def first_step():  # recovery time ends at the first step; the step is compiled by now
        journal.append(Event.FIRST_STEP, source="worker", attempt=attempt,
                       since_start_s=round(time.time() - t_start, 3))
        backend.after_compile()

    prog_cb = ProgressCallback(progress, on_first_step=first_step)
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
        keras.callbacks.LambdaCallback(  # the evaluation's executables too
            on_epoch_end=lambda epoch, logs: backend.after_compile()),
    ]
    if spec.tensorboard:  # before the checkpoint: a step's points are flushed before it commits
        inner.append(tensorboard.TensorBoardCallback(
            spec.tensorboard.dir, spec.tensorboard.every_steps, progress, at.step))
    inner.append(CheckpointCallback(store, spec.checkpoint, progress, spe, spec.epochs,
                                    at.history, base_manifest, states, notice,
                                    writer=ckpt_writer, chief=rank == 0,
                                    on_commit=lambda c: heart.committed(
                                        c.step, c.epoch, c.path, own.digest(c.path))))
    if injector:
        inner.append(FaultCallback(injector, progress))
    training = OneTraining(inner)
    failing = True
    try:
        with notice.training():
            for begin, end, skip in at.segments(spec.epochs):
                prog_cb.batch_offset = skip
                train_ds = backend.train_data(data, spec.seed, begin, end, global_batch,
                                              placement.drop_remainder, skip_batches=skip)
                model.fit(train_ds, validation_data=val_ds, epochs=end, initial_epoch=begin,
                          steps_per_epoch=spe - skip if skip else spe, callbacks=[training],
                          verbose=2, **backend.fit_options(global_batch))
                if model.stop_training:
                    break
            training.finish()  # commits the last checkpoint and waits for its write
        failing = False
    finally:  # a failed attempt still finishes the write in flight: work the next one keeps
        ckpt_writer.close(failing=failing)
    if placement.plain:  # one default device, no distribution: the plain CPU model
        from orchestrator.train import export

        export.at_end(spec, rd, store, model, journal, heart, attempt, injector)
    return {"epochs": progress.epoch, "fingerprint": state.fingerprint(model)}


def _sees_run_dir(rd: RunDir, rank: int) -> None:
    """A rank of a group restores from, and its chief's node copies to, the run directory: a
    node that does not see it (no shared mount there) is named once, with the path, as a job
    error (not retried: every attempt would fail the same way), before any training."""
    from orchestrator.train import multiworker

    if os.path.isfile(rd.run_info):
        return
    group = multiworker.cluster()
    node = group.host if group else "?"
    raise JobError(f"rank {rank} on node {node} ({os.uname().nodename}) cannot see the run "
                   f"directory {rd.root} (no {os.path.basename(rd.run_info)} there): every "
                   f"node of a group must mount it at the same path (NFS, gcsfuse, a Drive "
                   f"mount)")


def _in_group() -> bool:
    from orchestrator.train import multiworker

    return multiworker.cluster() is not None


def _rank() -> int:
    """This worker's rank in its group (0 alone): from TF_CONFIG, read without TensorFlow."""
    from orchestrator.train import multiworker

    try:
        group = multiworker.cluster()
    except (ValueError, KeyError, TypeError):
        return 0
    return group.rank if group else 0


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
    rank = _rank()
    if rank:
        record["rank"] = rank
    try:
        write_json_atomic(rd.error_record(attempt, rank), record)
    except OSError as write_exc:  # the run dir itself may be what failed (Drive gone)
        log.warning(f"could not write the error record: {write_exc}")


def guarded(rd: RunDir, attempt: int, progress, body) -> int:
    """Run an attempt's ``body`` and turn how it ended into the exit status the supervisor
    classifies: an error record for every failure, ``EXIT_CONFIG`` for the job's own."""
    try:
        from orchestrator.train import datasets, state

        try:
            summary = body()
        except (datasets.DataError, state.StateMismatch) as exc:
            raise JobError(str(exc)) from exc
    except Preempted as exc:
        exc.journal(rd.journal, attempt, progress)
        return EXIT_PREEMPTED
    except JobError as exc:
        write_error_record(rd, attempt, exc, progress, fatal=True)
        log.warning(f"error: {exc}")
        return EXIT_CONFIG
    except Exception as exc:  # noqa: BLE001 - every failure is recorded for the supervisor
        write_error_record(rd, attempt, exc, progress, fatal=False)
        traceback.print_exc()
        return 1
    log.info(f"done: {summary['epochs']} epochs, weights sha256 {summary['fingerprint']}")
    return 0


def _cold(spec: JobSpec, rd: RunDir, attempt: int, progress, t_start: float, notice) -> dict:
    marks = configure(spec, t_start)
    return train(spec, rd, attempt, progress, t_start, marks, notice)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.train.worker")
    p.add_argument("job")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--attempt", type=int, required=True,
                   help="the attempt (a standby: the one it is meant to become)")
    p.add_argument("--standby", choices=StandbyMode.STARTED,
                   help="warm up and wait for a promotion line on stdin")
    args = p.parse_args(argv)
    t_start = time.time()
    logs.configure()  # the [worker] lines of the attempt's log
    notice = PreemptionNotice().install()
    try:  # from here a SIGTERM raises Preempted until training (a traceback and exit 1 before)
        return _start(args, notice, t_start)
    except Preempted:  # before training: nothing new to save
        return EXIT_PREEMPTED


def _start(args, notice: PreemptionNotice, t_start: float) -> int:
    with notice.deferred():  # until it knows where its journal is
        register_stack_dump()
        _watch_parent()
        try:
            spec = load(args.job, run_dir=args.run_dir,
                        backend=os.environ.get(ENV_BACKEND) or None)
        except SpecError as exc:
            log.warning(str(exc))
            return EXIT_CONFIG
        rd = RunDir.for_spec(spec).make()
    if notice.requested:
        Preempted(None, notice.received_at).journal(rd.journal, args.attempt, Position())
        return EXIT_PREEMPTED
    if args.standby:
        from orchestrator.train import standby

        return standby.serve(spec, rd, args.attempt, args.standby, notice, t_start,
                             SimpleNamespace(configure=configure, guarded=guarded,
                                             prepare=prepare, run=run))
    from orchestrator.train import backends

    progress = Position()
    return backends.leave(guarded(rd, args.attempt, progress,
                                  lambda: _cold(spec, rd, args.attempt, progress, t_start,
                                                notice)))


if __name__ == "__main__":
    sys.exit(main())

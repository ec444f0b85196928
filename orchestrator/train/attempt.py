"""One training attempt as its steps, each a function of what the one before returned:

    configure -> prepare -> restore -> journal_ready -> callbacks -> fit -> export

A cold attempt (``cold``) takes them in a row. A standby (standby.py) takes ``configure`` and
``prepare`` while it waits, and ``run`` (the rest) once promoted: one code path for both, so a
warm recovery cannot drift from a cold one.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future

from orchestrator.checkpoint import tiers
from orchestrator.checkpoint.store import Checkpoint, CheckpointStore
from orchestrator.checkpoint.writer import CheckpointWriter
from orchestrator.core.events import Event
from orchestrator.core.heartbeat import HeartbeatWriter, Phase, Position
from orchestrator.core.journal import Journal
from orchestrator.core.rundir import (CPU_DEVICES_ENV, ENV_BATCH_SIZE, ENV_REINIT, ENV_STRATEGY,
                                      JOURNAL_FILE, RunDir)
from orchestrator.core.spec import JobSpec
from orchestrator.core.standbymode import StandbyMode
from orchestrator.recovery.faults import Injector
from orchestrator.train import (backends, datasets, jobcode, multiworker, resume, state,
                                tensorboard)
from orchestrator.train import export as exporting
from orchestrator.train.errors import JobError
from orchestrator.train.preemption import PreemptionNotice
from orchestrator.train.resume import ResumePoint

log = logging.getLogger("orchestrator.train.worker")  # the [worker] lines of the attempt's log


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
class Attempt:
    """Which attempt this is and where it reports: fixed from its start to its end."""

    layout: RunDir
    number: int
    progress: Position
    t_start: float  # a promoted standby: the promotion, so startup_s is what a recovery waited
    marks: dict     # seconds since t_start at each start-up phase, journaled with worker_ready
    notice: PreemptionNotice | None = None
    heart: HeartbeatWriter | None = None
    standby: dict | None = None  # a promoted standby's facts, journaled with worker_ready


@dataclasses.dataclass
class Prepared:
    """What an attempt builds before it knows where to resume: everything a standby holds
    while it waits."""

    spec: JobSpec
    reinitialise: bool
    strategy: object
    described: str
    replicas: int
    global_batch: int
    is_tpu: bool
    data: object
    steps_per_epoch: int
    model: object
    schedule: object
    job_callbacks: list
    val_ds: object
    rank: int = 0  # in a multi-worker group (train/multiworker.py); 0 alone
    placement: object = None  # backends.Placement: plain (export here) and drop_remainder
    backend: object = None    # train/backends: the framework under Keras


@dataclasses.dataclass
class Found:
    """What ``read`` found in the tiers: the store the attempt commits through and the newest
    checkpoint that reads back intact, with its arrays."""

    journal: Journal
    own: object               # the local tier: what a commit's digest is read from
    store: CheckpointStore    # commits go here (the local tier, faults wrapped around it)
    injector: Injector
    latest: Checkpoint | None
    arrays: dict
    skipped: list             # (checkpoint, why) passed over as not intact
    read_at: float            # when the read was done (time.time())


@dataclasses.dataclass
class Restored:
    """The prepared model with the newest verified checkpoint in it, and where it resumes."""

    prep: Prepared
    attempt: Attempt
    journal: Journal
    own: object               # the local tier: what a commit's digest is read from
    store: CheckpointStore    # commits go here (the local tier, faults wrapped around it)
    injector: Injector
    states: object            # callbacks.CallbackStates of the job's callbacks
    latest: Checkpoint | None
    at: ResumePoint
    arrays: dict
    restored_sha256: str | None

    def not_exact(self, reasons) -> None:
        self.journal.append(Event.RESUME_NOT_EXACT, source="worker",
                            attempt=self.attempt.number, step=self.at.step,
                            reasons=list(reasons))
        for r in reasons:
            log.info(f"resume not exact: {r}")

    @property
    def finished(self) -> bool:
        """Nothing left to train: every epoch done, or a callback stopped the run."""
        return self.at.stopped_early or self.at.epoch >= self.prep.spec.epochs


@dataclasses.dataclass
class Training:
    """The callbacks of one attempt's ``fit`` calls, and the writer their commits go through."""

    restored: Restored
    writer: CheckpointWriter
    progress_callback: object  # callbacks.ProgressCallback: its batch_offset per segment
    callbacks: object          # callbacks.OneTraining: the one callback fit is given


def configure(spec: JobSpec, t_start: float) -> dict:
    """Import the run's framework with its devices set up first (what the framework reads when
    it initialises them); returns the start-up marks so far."""
    if spec.tensorboard:  # before the framework's import (seconds): one line, the key, the extra
        tensorboard.require()
    backend = backends.for_name(spec.backend)
    # a standby beside the worker needs device memory left to it (GPU memory growth, no
    # preallocation of 75 % of the GPU by JAX)
    backend.configure(spec, os.environ.get(CPU_DEVICES_ENV), standby=spec.standby != "off")
    jobcode.import_framework(spec)
    return {"tf_imported": round(time.time() - t_start, 3)}


def prepare(spec: JobSpec, t_start: float, marks: dict) -> Prepared:
    """Resolve the strategy, load the data, build and compile the model in its scope (every
    variable a checkpoint holds exists afterwards). Nothing here depends on the checkpoint or
    on the attempt number; ``marks['model_built']`` is set."""
    backend = backends.current()
    group = multiworker.cluster()
    backend.seed(spec.seed, spec.deterministic)
    spec, reinitialise = apply_overrides(spec)
    placement = backend.placement(spec, group, reinitialise)
    data = jobcode.load_data(spec)
    global_batch, steps_per_epoch = datasets.batching(
        data, spec.batch_size * placement.replicas, placement.drop_remainder,
        placement.replicas, group is not None)
    model = jobcode.build_model(spec, placement.strategy, data)
    with placement.strategy.scope():
        schedule = jobcode.schedule(spec, model.optimizer)
    job_callbacks = jobcode.job_callbacks(spec)
    val_ds = backend.validation_data(data, global_batch, placement.drop_remainder)
    marks["model_built"] = round(time.time() - t_start, 3)
    return Prepared(spec, reinitialise, placement.strategy, placement.described,
                    placement.replicas, global_batch, placement.is_tpu, data, steps_per_epoch,
                    model, schedule, job_callbacks, val_ds, group.rank if group else 0,
                    placement, backend)


def cold(spec: JobSpec, layout: RunDir, number: int, progress: Position, t_start: float,
         notice: PreemptionNotice | None = None) -> dict:
    """A cold attempt, every step in a row, the checkpoint read beside the framework's import.
    Returns a summary; raises on any failure."""
    rank = multiworker.rank()
    reading = read_beside(spec, layout, number, rank)
    marks = configure(spec, t_start)
    control_dir = layout.for_rank(rank)
    os.makedirs(control_dir, exist_ok=True)
    heart = HeartbeatWriter(control_dir, number, spec.heartbeat_interval)
    heart.beat(force=True, phase=Phase.STARTING)
    prep = prepare(spec, t_start, marks)
    return run(prep, Attempt(layout, number, progress, t_start, marks, notice, heart), reading)


def run(prep: Prepared, attempt: Attempt, reading: Future | None = None) -> dict:
    """Restore the newest verified checkpoint into the prepared model (``reading``: its read,
    started earlier; None: read it now), journal ``worker_ready``, train from the next batch
    and export. Returns a summary."""
    restored = journal_ready(restore(prep, attempt, reading))
    if restored.finished:
        return {"epochs": restored.at.epoch, "fingerprint": state.fingerprint(prep.model)}
    return export(fit(callbacks(restored)))


def _notice_and_heartbeat(prep: Prepared, attempt: Attempt) -> None:
    """This rank's notice and heartbeat (a standby's attempt has none yet)."""
    attempt.notice = attempt.notice or PreemptionNotice()
    if attempt.heart is None:
        control_dir = attempt.layout.for_rank(prep.rank)
        os.makedirs(control_dir, exist_ok=True)
        attempt.heart = HeartbeatWriter(control_dir, attempt.number, prep.spec.heartbeat_interval)
        attempt.heart.beat(force=True, phase=Phase.STARTING)


def read(spec: JobSpec, layout: RunDir, number: int, rank: int,
         own: tiers.TieredStore | None = None) -> Found:
    """This rank's journal and store (faults wrapped around the tiers), partial checkpoints
    removed, and the newest checkpoint that reads back intact, its arrays hashed as they are
    read. No framework, no model: it can run before either exists."""
    control_dir = layout.for_rank(rank)
    os.makedirs(control_dir, exist_ok=True)
    journal = Journal(os.path.join(control_dir, JOURNAL_FILE))
    # a group's claims in the run directory, which every rank on every node sees (faults.py)
    injector = Injector.from_env(layout.root if multiworker.in_group() else layout.control,
                                 number, journal, rank=rank)
    if multiworker.in_group():
        _sees_run_dir(layout, rank)
    own = own or tiers.for_spec(spec)
    store = injector.wrap_store(own)  # commits: local tier
    store.remove_partial()
    skipped = []
    latest, arrays = resume.restore_point(store, rank, skipped)
    return Found(journal, own, store, injector, latest, arrays, skipped, time.time())


def read_beside(spec: JobSpec, layout: RunDir, number: int, rank: int) -> Future:
    """``read`` in a thread of its own, for a cold attempt to start before the framework's
    import: the checkpoint's bytes are read and verified (from the disk, or a bucket after a
    lost runtime) while the import runs, and the restore waits only for the copy into the
    model. Its failure is raised where the attempt restores, as if read there."""
    own = tiers.for_spec(spec)  # here: a bucket's library is imported beside no other import
    found: Future = Future()
    found.set_running_or_notify_cancel()

    def work():
        try:
            found.set_result(read(spec, layout, number, rank, own))
        except BaseException as exc:  # handed to the main thread: ``Future.result`` raises it
            found.set_exception(exc)

    threading.Thread(target=work, name="checkpoint-read", daemon=True).start()
    return found


def restore(prep: Prepared, attempt: Attempt, reading: Future | None = None) -> Restored:
    """The newest checkpoint that verifies, loaded into the model; ``marks['restored']``
    (and ``marks['read']``: when its read was done)."""
    from orchestrator.train.callbacks import CallbackStates  # here: it imports Keras

    _notice_and_heartbeat(prep, attempt)
    found = reading.result() if reading is not None else \
        read(prep.spec, attempt.layout, attempt.number, prep.rank)
    attempt.marks["read"] = round(found.read_at - attempt.t_start, 3)
    for c, why in found.skipped:
        found.journal.append(Event.CHECKPOINT_SKIPPED, source="worker", attempt=attempt.number,
                             step=c.step, path=c.path, reason=why)
    states = CallbackStates(prep.job_callbacks)
    latest = found.latest
    at = resume.plan(latest.manifest if latest else None, global_batch=prep.global_batch,
                     steps_per_epoch=prep.steps_per_epoch, deterministic=prep.spec.deterministic)
    restored_sha256 = None
    if latest is not None:
        restored_sha256 = _load(prep, latest, found.arrays, at, states)
    attempt.marks["restored"] = round(time.time() - attempt.t_start, 3)
    return Restored(prep, attempt, found.journal, found.own, found.store, found.injector, states,
                    latest, at, found.arrays, restored_sha256)


def _load(prep: Prepared, latest: Checkpoint, arrays: dict, at: ResumePoint, states) -> str:
    """``arrays`` into the model; what keeps the resume from being exact goes to ``at``."""
    model = prep.model
    try:
        with prep.strategy.scope():
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
    return restored


def journal_ready(restored: Restored) -> Restored:
    """``worker_ready`` (where a recovery's time went), what is not exact, the TensorBoard
    points past the restored step dropped; the position is the attempt's from here."""
    prep, attempt, at = restored.prep, restored.attempt, restored.at
    spec, backend, described, standby = prep.spec, prep.backend, prep.described, attempt.standby
    unpromised = backends.exactness(prep.placement, spec.deterministic, backend.exact_on)
    if unpromised and spec.deterministic:
        log.info(unpromised)
    attempt.progress.epoch, attempt.progress.batch, attempt.progress.step = \
        at.epoch, at.batch, at.step
    restored.journal.append(
        Event.WORKER_READY, source="worker", attempt=attempt.number, strategy=described,
        strategy_kind=described.split()[0].lower(), reinitialised=prep.reinitialise,
        batch_size=spec.batch_size, replicas=prep.replicas, global_batch=prep.global_batch,
        steps_per_epoch=prep.steps_per_epoch, backend=backend.name,
        versions=backend.versions(), **backend.facts(), exact_resume_not_promised=unpromised,
        resumed_from_epoch=at.epoch, resumed_from_batch=at.batch, resumed_from_step=at.step,
        deterministic=spec.deterministic, restored_state_sha256=restored.restored_sha256,
        startup_s=round(time.time() - attempt.t_start, 3), started_at=round(attempt.t_start, 3),
        phases_s=attempt.marks, warm=bool(standby and standby["mode"] == StandbyMode.WARM
                                          and not standby.get("adopted")),
        **({"standby": standby} if standby else {}))
    if at.not_exact:
        restored.not_exact(at.not_exact)
    if spec.tensorboard:
        dropped = tensorboard.repair(spec.tensorboard.dir, at.step)
        if dropped:
            log.info(f"tensorboard: dropped {dropped} point(s) past step {at.step} "
                     f"written by an earlier attempt ({spec.tensorboard.dir})")
    log.info(f"attempt {attempt.number}: {described}, {prep.replicas} replica(s), global batch "
             f"{prep.global_batch}, resuming at epoch {at.epoch}/{spec.epochs} batch "
             f"{at.batch}/{prep.steps_per_epoch}{' (a promoted standby)' if standby else ''}")
    return restored


def callbacks(restored: Restored) -> Training:
    """The attempt's callbacks in their order, around the one ``fit`` is given."""
    import keras  # here: the framework is configured by now (configure)

    from orchestrator.train import callbacks as cbs  # here: it imports Keras

    prep, attempt, at, latest = restored.prep, restored.attempt, restored.at, restored.latest
    spec, backend, number, journal = prep.spec, prep.backend, attempt.number, restored.journal
    writer = CheckpointWriter(  # a group writes in line: no rank skips alone
        background=spec.checkpoint.background and not multiworker.in_group(),
        journal=lambda event, **f: journal.append(event, source="worker", attempt=number, **f))

    def first_step():  # recovery time ends at the first step; the step is compiled by now
        journal.append(Event.FIRST_STEP, source="worker", attempt=number,
                       since_start_s=round(time.time() - attempt.t_start, 3))
        backend.after_compile()

    progress_callback = cbs.ProgressCallback(attempt.progress, on_first_step=first_step)
    inner = [progress_callback]
    if prep.schedule is not None:
        inner.append(cbs.LearningRateCallback(prep.schedule,
                                              skip_epoch=at.epoch if at.mid_epoch else None))
    inner += prep.job_callbacks
    inner += [
        cbs.ResumeState(restored.states, latest.manifest.get("callbacks") if latest else None,
                        restored.arrays, at.epoch if at.mid_epoch else None,
                        on_metrics_lost=lambda: restored.not_exact([
                            f"the checkpoint has no metric state for epoch {at.epoch + 1}: its "
                            f"reported metrics cover batches {at.batch + 1}.. only"])),
        cbs.HeartbeatCallback(attempt.heart, attempt.progress),
        keras.callbacks.LambdaCallback(  # the evaluation's executables too
            on_epoch_end=lambda epoch, logs: backend.after_compile()),
    ]
    if spec.tensorboard:  # before the checkpoint: a step's points are flushed before it commits
        inner.append(cbs.TensorBoardCallback(
            spec.tensorboard.dir, spec.tensorboard.every_steps, attempt.progress, at.step))
    inner.append(_checkpoint_callback(restored, writer))
    if restored.injector:
        inner.append(cbs.FaultCallback(restored.injector, attempt.progress))
    return Training(restored, writer, progress_callback, cbs.OneTraining(inner))


def _checkpoint_callback(restored: Restored, writer: CheckpointWriter):
    """Commits at the spec's cadence; each commit is told with the heartbeat (its digest)."""
    from orchestrator.train.callbacks import CheckpointCallback  # here: it imports Keras

    prep, attempt, at, own = restored.prep, restored.attempt, restored.at, restored.own
    spec = prep.spec
    base_manifest = {"job": spec.name, "training_hash": spec.training_hash(),
                     "attempt": attempt.number, "global_batch": prep.global_batch,
                     "replicas": prep.replicas, "steps_per_epoch": prep.steps_per_epoch,
                     "deterministic": spec.deterministic}
    return CheckpointCallback(restored.store, spec.checkpoint, attempt.progress,
                              prep.steps_per_epoch, spec.epochs, at.history, base_manifest,
                              restored.states, attempt.notice, writer=writer,
                              chief=prep.rank == 0,
                              on_commit=lambda c: attempt.heart.committed(
                                  c.step, c.epoch, c.path, own.digest(c.path)))


def fit(training: Training) -> Training:
    """``fit`` over the resume's segments; the last checkpoint is committed and written."""
    restored = training.restored
    prep, at, notice = restored.prep, restored.at, restored.attempt.notice
    spec, backend, placement, model = prep.spec, prep.backend, prep.placement, prep.model
    failing = True
    try:
        with notice.training():
            for begin, end, skip in at.segments(spec.epochs):
                training.progress_callback.batch_offset = skip
                train_ds = backend.train_data(prep.data, spec.seed, begin, end,
                                              prep.global_batch, placement.drop_remainder,
                                              skip_batches=skip)
                model.fit(train_ds, validation_data=prep.val_ds, epochs=end,
                          initial_epoch=begin,
                          steps_per_epoch=(prep.steps_per_epoch - skip if skip
                                           else prep.steps_per_epoch),
                          callbacks=[training.callbacks], verbose=2,
                          **backend.fit_options(prep.global_batch))
                if model.stop_training:
                    break
            training.callbacks.finish()  # commits the last checkpoint and waits for its write
        failing = False
    finally:  # a failed attempt still finishes the write in flight: work the next one keeps
        training.writer.close(failing=failing)
    return training


def export(training: Training) -> dict:
    """The plain CPU model exported where it was trained on one default device, no
    distribution (elsewhere the exporter process builds it); returns the summary."""
    restored = training.restored
    prep, attempt = restored.prep, restored.attempt
    if prep.placement.plain:
        exporting.at_end(prep.spec, attempt.layout, restored.store, prep.model,
                         restored.journal, attempt.heart, attempt.number, restored.injector)
    return {"epochs": attempt.progress.epoch, "fingerprint": state.fingerprint(prep.model)}


def _sees_run_dir(layout: RunDir, rank: int) -> None:
    """A rank of a group restores from, and its chief's node copies to, the run directory: a
    node that does not see it (no shared mount there) is named once, with the path, as a job
    error (not retried: every attempt would fail the same way), before any training."""
    if os.path.isfile(layout.run_info):
        return
    group = multiworker.cluster()
    node = group.host if group else "?"
    raise JobError(f"rank {rank} on node {node} ({os.uname().nodename}) cannot see the run "
                   f"directory {layout.root} (no {os.path.basename(layout.run_info)} there): "
                   f"every node of a group must mount it at the same path (NFS, gcsfuse, a "
                   f"Drive mount)")

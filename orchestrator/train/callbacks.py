"""Keras callbacks of the worker: one small class per concern (worker side).

The worker may train in several ``fit`` calls (the rest of an interrupted epoch, then the other
epochs), so its callbacks run inside ``OneTraining``, which shows them a single training: one
``on_train_begin``, one ``on_train_end``. Order matters: the checkpoint comes last, so that it
captures what the job's own callbacks (ReduceLROnPlateau, EarlyStopping) did at the epoch end.
"""
from __future__ import annotations

import copy
import os
import time

import keras
import numpy as np

from orchestrator.train import holders, state, tensorboard
from orchestrator.checkpoint import blobs, writer
from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.checkpoint.writer import CheckpointWriter
from orchestrator.core.heartbeat import HeartbeatWriter, Phase, Position
from orchestrator.core.spec import CheckpointSpec
from orchestrator.train.schedules import get_learning_rate


class OneTraining(keras.callbacks.Callback):
    """Runs ``callbacks`` across several ``fit`` calls as if they were one training.

    ``on_train_begin`` is passed on once, ``on_train_end`` only by ``finish()``: EarlyStopping
    would otherwise reset its patience at the second call and restore its best weights at the
    end of the first.
    """

    def __init__(self, callbacks):
        super().__init__()
        self.inner = keras.callbacks.CallbackList(list(callbacks))
        self._begun = False
        self._last_logs = None

    def set_model(self, model):
        super().set_model(model)
        self.inner.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.inner.set_params(params)

    def on_train_begin(self, logs=None):
        if not self._begun:
            self._begun = True
            self.inner.on_train_begin(logs)

    def on_train_end(self, logs=None):
        self._last_logs = logs

    def finish(self):
        """The end of the whole training (not of one ``fit`` call)."""
        self.inner.on_train_end(self._last_logs)

    def on_epoch_begin(self, epoch, logs=None):
        self.inner.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self.inner.on_epoch_end(epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.inner.on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.inner.on_train_batch_end(batch, logs)

    def on_test_begin(self, logs=None):
        self.inner.on_test_begin(logs)

    def on_test_end(self, logs=None):
        self.inner.on_test_end(logs)

    def on_test_batch_begin(self, batch, logs=None):
        self.inner.on_test_batch_begin(batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self.inner.on_test_batch_end(batch, logs)


class ProgressCallback(keras.callbacks.Callback):
    """Keeps ``progress`` (epochs done, batch within the epoch, global step) up to date.

    ``batch_offset`` is the batch a ``fit`` call starts at within its first epoch (a resumed
    epoch); Keras counts batches from 0 in every call.
    """

    def __init__(self, progress: Position, on_first_step=None):
        super().__init__()
        self.progress = progress
        self.on_first_step = on_first_step
        self.batch_offset = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.progress.epoch, self.progress.batch = epoch, self.batch_offset

    def on_train_batch_end(self, batch, logs=None):
        self.progress.batch = self.batch_offset + batch + 1
        self.progress.step += 1
        if self.on_first_step is not None:
            self.on_first_step()  # recovery time ends at the first step of an attempt
            self.on_first_step = None

    def on_epoch_end(self, epoch, logs=None):
        self.progress.epoch, self.progress.batch = epoch + 1, 0
        self.batch_offset = 0


class LearningRateCallback(keras.callbacks.Callback):
    """Sets the optimizer's rate from ``schedule(epoch, lr)`` at each epoch's start.

    ``skip_epoch``: an epoch resumed in the middle already has its rate (restored with the
    optimizer's variables); applying ``schedule`` again would apply a relative rule twice.
    """

    def __init__(self, schedule, skip_epoch: int | None = None):
        super().__init__()
        self.schedule, self.skip_epoch = schedule, skip_epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.skip_epoch:
            self.skip_epoch = None
            return
        opt = self.model.optimizer  # never None: jobcode.schedule refuses a schedule without one
        opt.learning_rate = float(self.schedule(epoch, get_learning_rate(opt)))


# Keras callbacks whose state decides later epochs, and the attributes that hold it (Keras 3
# resets them in on_train_begin). EarlyStopping's best_weights are arrays, saved with the state.
_STATE_ATTRS = (
    (keras.callbacks.EarlyStopping, ("wait", "stopped_epoch", "best", "best_epoch")),
    (keras.callbacks.ReduceLROnPlateau, ("wait", "cooldown_counter", "best")),
)
_STATELESS = (keras.callbacks.TerminateOnNaN, keras.callbacks.ProgbarLogger,
              keras.callbacks.History)


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return np.asarray(v).item()


class CallbackStates:
    """Capture and put back the state of the job's callbacks, as JSON and arrays (no pickle).

    Known Keras callbacks are read attribute by attribute; any other callback takes part by
    defining ``get_state() -> dict`` (JSON-able) and ``set_state(dict)``.
    """

    def __init__(self, callbacks):
        self.callbacks = list(callbacks)

    def unknown(self) -> list[str]:
        """Callbacks whose state (if any) cannot be saved: a resume cannot promise exactness."""
        return [type(cb).__name__ for cb in self.callbacks
                if not (hasattr(cb, "get_state") and hasattr(cb, "set_state"))
                and not isinstance(cb, _STATELESS) and self._attrs(cb) is None]

    @staticmethod
    def _attrs(cb):
        return next((attrs for cls, attrs in _STATE_ATTRS if isinstance(cb, cls)), None)

    def capture(self) -> tuple[list, dict]:
        states, arrays = [], {}
        for i, cb in enumerate(self.callbacks):
            entry = {"class": type(cb).__name__, "state": None}
            if hasattr(cb, "get_state") and hasattr(cb, "set_state"):
                entry["state"] = cb.get_state()
            elif self._attrs(cb) is not None:
                entry["state"] = {a: _plain(getattr(cb, a, None)) for a in self._attrs(cb)}
                weights = getattr(cb, "best_weights", None)
                if weights is not None:
                    entry["state"]["best_weights"] = len(weights)
                    for j, w in enumerate(weights):
                        arrays[f"callbacks.{i:02d}.{j:04d}"] = np.asarray(w)
            states.append(entry)
        return states, arrays

    def apply(self, states: list, arrays: dict) -> None:
        for i, (cb, entry) in enumerate(zip(self.callbacks, states)):
            s = entry.get("state")
            if s is None or entry.get("class") != type(cb).__name__:
                continue
            if hasattr(cb, "get_state") and hasattr(cb, "set_state"):
                cb.set_state(s)
                continue
            for a in self._attrs(cb) or ():
                setattr(cb, a, s.get(a))
            if s.get("best_weights") is not None:
                cb.best_weights = [arrays[f"callbacks.{i:02d}.{j:04d}"]
                                   for j in range(s["best_weights"])]


class ResumeState(keras.callbacks.Callback):
    """Puts back what Keras resets when training (or an epoch) begins: the callbacks' state
    after their ``on_train_begin``, and the interrupted epoch's running metrics after fit's
    ``reset_metrics``, so that the epoch's reported metrics still cover all of it."""

    def __init__(self, states: CallbackStates, saved_states: list | None, arrays: dict,
                 metrics_epoch: int | None, on_metrics_lost=None):
        super().__init__()
        self.states, self.saved_states, self.arrays = states, saved_states, arrays
        self.metrics_epoch, self.on_metrics_lost = metrics_epoch, on_metrics_lost

    def on_train_begin(self, logs=None):
        if self.saved_states:
            self.states.apply(self.saved_states, self.arrays)

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self.metrics_epoch:
            return
        self.metrics_epoch = None
        if not state.restore_metrics(self.model, self.arrays) and self.on_metrics_lost:
            self.on_metrics_lost()


class HeartbeatCallback(keras.callbacks.Callback):
    def __init__(self, writer: HeartbeatWriter, progress: Position):
        super().__init__()
        self.writer, self.progress = writer, progress
        self._stepped = False

    def on_train_begin(self, logs=None):
        self.writer.beat(force=True, phase=Phase.TRAIN_BEGIN, **self.progress.as_dict())

    def on_train_batch_end(self, batch, logs=None):
        # the first step is told at once: the supervisor starts the standby on it
        self.writer.beat(force=not self._stepped, phase=Phase.TRAINING, **self.progress.as_dict())
        self._stepped = True

    def on_test_batch_end(self, batch, logs=None):  # a long validation is not a hang
        self.writer.beat(phase=Phase.VALIDATION, **self.progress.as_dict())

    def on_epoch_end(self, epoch, logs=None):
        self.writer.beat(force=True, phase=Phase.EPOCH_END, **self.progress.as_dict())


class CheckpointCallback(keras.callbacks.Callback):
    """Commits the whole training state: at the end of every ``every_epochs`` epochs, within an
    epoch every ``every_steps`` global steps (multiples of it, so every run commits at the same
    steps) or ``every_seconds``, and once more when training ends (``stopped_early`` when a
    callback such as EarlyStopping ended it before the last epoch).

    The checkpoint is keyed by ``progress.step``, the training batches run so far: it only ever
    grows, whatever the optimizer counts (a LossScaleOptimizer does not count skipped steps).

    The training thread only takes a host copy of the state (``state.Snapshot``, the metric and
    callback state, the manifest); the fingerprints and the store's commit run in ``writer``'s
    background thread (``checkpoint.background: false``: in line). A write error of the
    background thread is raised here at the next step boundary; the end of training, and a
    preemption, wait for the last write.
    """

    def __init__(self, store: CheckpointStore, ckpt: CheckpointSpec, progress: Position,
                 steps_per_epoch: int, last_epoch: int, history: list, base_manifest: dict,
                 states: CallbackStates, notice=None, writer: CheckpointWriter | None = None,
                 chief: bool = True, on_commit=None):
        """``chief``: False for a rank > 0 of a multi-worker group. Every rank takes the same
        host copy at the same steps (a read of a variable may be a collective under MWMS, so
        all ranks must do it: TensorFlow's rule for saving); only the chief writes it
        (train/multiworker.py). Groups write in line, so that no rank skips where another
        does not. ``on_commit(checkpoint)``: told in the writer's thread once a commit is
        whole (the worker beats with it: core/heartbeat.py)."""
        super().__init__()
        self.chief, self.on_commit = chief, on_commit
        self.store, self.ckpt, self.progress = store, ckpt, progress
        self.steps_per_epoch, self.last_epoch = steps_per_epoch, last_epoch
        self.history = list(history)
        self.base_manifest, self.states = base_manifest, states
        self.notice = notice  # preemption.PreemptionNotice: SIGTERM -> commit now, then stop
        self.writer = writer or CheckpointWriter(background=ckpt.background)
        self._snapshot = None
        self._warming = False  # the snapshot's warm-up handed to the writer (after step 1)
        self._scalars0: dict | None = None  # holders.user_scalars when training began
        self._last_commit = time.monotonic()
        self._committed_step: int | None = None
        self._metrics: dict = {}

    def set_model(self, model):
        super().set_model(model)
        self._snapshot = state.Snapshot(model, compiled=self.writer.background)
        if self._scalars0 is None:
            self._scalars0 = holders.user_scalars(model)

    def _outside_state(self) -> list[str]:
        """What the checkpoint cannot hold, for a resume to say (``resume_not_exact``): random
        generators outside Keras found on the model, and the job's own number attributes that
        changed since training began (a Python counter a ``train_step`` keeps)."""
        changed = [f"{k} (a Python number on the model, {self._scalars0[k]!r} when training "
                   f"began, {v!r} now): no checkpoint holds it; keep it in a keras.Variable"
                   for k, v in holders.user_scalars(self.model).items()
                   if k in self._scalars0 and self._scalars0[k] != v]
        return list(self._snapshot.outside) + changed

    def _due(self) -> bool:
        every, secs = self.ckpt.every_steps, self.ckpt.every_seconds
        return bool((every and self.progress.step % every == 0)
                    or (secs and time.monotonic() - self._last_commit >= secs))

    def on_epoch_begin(self, epoch, logs=None):
        self._lr = get_learning_rate(self.model.optimizer)

    def _preempted(self) -> bool:
        return self.notice is not None and self.notice.requested

    def _stop_for_preemption(self):
        self.writer.drain()  # the step we stop at is on disk before we say so
        self.notice.stop(self._committed_step)

    def on_train_batch_end(self, batch, logs=None):
        if not self._warming:
            # after the attempt's first step (journaled by now), not beside it: tracing the
            # reader in the writer's thread took the GIL from that step's own tracing, most in
            # a recovery (the optimizer restored: twice the variables; BENCHMARKS.md)
            self._warming = True
            self.writer.prepare(self._snapshot.warm)
        self.writer.check()  # a failed background write stops training here, not silently
        if self.progress.batch >= self.steps_per_epoch:
            return  # the epoch's last batch: its end commits (after validation and callbacks)
        metrics = {k: float(v) for k, v in (logs or {}).items()}
        if not self._preempted() and self._due():
            self._commit(metrics, writer.PERIODIC, mid_epoch=True)
        # read again: a SIGTERM may have come during that commit (one skipped busy, under load:
        # the worker then stopped at the step written before, losing the steps since)
        if self._preempted():
            if self._committed_step != self.progress.step:
                self._commit(metrics, writer.PREEMPTION, mid_epoch=True)
            self._stop_for_preemption()

    def on_epoch_end(self, epoch, logs=None):
        self.writer.check()
        done = epoch + 1
        self._metrics = {k: float(v) for k, v in (logs or {}).items()}
        self.history.append({"epoch": done, "learning_rate": self._lr, **self._metrics})
        if self.model.stop_training or done >= self.last_epoch:
            return  # committed by on_train_end, after the job's callbacks had their say
        if self._preempted():
            self._commit(self._metrics, writer.PREEMPTION)
            self._stop_for_preemption()
        if done % self.ckpt.every_epochs == 0 or self._due():
            self._commit(self._metrics, writer.EPOCH_END)

    def on_train_end(self, logs=None):
        self._commit(self._metrics, writer.FINAL, stopped_early=bool(
            self.model.stop_training and self.progress.epoch < self.last_epoch))
        self.writer.drain()  # the end of training waits for the last checkpoint

    def _commit(self, metrics: dict, reason: str, mid_epoch: bool = False,
                stopped_early: bool = False) -> None:
        p = self.progress
        waited = self.writer.admit(p.step, reason)
        if waited is None:  # skipped (journaled): the next interval starts now all the same
            self._last_commit = time.monotonic()
            return
        t0 = time.perf_counter()
        arrays = self._snapshot.take()
        states, extra = self.states.capture()
        extra = {k: np.array(v, copy=True) for k, v in extra.items()}
        if mid_epoch:
            extra.update(state.capture_metrics(self.model))
        # copies of what the training thread goes on changing (the description is replaced,
        # never changed, when the variables change)
        manifest = dict(
            self.base_manifest, epoch=p.epoch, batch=p.batch if mid_epoch else 0,
            metrics=dict(metrics), history=[dict(h) for h in self.history],
            stopped_early=stopped_early, learning_rate=get_learning_rate(self.model.optimizer),
            callbacks=copy.deepcopy(states), variables=self._snapshot.description,
            holders=copy.deepcopy(self._snapshot.holders), outside_state=self._outside_state())
        capture_ms = round((time.perf_counter() - t0) * 1000.0, 2)
        snapshot, store, keep, step = self._snapshot, self.store, self.ckpt.keep, p.step
        on_commit = self.on_commit
        if not self.chief:
            self._last_commit, self._committed_step = time.monotonic(), step
            return

        def write():  # in the writer's thread: nothing here reads the live model
            everything = {**arrays, **extra}
            refs = blobs.hash_arrays(everything)  # once: the blobs' names and the fingerprints
            manifest["weights_sha256"], manifest["state_sha256"] = snapshot.fingerprints(refs)
            c = store.commit(step, None, manifest, keep=keep, arrays=everything, refs=refs)
            if on_commit is not None:
                on_commit(c)

        self.writer.submit(step, write, stall_ms=waited + capture_ms, reason=reason,
                           wait_ms=waited, capture_ms=capture_ms)
        self._last_commit = time.monotonic()
        self._committed_step = step


class FaultCallback(keras.callbacks.Callback):
    """Fires injected faults at their global step (faults.py); added only when there are any,
    after the ProgressCallback."""

    def __init__(self, injector, progress: Position):
        super().__init__()
        self.injector, self.progress = injector, progress

    def on_train_batch_end(self, batch, logs=None):
        self.injector.at_step(self.progress.step)


class TensorBoardCallback(keras.callbacks.Callback):
    """Writes TensorBoard's scalars (into train/tensorboard.py's files) at the global step
    ``progress.step`` (kept by the ProgressCallback, which must come before this one); goes
    before the CheckpointCallback, so that the points of a step are on disk before that step's
    checkpoint commits."""

    def __init__(self, log_dir: str, every_steps: int, progress: Position, resumed_step: int):
        super().__init__()
        self.log_dir, self.every_steps, self.progress = log_dir, every_steps, progress
        self.resumed_step = resumed_step
        self._writers: dict = {}
        self._lr = None

    def _writer(self, run: str) -> tensorboard.EventFile:
        """The run folder's file of this attempt, opened at its first point; its START marker
        makes a TensorBoard already watching purge what it had read past the restored step."""
        if run not in self._writers:
            self._writers[run] = tensorboard.EventFile(os.path.join(self.log_dir, run),
                                                       self.resumed_step + 1)
        return self._writers[run]

    def _write(self, run: str, prefix: str, scalars: dict) -> None:
        if not scalars:
            return
        writer = self._writer(run)
        for name, value in scalars.items():
            writer.scalar(prefix + name, value, self.progress.step)
        writer.flush()

    def on_epoch_begin(self, epoch, logs=None):
        self._lr = get_learning_rate(self.model.optimizer)  # the rate this epoch trains with

    def on_train_batch_end(self, batch, logs=None):
        if self.every_steps and self.progress.step % self.every_steps == 0:
            lr = get_learning_rate(self.model.optimizer)  # None: no model.optimizer
            self._write("train", "batch_", {**(logs or {}), **(
                {"learning_rate": lr} if lr is not None else {})})

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        train = {k: v for k, v in logs.items() if not k.startswith("val_")}
        if self._lr is not None:
            train["learning_rate"] = self._lr  # not ReduceLROnPlateau's end-of-epoch rate
        self._write("train", "epoch_", train)
        self._write("validation", "epoch_", {k[4:]: v for k, v in logs.items()
                                             if k.startswith("val_")})

    def on_train_end(self, logs=None):
        for w in self._writers.values():
            w.close()
        self._writers = {}

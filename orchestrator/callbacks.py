"""Keras callbacks of the worker: one small class per concern (worker side)."""
from __future__ import annotations

import keras

from . import state
from .checkpoints import CheckpointStore
from .heartbeat import HeartbeatWriter, Progress


class ProgressCallback(keras.callbacks.Callback):
    def __init__(self, progress: Progress, on_first_step=None):
        super().__init__()
        self.progress = progress
        self.on_first_step = on_first_step

    def on_epoch_begin(self, epoch, logs=None):
        self.progress.epoch, self.progress.batch = epoch, 0

    def on_train_batch_end(self, batch, logs=None):
        self.progress.batch = batch + 1
        if self.on_first_step is not None:
            self.on_first_step()  # recovery time ends at the first step of an attempt
            self.on_first_step = None

    def on_epoch_end(self, epoch, logs=None):
        self.progress.epoch, self.progress.batch = epoch + 1, 0


class HeartbeatCallback(keras.callbacks.Callback):
    def __init__(self, writer: HeartbeatWriter, progress: Progress):
        super().__init__()
        self.writer, self.progress = writer, progress

    def on_train_begin(self, logs=None):
        self.writer.beat(force=True, phase="training", **self.progress.as_dict())

    def on_train_batch_end(self, batch, logs=None):
        self.writer.beat(phase="training", **self.progress.as_dict())

    def on_epoch_end(self, epoch, logs=None):
        self.writer.beat(force=True, phase="epoch_end", **self.progress.as_dict())


class CheckpointCallback(keras.callbacks.Callback):
    """Commits the whole training state after every ``every`` epochs and after the last one."""

    def __init__(self, store: CheckpointStore, every: int, last_epoch: int, keep: int,
                 history: list, base_manifest: dict):
        super().__init__()
        self.store, self.every, self.last_epoch, self.keep = store, every, last_epoch, keep
        self.history = list(history)
        self.base_manifest = base_manifest

    def on_epoch_end(self, epoch, logs=None):
        done = epoch + 1
        metrics = {k: float(v) for k, v in (logs or {}).items()}
        self.history.append({"epoch": done, **metrics})
        if done % self.every and done != self.last_epoch:
            return
        step = int(self.model.optimizer.iterations.numpy())
        manifest = dict(self.base_manifest, epoch=done, batch=0, metrics=metrics, history=self.history,
                        weights_sha256=state.fingerprint(self.model),
                        variables=state.describe(self.model))
        self.store.commit(step, lambda d: state.save(self.model, d), manifest, keep=self.keep)

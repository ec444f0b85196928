"""TensorBoard scalars that continue across restarts (worker side; ``tensorboard:`` in the job).

Every point is written at the run's **global step** (``Position.step``: training batches run in
the whole run, restored from the checkpoint), so the curves of all attempts lie on one axis:
per epoch (``epoch_loss``, ``epoch_accuracy``, ``epoch_learning_rate``, and the validation
metrics under the ``validation`` run) and every ``every_steps`` steps (``batch_*``: the epoch's
running metrics so far, as Keras reports them, and the rate).

What a naive resume does: the killed attempt had written points past the checkpoint it is
resumed from, and the next one writes those steps again. Measured with Keras' own TensorBoard
callback, ``fit(initial_epoch=2)`` after a first ``fit`` that had written epoch 2 gives
TensorBoard's ``EventAccumulator`` the steps ``[0, 1, 2, 2, 3, 4]``. TensorBoard's own purge
does not save it: files written by ``tf.summary`` declare ``brain.Event:2``, for which the
readers no longer purge steps that go backwards and only honour a ``SessionLog.START`` marker;
``EventAccumulator`` (tensorboard 2.21) then purges only legacy ``simple_value`` scalars, never
the tensors ``tf.summary.scalar`` writes, and the loader a running TensorBoard uses
(``plugin_event_accumulator``) ignores the first START it sees.

What this module does: points written past the restored checkpoint's step by a killed attempt
are **dropped**, and the resumed attempt writes those steps afresh (the same values when the
resume is exact). Two mechanisms, one for each kind of reader:

- ``repair``, before the attempt writes anything, rewrites the event files of each run folder
  (``train``, ``validation``) into one *history* file holding, for each tag and step up to the
  restored step, the last value written, in step order; the other files are then removed. Its
  name sorts before any file ``tf.summary`` writes (whose names start with the creation time),
  so a reader that opens the folder afresh (TensorBoard started later, its Rust data server,
  ``EventAccumulator``, pandas readers) sees every step once and in order, whatever the
  computers' clocks. The rewrite is idempotent: killed half-way (history replaced, old files
  not yet removed), the next attempt merges the same points to the same history.
- Each attempt's own file starts with ``SessionLog.START`` at the restored step + 1: a
  TensorBoard that was already watching, and had read the dropped points before they were
  dropped, purges every point from that step on (``plugin_event_accumulator``: every attempt
  writes one, so each resumed attempt's is not the first it sees).

Each point is flushed as it is written (before the checkpoint callback commits that step), so
a kill loses no point at or before the step the next attempt resumes from.
"""
from __future__ import annotations

import os
import sys
import time

import keras

from orchestrator.core.heartbeat import Position
from orchestrator.train.callbacks import get_learning_rate
from orchestrator.train.jobcode import JobError

RUNS = ("train", "validation")  # TensorBoard's runs (sub-folders), as Keras names them
# Sorts before every "events.out.tfevents.<seconds since 1970>..." file tf.summary creates.
HISTORY_FILE = "events.out.tfevents.0000000000.orchestrator.v2"
_TMP_FILE = ".history.tmp"  # no "tfevents" in the name: readers never look at it
_FILE_VERSION = "brain.Event:2"


def require() -> None:
    """Fail before training, in one line, when the job asks for TensorBoard logs that this
    environment cannot write (``tensorflow-cpu`` does not install ``tensorboard``, and then
    ``tf.summary.scalar`` raises ``TBNotInstalledError`` at the first point)."""
    try:
        import tensorboard  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "tensorboard":
            raise
        raise JobError(
            f"key 'tensorboard': the job asks for TensorBoard logs but the tensorboard package "
            f"is not installed for {sys.executable}: `pip install 'orchestrator[tensorboard]'` "
            f"(or `pip install tensorboard`), or set `tensorboard: false`",
            key="tensorboard") from None


def _event_files(folder: str) -> list[str]:
    """The event files TensorBoard reads in ``folder``, in the order it reads them."""
    from tensorboard.backend.event_processing import io_wrapper

    return sorted(n for n in os.listdir(folder) if io_wrapper.IsSummaryEventsFile(n))


def truncate(folder: str, step: int) -> int:
    """Rewrite ``folder``'s event files as one history file of the points at steps <= ``step``
    (the last value written for each tag and step, in step order) and remove the others.
    Returns how many points were dropped: past ``step``, or written again later."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    if not os.path.isdir(folder):
        return 0
    names = _event_files(folder)
    header, points, read = None, {}, 0
    for name in names:
        # RawEventFileLoader stops at a record cut short by a kill, as TensorBoard does.
        for raw in RawEventFileLoader(os.path.join(folder, name)).Load():
            event = event_pb2.Event.FromString(raw)
            what = event.WhichOneof("what")
            if what == "file_version":
                header = header or raw  # the first file's: its time is the run's start
                continue
            if what == "session_log":
                continue  # earlier attempts' START markers: the history needs none
            read += 1
            if event.step <= step:
                key = (event.step, what, tuple(v.tag for v in event.summary.value))
                points.pop(key, None)
                points[key] = raw  # the last one written wins
    dropped = read - len(points)
    if names == [HISTORY_FILE] and not dropped:
        return 0  # already what a rewrite would give
    if points:
        if header is None:
            header = event_pb2.Event(wall_time=time.time(),
                                     file_version=_FILE_VERSION).SerializeToString()
        tmp = os.path.join(folder, _TMP_FILE)
        with open(tmp, "wb") as f:
            out = RecordWriter(f)
            out.write(header)
            for _, raw in sorted(points.items(), key=lambda kv: kv[0][0]):  # stable: by step
                out.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, HISTORY_FILE))
    for name in names:
        if name != HISTORY_FILE or not points:
            os.remove(os.path.join(folder, name))
    return dropped


def repair(log_dir: str, step: int) -> int:
    """``truncate`` each run folder of ``log_dir`` at the restored ``step``; points dropped."""
    return sum(truncate(os.path.join(log_dir, run), step) for run in RUNS)


class TensorBoardCallback(keras.callbacks.Callback):
    """Writes the scalars at the global step ``progress.step`` (kept by the ProgressCallback,
    which must come before this one); goes before the CheckpointCallback, so that the points of
    a step are on disk before that step's checkpoint commits."""

    def __init__(self, log_dir: str, every_steps: int, progress: Position, resumed_step: int):
        super().__init__()
        self.log_dir, self.every_steps, self.progress = log_dir, every_steps, progress
        self.resumed_step = resumed_step
        self._writers: dict = {}
        self._lr = None

    def _writer(self, run: str):
        import tensorflow as tf

        if run not in self._writers:
            w = tf.summary.create_file_writer(os.path.join(self.log_dir, run))
            self._start_marker(w)
            self._writers[run] = w
        return self._writers[run]

    def _start_marker(self, writer) -> None:
        """``SessionLog.START`` at the first step this attempt writes: a TensorBoard already
        watching purges the points past the restored step that it had read."""
        import tensorflow as tf
        from tensorboard.compat.proto import event_pb2

        resource = getattr(writer, "_resource", None)  # what tf.summary's own import_event uses
        if resource is None:
            print("[worker] tensorboard: this TensorFlow's summary writer takes no raw events; "
                  "a TensorBoard already watching may show the dropped points until it is "
                  "restarted", flush=True)
            return
        event = event_pb2.Event(wall_time=time.time(), step=self.resumed_step + 1,
                                session_log=event_pb2.SessionLog(
                                    status=event_pb2.SessionLog.START))
        tf.raw_ops.ImportEvent(writer=resource, event=tf.constant(event.SerializeToString()))

    def _write(self, run: str, prefix: str, scalars: dict) -> None:
        import tensorflow as tf

        if not scalars:
            return
        writer = self._writer(run)
        with writer.as_default():
            for name, value in scalars.items():
                tf.summary.scalar(prefix + name, float(value), step=self.progress.step)
        writer.flush()

    def on_epoch_begin(self, epoch, logs=None):
        self._lr = get_learning_rate(self.model.optimizer)  # the rate this epoch trains with

    def on_train_batch_end(self, batch, logs=None):
        if self.every_steps and self.progress.step % self.every_steps == 0:
            self._write("train", "batch_", {**(logs or {}), "learning_rate":
                                            get_learning_rate(self.model.optimizer)})

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        train = {k: v for k, v in logs.items() if not k.startswith("val_")}
        train["learning_rate"] = self._lr  # not ReduceLROnPlateau's end-of-epoch rate
        self._write("train", "epoch_", train)
        self._write("validation", "epoch_", {k[4:]: v for k, v in logs.items()
                                             if k.startswith("val_")})

    def on_train_end(self, logs=None):
        for w in self._writers.values():
            w.close()
        self._writers = {}

"""TensorBoard scalars that continue across restarts (worker side; ``tensorboard:`` in the job).

Every point is written at the run's global step, so all attempts lie on one axis. Points a
killed attempt wrote past the restored checkpoint are dropped: ``repair`` rewrites each run
folder into one *history* file before the attempt writes, and each attempt's own file starts
with ``SessionLog.START`` at the restored step + 1 for a TensorBoard already watching. Points
are flushed before the checkpoint commits their step (the writer:
``callbacks.TensorBoardCallback``). No TensorFlow on either backend: only what the
``tensorboard`` package ships that needs none; and no Keras here, so that ``require`` fails a
job before the framework's import. Why Keras' own callback and TensorBoard's purge do not do
it: ARCHITECTURE.md, "TensorBoard across restarts".
"""
from __future__ import annotations

import itertools
import os
import socket
import sys
import time

from orchestrator.train.errors import JobError

RUNS = ("train", "validation")  # TensorBoard's runs (sub-folders), as Keras names them
# Sorts before every "events.out.tfevents.<seconds since 1970>..." file tf.summary creates.
HISTORY_FILE = "events.out.tfevents.0000000000.orchestrator.v2"
_TMP_FILE = ".history.tmp"  # no "tfevents" in the name: readers never look at it
_FILE_VERSION = "brain.Event:2"
_writer_ids = itertools.count()  # the last part of an attempt's file name, as tf.summary's


def require() -> None:
    """Fail before training, in one line, when the job asks for TensorBoard logs that this
    environment cannot write (neither ``tensorflow-cpu`` nor JAX installs ``tensorboard``,
    whose writer this module uses; without it the first point would fail mid-epoch)."""
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
    """The event files TensorBoard reads in ``folder``, in the order it reads them (its rule,
    ``io_wrapper.IsSummaryEventsFile``, without the TensorFlow import that one makes)."""
    return sorted(n for n in os.listdir(folder) if "tfevents" in n)


def _records(path: str):
    """The records of one event file in order, up to the first one a kill cut short (or whose
    checksum fails), where TensorBoard's readers stop too."""
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    reader = PyRecordReader_New(path)
    try:
        while True:
            try:
                reader.GetNext()
            except (errors.OutOfRangeError, errors.DataLossError):
                return
            yield reader.record()
    finally:
        reader.file_handle.close()


class EventFile:
    """One attempt's event file in a run folder, named as ``tf.summary`` names its own
    (``events.out.tfevents.<seconds>.<host>.<pid>.<n>.v2``: after the history file), its first
    event the file version, its second ``SessionLog.START`` at the first step it may write."""

    def __init__(self, folder: str, first_step: int):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        os.makedirs(folder, exist_ok=True)
        name = "events.out.tfevents.%010d.%s.%s.%s.v2" % (
            time.time(), socket.gethostname(), os.getpid(), next(_writer_ids))
        self._file = open(os.path.join(folder, name), "wb")
        self._records = RecordWriter(self._file)
        self._add(event_pb2.Event(file_version=_FILE_VERSION))
        self._add(event_pb2.Event(step=first_step, session_log=event_pb2.SessionLog(
            status=event_pb2.SessionLog.START)))
        self.flush()

    def _add(self, event) -> None:
        event.wall_time = time.time()
        self._records.write(event.SerializeToString())

    def scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb

        self._add(event_pb2.Event(step=step, summary=scalar_pb(tag, float(value))))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate(folder: str, step: int) -> int:
    """Rewrite ``folder``'s event files as one history file of the points at steps <= ``step``
    (the last value written for each tag and step, in step order) and remove the others.
    Returns how many points were dropped: past ``step``, or written again later."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    if not os.path.isdir(folder):
        return 0
    names = _event_files(folder)
    header, points, read = None, {}, 0
    for name in names:
        for raw in _records(os.path.join(folder, name)):
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

"""TensorBoard across restarts: the job key, and the points an earlier attempt wrote past the
restored step dropped, as TensorBoard's own reader (EventAccumulator) sees them."""
import os
import shutil
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

import noimport
from orchestrator.core.spec import SpecError, TensorBoardSpec
from orchestrator.core.specload import load
from orchestrator.train import tensorboard as tb
from orchestrator.train.jobcode import JobError

JOB = "name: d\nmodel: a:b\ndata: a:c\nepochs: 1\nbatch_size: 1\n"


# --------------------------------------------------------------------------------------------
# The job key


def test_tensorboard_is_off_by_default_and_true_means_the_run_directory(write_job, tmp_path):
    run = str(tmp_path / "run")
    assert load(write_job(JOB), run_dir=run).tensorboard is None
    assert load(write_job(JOB + "tensorboard: false\n"), run_dir=run).tensorboard is None
    s = load(write_job(JOB + "tensorboard: true\n"), run_dir=run)
    assert s.tensorboard == TensorBoardSpec(dir=os.path.join(run, "tensorboard"),
                                            every_steps=TensorBoardSpec().every_steps)


def test_tensorboard_dir_is_relative_to_the_run_directory_and_every_steps_is_read(write_job,
                                                                                  tmp_path):
    run = str(tmp_path / "run")
    s = load(write_job(JOB + "tensorboard: logs/tb\n"), run_dir=run)
    assert s.tensorboard.dir == os.path.join(run, "logs", "tb")
    s = load(write_job(JOB + f"tensorboard: {{dir: {tmp_path}/tb, every_steps: 0}}\n"),
             run_dir=run)
    assert (s.tensorboard.dir, s.tensorboard.every_steps) == (f"{tmp_path}/tb", 0)
    plain = load(write_job(JOB), run_dir=run)
    assert s.training_hash() == plain.training_hash()  # logs do not decide the model


@pytest.mark.parametrize("value, key, expected", [
    ("3", "tensorboard", "expected true, false, a log directory or a mapping"),
    ("{dirr: x}", "tensorboard.dirr", "unknown key; expected one of: dir, every_steps"),
    ("{every_steps: -1}", "tensorboard.every_steps", "expected an integer >= 0, got -1"),
    ("{every_steps: often}", "tensorboard.every_steps", "expected an integer >= 0"),
    ("{dir: ''}", "tensorboard.dir", "expected a non-empty string"),
])
def test_tensorboard_key_errors_name_file_line_and_key(write_job, value, key, expected):
    path = write_job(JOB + f"tensorboard: {value}\n")
    with pytest.raises(SpecError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}:6: key '{key}'"), str(e.value)
    assert expected in str(e.value)


def test_a_job_asking_for_tensorboard_without_it_installed_fails_naming_key_and_extra(
        monkeypatch):
    tb.require()  # installed here (the test extra brings it)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an import then finds: none
    with pytest.raises(JobError) as e:
        tb.require()
    assert e.value.key == "tensorboard"
    assert "key 'tensorboard'" in str(e.value)
    assert "pip install 'orchestrator[tensorboard]'" in str(e.value)


# --------------------------------------------------------------------------------------------
# The step logic, on event files written as tf.summary writes them (one file per writer, named
# by its creation time, "brain.Event:2", one tagged value per event)


def _write(folder, stamp, points, cut=0):
    """An attempt's event file: ``points`` [(tag, step, value)]; ``cut`` bytes cut off its end
    (a record cut short by a kill)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"events.out.tfevents.{stamp:010d}.host.{stamp % 1000}.0.v2")
    with open(path, "wb") as f:
        w = RecordWriter(f)
        w.write(event_pb2.Event(wall_time=stamp, file_version="brain.Event:2")
                .SerializeToString())
        for tag, step, value in points:
            w.write(event_pb2.Event(wall_time=stamp + step, step=step, summary=summary_pb2.Summary(
                value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)]))
                .SerializeToString())
    if cut:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - cut)
    return path


def _read(folder):
    """{tag: [(step, value)]} as TensorBoard's reader gives them."""
    acc = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _attempt(first, last, every=1, value=0.0):
    return [(tag, s, s + value) for s in range(first, last + 1, every) for tag in ("loss", "acc")]


def test_a_naive_resume_shows_steps_twice_and_the_repair_gives_each_step_once(tmp_path):
    naive, fixed = str(tmp_path / "naive"), str(tmp_path / "fixed")
    for folder in (naive, fixed):
        _write(folder, 1700000000, _attempt(1, 6))  # killed at step 6, resumed from step 4
    _write(naive, 1700000100, _attempt(5, 8, value=0.5))
    assert [s for s, _ in _read(naive)["loss"]] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    repaired = str(tmp_path / "repaired")
    shutil.copytree(naive, repaired)  # such a log, repaired at a later resume: the later wins
    assert tb.truncate(repaired, 8) == 4
    assert _read(repaired)["acc"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0),
                                      (5, 5.5), (6, 6.5), (7, 7.5), (8, 8.5)]

    assert tb.truncate(fixed, 4) == 4  # steps 5 and 6 of both tags
    assert os.listdir(fixed) == [tb.HISTORY_FILE]
    _write(fixed, 1700000100, _attempt(5, 8, value=0.5))
    got = _read(fixed)
    for tag in ("loss", "acc"):
        assert got[tag] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0),  # the first attempt's
                            (5, 5.5), (6, 6.5), (7, 7.5), (8, 8.5)]  # the resumed attempt's


def test_repeated_resumes_keep_one_history_in_step_order(tmp_path):
    folder = str(tmp_path / "train")
    _write(folder, 1700000000, _attempt(1, 6))
    tb.truncate(folder, 4)
    _write(folder, 1700000100, _attempt(5, 12, value=0.5))  # killed at 12, resumed from 10
    assert tb.truncate(folder, 10) == 4
    _write(folder, 1700000200, _attempt(11, 14, value=0.25))
    steps = [s for s, _ in _read(folder)["loss"]]
    assert steps == list(range(1, 15))
    assert tb.truncate(folder, 14) == 0 and os.listdir(folder) == [tb.HISTORY_FILE]
    assert tb.truncate(folder, 13) == 2 and tb.truncate(folder, 13) == 0  # idempotent


def test_a_history_written_whatever_the_clocks_is_read_first(tmp_path):
    # The new machine's clock is behind the old one's: its file sorts before the old one.
    folder = str(tmp_path / "train")
    _write(folder, 1700000500, _attempt(1, 6))
    tb.truncate(folder, 4)
    _write(folder, 1700000100, _attempt(5, 8, value=0.5))
    assert [s for s, _ in _read(folder)["loss"]] == list(range(1, 9))


def test_a_repair_killed_before_removing_the_old_files_repairs_to_the_same_history(tmp_path):
    once, twice = str(tmp_path / "once"), str(tmp_path / "twice")
    for folder in (once, twice):
        _write(folder, 1700000000, _attempt(1, 3))
        tb.truncate(folder, 3)
        _write(folder, 1700000100, _attempt(4, 9, value=0.5))
    old = os.path.join(twice, sorted(os.listdir(twice))[-1])
    shutil.copy(old, str(tmp_path / "old"))
    tb.truncate(once, 6)
    tb.truncate(twice, 6)
    shutil.copy(str(tmp_path / "old"), old)  # as if killed after the history was replaced
    tb.truncate(twice, 6)
    assert _read(twice) == _read(once)
    assert [s for s, _ in _read(once)["acc"]] == [1, 2, 3, 4, 5, 6]


def test_a_record_cut_short_by_the_kill_is_left_out(tmp_path):
    folder = str(tmp_path / "train")
    _write(folder, 1700000000, _attempt(1, 6), cut=5)
    tb.truncate(folder, 10)
    got = _read(folder)
    assert [s for s, _ in got["loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in got["acc"]] == [1, 2, 3, 4, 5]  # step 6 of acc was the cut record


def test_a_fresh_start_drops_every_earlier_point(tmp_path):
    folder = str(tmp_path / "train")
    _write(folder, 1700000000, _attempt(1, 6))
    assert tb.truncate(folder, 0) == 12
    assert os.listdir(folder) == []
    assert tb.repair(str(tmp_path / "absent"), 0) == 0


# --------------------------------------------------------------------------------------------
# The callback itself: a TensorBoard that was already watching, and no TensorFlow on JAX

TESTS = os.path.dirname(os.path.abspath(__file__))


def _model():
    import keras

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    return model


def _callback_attempt(model, log_dir, resumed_step, last_step, spe=4):
    """One attempt's callback, from the step after ``resumed_step`` to ``last_step`` (killed
    there unless it is the end of an epoch), batch points every 2 steps."""
    from orchestrator.core.heartbeat import Position
    from orchestrator.train.callbacks import TensorBoardCallback

    progress = Position()
    progress.step = resumed_step
    cb = TensorBoardCallback(str(log_dir), 2, progress, resumed_step)
    cb.set_model(model)
    cb.on_train_begin()
    while progress.step < last_step:
        epoch = progress.step // spe
        cb.on_epoch_begin(epoch)
        while progress.step < min(last_step, (epoch + 1) * spe):
            progress.step += 1
            cb.on_train_batch_end(0, {"loss": 10.0 * progress.step})
        if progress.step == (epoch + 1) * spe:
            cb.on_epoch_end(epoch, {"loss": float(epoch), "val_loss": epoch + 0.5})
    return cb


def _assert_each_step_once(log_dir, *readers):
    fresh = EventAccumulator(os.path.join(log_dir, "train"), size_guidance={"tensors": 0})
    fresh.Reload()
    for acc in readers + (fresh,):
        assert [e.step for e in acc.Tensors("batch_loss")] == [2, 4, 6, 8, 10, 12]
        assert [e.step for e in acc.Tensors("epoch_loss")] == [4, 8, 12]
        assert [e.step for e in acc.Tensors("epoch_learning_rate")] == [4, 8, 12]
    assert [e.tensor_proto.float_val[0] for e in fresh.Tensors("batch_loss")] == [
        20.0, 40.0, 60.0, 80.0, 100.0, 120.0]
    val = EventAccumulator(os.path.join(log_dir, "validation"), size_guidance={"tensors": 0})
    val.Reload()
    assert val.Tags()["tensors"] == ["epoch_loss"]
    assert [e.step for e in val.Tensors("epoch_loss")] == [4, 8, 12]
    assert sorted(os.listdir(os.path.join(log_dir, "train")))[0] == tb.HISTORY_FILE


def test_the_resumed_attempt_s_start_marker_purges_what_a_watching_tensorboard_had_read(
        tmp_path):
    from tensorboard.backend.event_processing import plugin_event_accumulator

    model = _model()
    log_dir, train = str(tmp_path / "tb"), str(tmp_path / "tb" / "train")
    _callback_attempt(model, log_dir, 0, 7)  # killed after step 7, resumed from step 5
    # What a running TensorBoard reads with (its Python loader); it honours SessionLog.START
    # for tensor scalars, where the legacy EventAccumulator purges none.
    watching = plugin_event_accumulator.EventAccumulator(train, size_guidance={"tensors": 0})
    watching.Reload()
    assert [e.step for e in watching.Tensors("batch_loss")] == [2, 4, 6]
    assert tb.repair(log_dir, 5) == 2  # batch_loss and batch_learning_rate at step 6
    _callback_attempt(model, log_dir, 5, 12).on_train_end()
    watching.Reload()
    _assert_each_step_once(log_dir, watching)


@pytest.mark.integration
@pytest.mark.parametrize("tensorflow", ["not importable", "installed"])
def test_a_jax_worker_writes_and_repairs_the_logs_without_tensorflow(tmp_path, tensorflow):
    # A TPU VM has no TensorFlow; a GPU runtime has it, and a JAX worker must not import it.
    site, log_dir = tmp_path / "site", str(tmp_path / "tb")
    env = (noimport.env_without(site, "tensorflow") if tensorflow == "not importable" else
           dict(os.environ, PYTHONPATH=noimport.ROOT))
    env["KERAS_BACKEND"] = "jax"
    code = (f"import sys; sys.path.insert(0, {TESTS!r})\n"
            "import keras\n"
            "from test_tensorboard import _callback_attempt, _model, tb\n"
            "assert keras.backend.backend() == 'jax', keras.backend.backend()\n"
            "model = _model()\n"
            f"_callback_attempt(model, {log_dir!r}, 0, 7)\n"
            f"print('dropped', tb.repair({log_dir!r}, 5))\n"
            f"_callback_attempt(model, {log_dir!r}, 5, 12).on_train_end()\n"
            "print('tensorflow imported:', 'tensorflow' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "dropped 2\n" in p.stdout and "tensorflow imported: False\n" in p.stdout, p.stdout
    _assert_each_step_once(log_dir)


def test_a_job_asking_for_tensorboard_without_it_fails_before_the_framework_is_imported(
        monkeypatch):
    """The worker's configure and the doctor's job check name the key before the seconds of a
    TensorFlow or JAX import."""
    from types import SimpleNamespace

    from orchestrator.train import attempt, jobcheck, jobcode
    from orchestrator.train.jobcode import JobError

    def imported(*a, **kw):
        raise AssertionError("the framework was imported first")

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed
    monkeypatch.setattr(jobcode, "import_framework", imported)
    spec = SimpleNamespace(tensorboard=SimpleNamespace(dir="tb"), backend="tensorflow",
                           standby="off")
    for check in (lambda: attempt.configure(spec, 0.0), lambda: jobcheck.check(spec)):
        with pytest.raises(JobError, match="key 'tensorboard'"):
            check()

"""The background checkpoint writer (no TensorFlow): at most one write in flight, wait or skip
when one falls due while the previous is still writing (journaled), and a write that fails is
raised on the training thread, never dropped."""
import errno
import threading

import pytest

from orchestrator.checkpoint import writer as w
from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal


def _writer(tmp_path, background=True):
    journal = Journal(str(tmp_path / "events.jsonl"))
    cw = w.CheckpointWriter(background=background,
                            journal=lambda event, **f: journal.append(event, **f))
    return cw, journal


def _blocked_write(gate: threading.Event, started: threading.Event):
    def work():
        started.set()
        assert gate.wait(10)
    return work


def test_a_write_runs_beside_the_training_thread_and_the_end_waits_for_it(tmp_path):
    cw, journal = _writer(tmp_path)
    gate, started = threading.Event(), threading.Event()
    assert cw.admit(10, w.PERIODIC) == 0.0
    cw.submit(10, _blocked_write(gate, started), stall_ms=1.5, reason=w.PERIODIC)
    assert started.wait(5)
    assert cw.busy()  # submit returned while the write is still going on
    threading.Timer(0.2, gate.set).start()
    assert cw.drain() >= 150  # the end of the run waits for the last write
    written = journal.events(Event.CHECKPOINT_WRITTEN)
    assert [(e["step"], e["writer"], e["stall_ms"]) for e in written] == [(10, "background", 1.5)]
    assert written[0]["write_ms"] >= 150
    cw.close()


def test_busy_skips_a_periodic_one_then_waits_and_always_waits_for_epoch_ends(tmp_path):
    cw, journal = _writer(tmp_path)
    gate, started = threading.Event(), threading.Event()
    cw.admit(10, w.PERIODIC)
    cw.submit(10, _blocked_write(gate, started), stall_ms=1.0)
    assert started.wait(5)
    assert cw.admit(20, w.PERIODIC) is None  # skipped: the write of step 10 goes on
    threading.Timer(0.2, gate.set).start()
    waited = cw.admit(30, w.PERIODIC)  # never two skips in a row: this one waits
    assert waited >= 150
    skipped = journal.events(Event.CHECKPOINT_SKIPPED_BUSY)
    assert [(e["step"], e["writing_step"], e["reason"]) for e in skipped] == [(20, 10, "periodic")]
    waits = journal.events(Event.CHECKPOINT_WAITED)
    assert [(e["step"], e["writing_step"]) for e in waits] == [(30, 10)]
    assert waits[0]["wait_ms"] == waited and "skipped" in waits[0]["why"]

    for reason in (w.EPOCH_END, w.PREEMPTION, w.FINAL):  # never skipped, even the first time
        gate2, started2 = threading.Event(), threading.Event()
        cw.submit(40, _blocked_write(gate2, started2), stall_ms=1.0)
        assert started2.wait(5)
        threading.Timer(0.1, gate2.set).start()
        assert cw.admit(45, reason) >= 50
    reasons = [e["reason"] for e in journal.events(Event.CHECKPOINT_WAITED)]
    assert reasons == ["periodic", "epoch_end", "preemption", "final"]
    cw.close()


def test_a_free_writer_takes_every_checkpoint_and_journals_no_decision(tmp_path):
    cw, journal = _writer(tmp_path)
    for step in (10, 20, 30):
        assert cw.admit(step, w.PERIODIC) == 0.0
        cw.submit(step, lambda: None, stall_ms=1.0)
        cw.drain()
    assert not journal.events(Event.CHECKPOINT_SKIPPED_BUSY)
    assert not journal.events(Event.CHECKPOINT_WAITED)
    assert len(journal.events(Event.CHECKPOINT_WRITTEN)) == 3
    cw.close()


def _disk_full(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"))

    def payload(d):
        raise OSError(errno.ENOSPC, "No space left on device", d)

    return lambda: store.commit(7, payload, {"epoch": 0}), store


def test_a_failed_background_write_is_raised_at_the_next_step_boundary(tmp_path):
    cw, journal = _writer(tmp_path)
    work, store = _disk_full(tmp_path)
    cw.admit(7, w.PERIODIC)
    cw.submit(7, work, stall_ms=1.0)
    cw._pending.exception(timeout=10)  # the write has failed (in the writer's thread)
    with pytest.raises(OSError) as e:
        cw.check()  # what the checkpoint callback calls at every step boundary
    assert e.value.errno == errno.ENOSPC
    assert store.list() == [] and not journal.events(Event.CHECKPOINT_WRITTEN)
    assert not [n for n in (tmp_path / "ck").iterdir()]  # its temporary directory is gone
    cw.close()


@pytest.mark.parametrize("call", ["admit", "drain", "close"])
def test_a_failed_write_is_raised_by_the_next_checkpoint_and_by_the_end(tmp_path, call):
    cw, _ = _writer(tmp_path)
    work, _ = _disk_full(tmp_path)
    cw.submit(7, work, stall_ms=1.0)
    with pytest.raises(OSError) as e:
        cw.admit(8, w.EPOCH_END) if call == "admit" else getattr(cw, call)()
    assert e.value.errno == errno.ENOSPC


def test_close_while_failing_reports_a_write_error_without_hiding_the_first(tmp_path, capsys):
    cw, _ = _writer(tmp_path)
    work, _ = _disk_full(tmp_path)
    cw.submit(7, work, stall_ms=1.0)
    cw.close(failing=True)
    assert "No space left on device" in capsys.readouterr().err


def test_inline_mode_writes_on_the_callers_thread(tmp_path):
    cw, journal = _writer(tmp_path, background=False)
    seen = []
    cw.admit(5, w.PERIODIC)
    cw.submit(5, lambda: seen.append(threading.current_thread()), stall_ms=2.0)
    assert seen == [threading.current_thread()] and not cw.busy()
    (e,) = journal.events(Event.CHECKPOINT_WRITTEN)
    assert e["writer"] == "inline" and e["stall_ms"] >= 2.0
    work, _ = _disk_full(tmp_path)
    with pytest.raises(OSError):
        cw.submit(7, work, stall_ms=1.0)


def test_an_unknown_reason_is_refused(tmp_path):
    cw, _ = _writer(tmp_path)
    with pytest.raises(ValueError, match="expected one of"):
        cw.admit(1, "whenever")

"""Where a resumed attempt starts and when it says it is not exact; its checkpoint's read, beside
the framework's import (no TensorFlow)."""
from helpers import run_with_a_checkpoint, watch_reads
from orchestrator.train.resume import NOT_DETERMINISTIC, plan


def _m(**kw):
    return dict({"epoch": 2, "batch": 5, "step": 95, "global_batch": 32, "replicas": 8,
                 "history": [{"epoch": 1}, {"epoch": 2}]}, **kw)


def test_fresh_start():
    p = plan(None, global_batch=32, steps_per_epoch=45, deterministic=True)
    assert (p.epoch, p.batch, p.step, p.history, p.not_exact) == (0, 0, 0, [], [])


def test_same_strategy_resumes_at_the_next_batch_exactly():
    p = plan(_m(), global_batch=32, steps_per_epoch=45, deterministic=True)
    assert (p.epoch, p.batch, p.step, p.mid_epoch) == (2, 5, 95, True)
    assert len(p.history) == 2 and p.not_exact == [] and not p.stopped_early


def test_without_determinism_the_resume_says_so():
    p = plan(_m(), global_batch=32, steps_per_epoch=45, deterministic=False)
    assert p.not_exact == [NOT_DETERMINISTIC]


def test_8_replicas_to_1_translates_the_position_by_examples():
    p = plan(_m(), global_batch=4, steps_per_epoch=360, deterministic=True)
    assert p.batch == 40 and p.step == 95
    assert len(p.not_exact) == 1 and "global batch changed from 32 (8 replica(s)) to 4" \
        in p.not_exact[0]


def test_1_replica_to_8_rounds_down_and_names_the_repeated_examples():
    p = plan(_m(batch=43, global_batch=4, replicas=1), global_batch=32, steps_per_epoch=45,
             deterministic=True)
    assert p.batch == 5  # 172 examples seen: 5 batches of 32 = 160, 12 are trained again
    assert "12 example(s) are trained on twice" in p.not_exact[1]


def test_stopped_early_and_an_old_position_past_the_epoch():
    assert plan(_m(stopped_early=True), global_batch=32, steps_per_epoch=45,
                deterministic=True).stopped_early
    assert plan(_m(batch=50), global_batch=32, steps_per_epoch=45, deterministic=True).batch == 44


def test_fit_segments_finish_the_interrupted_epoch_first():
    mid = plan(_m(), global_batch=32, steps_per_epoch=45, deterministic=True)
    assert mid.segments(5) == [(2, 3, 5), (3, 5, 0)]
    assert mid.segments(3) == [(2, 3, 5)]
    assert plan(_m(batch=0), global_batch=32, steps_per_epoch=45,
                deterministic=True).segments(5) == [(2, 5, 0)]
    assert plan(None, global_batch=32, steps_per_epoch=45, deterministic=True).segments(2) == [
        (0, 2, 0)]


# ---------------------------------------------------------------- the read, beside the import
def test_a_cold_attempt_reads_its_checkpoint_while_the_framework_imports(fake_job,
                                                                          monkeypatch):
    import time

    import pytest

    from orchestrator.core.heartbeat import Position
    from orchestrator.train import attempt

    spec, layout, _ = run_with_a_checkpoint(fake_job())
    seen, done = watch_reads(monkeypatch)

    class Imported(Exception):
        pass

    def configure(spec, t0):  # the framework's import: over once the read is (or 10 s passed)
        seen["read during the import"] = done.wait(10)
        raise Imported

    monkeypatch.setattr(attempt, "configure", configure)
    with pytest.raises(Imported):
        attempt.cold(spec, layout, 2, Position(), time.time())
    assert seen == {"thread": "checkpoint-read", "step": 30, "read during the import": True}


def test_the_read_beside_gives_what_a_read_in_place_gives_and_raises_where_it_is_used(
        fake_job, monkeypatch):
    import numpy as np
    import pytest

    from orchestrator.checkpoint.blobs import BlobError
    from orchestrator.train import attempt, resume

    spec, layout, arrays = run_with_a_checkpoint(fake_job())
    beside = attempt.read_beside(spec, layout, 2, 0).result(timeout=10)
    here = attempt.read(spec, layout, 2, 0)
    assert beside.latest.step == here.latest.step == 30
    assert beside.arrays.keys() == here.arrays.keys() == arrays.keys()
    assert all(np.array_equal(beside.arrays[k], arrays[k]) for k in arrays)

    def unreadable(store, rank, skipped):
        raise BlobError("a blob of step 30 reads back short")

    monkeypatch.setattr(resume, "restore_point", unreadable)
    failing = attempt.read_beside(spec, layout, 2, 0)  # started: it raises nothing here
    with pytest.raises(BlobError, match="reads back short"):
        failing.result(timeout=10)

"""Two tiers, the commit marker, retention, and the durable mirror under Drive-like failures."""
import errno
import os
import threading
import time

import numpy as np
import pytest

import ckarrays
from drivefaults import DriveFaults
from orchestrator.checkpoint.store import COMMIT_MARKER, CheckpointStore, Retention
from orchestrator.core.journal import Journal
from orchestrator.checkpoint.mirror import DurableMirror
from orchestrator.checkpoint.tiers import TieredStore, is_durable


def _arrays(text):
    return ckarrays.arrays_of(text, repeat=1000)


def _commit(store, step, epoch=None, metrics=None):
    return store.commit(step, None, {"epoch": epoch if epoch is not None else step, "batch": 0,
                                     "metrics": metrics or {}}, arrays=_arrays(f"step {step}"))


def _blob(store, step):
    return ckarrays.blob_path(store.list()[[c.step for c in store.list()].index(step)])


@pytest.fixture
def tiers(tmp_path):
    return TieredStore(str(tmp_path / "local"), str(tmp_path / "drive" / "checkpoints"))


def _mirror(tiers, tmp_path, retention=Retention(keep=10), **kw):
    journal = Journal(str(tmp_path / "events.jsonl"))
    m = DurableMirror(tiers, journal, retention, backoff_initial=0.01, backoff_max=0.05, **kw)
    return m, journal


def _events(journal, kind):
    return [e for e in journal.events() if e["event"] == kind]


def _durable_verified(tiers):
    return [c.step for c in tiers.durable.list() if tiers.durable.verify(c.path) is None]


# ------------------------------------------------------------------ commit marker
def test_a_directory_without_its_commit_marker_is_not_a_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path))
    c = _commit(store, 1)
    os.remove(os.path.join(c.path, COMMIT_MARKER))  # a non-atomic rename, seen half done
    assert store.verify(c.path).startswith("commit marker COMMITTED missing")
    assert store.latest_valid() is None


def test_a_stale_commit_marker_does_not_validate_a_new_manifest(tmp_path):
    store = CheckpointStore(str(tmp_path))
    c = _commit(store, 1)
    with open(os.path.join(c.path, "manifest.json"), "a") as f:
        f.write(" ")
    assert store.verify(c.path) == "commit marker does not match the manifest"


# ------------------------------------------------------------------ retention
def _fake(step, epoch, batch=0, **metrics):
    from orchestrator.checkpoint.store import Checkpoint
    return Checkpoint(step, f"/x/{step}", {"epoch": epoch, "batch": batch, "metrics": metrics})


def test_retention_keeps_last_k_every_n_and_the_best():
    cps = [_fake(10 * e, e, val_loss=abs(e - 4) + 1.0) for e in range(1, 11)]
    cps.append(_fake(105, 10, batch=5))  # a mid-epoch checkpoint: never an every-N keeper
    r = Retention(keep=2, every_epochs=3, best_metric="val_loss", best_mode="min")
    assert r.select(cps) == {100, 105, 30, 60, 90, 40}
    assert Retention(keep=1, best_metric="val_loss", best_mode="max").select(cps) == {105, 100}
    assert Retention(keep=3).select(cps) == {90, 100, 105}


def test_retention_counts_only_verified_checkpoints(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for s in (1, 2, 3, 4):
        _commit(store, s)
    for s in (3, 4):  # the two newest are corrupt: the last 2 verified are 1 and 2
        with open(_blob(store, s), "r+b") as f:
            f.write(b"XX")
    store.retain(2)
    assert [c.step for c in store.list()] == [1, 2, 3, 4]  # nothing newer than 2 is deleted
    assert store.latest_valid().step == 2


def test_local_retention_never_deletes_a_checkpoint_that_is_not_durable(tiers):
    for s in range(1, 6):
        tiers.commit(s, None, {"epoch": s}, keep=2, arrays=_arrays(str(s)))
    assert [c.step for c in tiers.local.list()] == [1, 2, 3, 4, 5]  # none is durable yet
    from orchestrator.checkpoint.tiers import mark_durable
    for c in tiers.local.list()[:2]:
        mark_durable(c, "elsewhere")
    tiers.commit(6, None, {"epoch": 6}, keep=2, arrays=_arrays("6"))
    assert [c.step for c in tiers.local.list()] == [3, 4, 5, 6]


# ------------------------------------------------------------------ restore across tiers
def _three_in_both_tiers(tiers, tmp_path):
    """Steps 1-3 committed and mirrored: a copy of each in both tiers."""
    m, _ = _mirror(tiers, tmp_path)
    for s in (1, 2, 3):
        _commit(tiers, s)
    m.start()
    assert m.flush(30) == []
    m.stop()


def test_restore_takes_the_newest_copy_that_verifies_in_either_tier(tiers, tmp_path):
    _three_in_both_tiers(tiers, tmp_path)
    # newest: local copy corrupt, durable copy fine -> the durable copy of step 3
    h = ckarrays.blob_hash(tiers.local.list()[-1])
    with open(_blob(tiers.local, 3), "r+b") as f:
        f.write(b"X")
    skipped = []
    got = tiers.latest_valid(on_skip=lambda c, why: skipped.append((c.path, why)))
    assert got.path == tiers.durable.path_for(3)
    assert skipped == [(tiers.local.path_for(3), f"blob {h} of model.0000: checksum mismatch")]
    # and the durable copy of 3 truncated after its commit -> step 2, never a broken one
    with open(_blob(tiers.durable, 3), "r+b") as f:
        f.truncate(100)
    skipped.clear()
    got = tiers.latest_valid(on_skip=lambda c, why: skipped.append((c.step, why)))
    assert got.step == 2 and tiers.verify(got.path) is None
    assert [s for s, _ in skipped] == [3, 3] and "size 100 != 6000" in skipped[1][1]


def test_a_restore_reads_the_newest_intact_copy_hashing_each_blob_once_as_it_reads(
        tiers, tmp_path, monkeypatch):
    from orchestrator.checkpoint.blobset import BlobSet

    _three_in_both_tiers(tiers, tmp_path)
    hashed = []
    real = BlobSet.hashes_right
    monkeypatch.setattr(BlobSet, "hashes_right", lambda self, h: hashed.append(h) or real(self, h))
    got, arrays = tiers.latest_read()
    assert got.path == tiers.local.path_for(3) and hashed == []  # read_arrays hashes them
    assert all(np.array_equal(arrays[k], v) for k, v in _arrays("step 3").items())
    # the local copy corrupt: skipped as latest_valid says, the durable copy of 3 is read
    h = ckarrays.blob_hash(tiers.local.list()[-1])
    with open(_blob(tiers.local, 3), "r+b") as f:
        f.write(b"X")
    skipped = []
    got, arrays = tiers.latest_read(on_skip=lambda c, why: skipped.append((c.path, why)))
    assert got.path == tiers.durable.path_for(3)
    assert skipped == [(tiers.local.path_for(3), f"blob {h} of model.0000: checksum mismatch")]
    # the durable copy truncated too: step 2; a group's named step 3: none
    with open(_blob(tiers.durable, 3), "r+b") as f:
        f.truncate(100)
    assert tiers.latest_read()[0].step == 2
    assert tiers.latest_read(step=3) == (None, {})


def test_restore_uses_the_local_tier_while_drive_is_not_connected(tiers):
    for s in (1, 2):
        _commit(tiers, s)
    with DriveFaults(tiers.durable.root) as drive:
        drive.down(errno.ENOTCONN)
        assert tiers.latest_valid().path == tiers.local.path_for(2)
        assert tiers.durable_error.errno == errno.ENOTCONN
        assert "Transport endpoint is not connected" in str(tiers.durable_error)


# ------------------------------------------------------------------ the mirror
def test_mirror_copies_reads_back_and_marks_each_checkpoint(tiers, tmp_path):
    m, journal = _mirror(tiers, tmp_path)
    m.start()
    for s in (1, 2, 3):
        _commit(tiers, s)
        m.notify()
    assert m.flush(30) == []
    m.stop()
    assert _durable_verified(tiers) == [1, 2, 3]
    assert all(is_durable(c) for c in tiers.local.list())
    assert sorted(e["step"] for e in _events(journal, "checkpoint_durable")) == [1, 2, 3]


def test_a_durable_copy_cut_before_its_marker_goes_once_a_newer_one_verifies(tmp_path):
    """An earlier session's mirror lost the mount (or was killed) between the rename and the
    commit marker: that directory never becomes a checkpoint and, unless retention removes it,
    stays in the completed run's directory. While no newer copy verifies there they all stay;
    one whose marker does not verify is no cut copy, and stays for a look."""
    old = TieredStore(str(tmp_path / "old-vm"), str(tmp_path / "drive" / "checkpoints"))
    _three_in_both_tiers(old, tmp_path)
    os.remove(os.path.join(old.durable.path_for(1), COMMIT_MARKER))  # cut before its marker
    os.remove(os.path.join(old.durable.path_for(3), COMMIT_MARKER))
    with open(os.path.join(old.durable.path_for(2), COMMIT_MARKER), "w") as f:
        f.write("0" * 64)  # a marker that does not match: not cut short, kept for a look
    new = TieredStore(str(tmp_path / "new-vm"), old.durable.root)  # a new VM, resumed
    m, journal = _mirror(new, tmp_path)
    m.start()
    assert m.flush(30) == []
    assert [c.step for c in new.durable.list()] == [1, 2, 3]  # none verifies there yet
    _commit(new, 4)
    m.notify()
    assert m.flush(30) == []
    m.stop()
    assert [c.step for c in new.durable.list()] == [2, 4]
    assert _durable_verified(new) == [4]
    assert [e["steps"] for e in _events(journal, "checkpoints_retired")] == [[1, 3]]


@pytest.mark.parametrize("err", [errno.ENOTCONN, errno.EIO, errno.ENOSPC])
def test_durable_outage_is_journaled_retried_and_flushed(tiers, tmp_path, err):
    remounts = []
    m, journal = _mirror(tiers, tmp_path, remount=remounts.append, remount_every_s=0.0)
    _commit(tiers, 1)
    m.start()
    assert m.flush(30) == []
    with DriveFaults(tiers.durable.root) as drive:
        drive.down(err)
        for s in (2, 3, 4):
            _commit(tiers, s)
            m.notify()
        deadline = time.time() + 30
        while drive.failures < 3 and time.time() < deadline:
            time.sleep(0.01)
        assert m.unreachable and m.flush(0.2) == [4, 3, 2]
        drive.up()
        assert m.flush(30) == []
    m.stop()
    assert _durable_verified(tiers) == [1, 2, 3, 4]
    down = _events(journal, "durable_unreachable")
    assert len(down) == 1 and down[0]["errno"] == err and os.strerror(err) in down[0]["error"]
    backlogs = _events(journal, "durable_backlog")
    assert backlogs and backlogs[-1]["steps"] == [4, 3, 2]
    assert len(_events(journal, "durable_restored")) == 1
    # the remount hook is for a lost mount only
    assert (remounts[:1] == [tiers.durable.root]) == (err == errno.ENOTCONN)
    assert bool(remounts) == (err == errno.ENOTCONN)


def test_a_hung_durable_tier_never_blocks_a_local_commit(tiers, tmp_path):
    m, journal = _mirror(tiers, tmp_path)
    with DriveFaults(tiers.durable.root) as drive:
        drive.block()  # every durable call hangs (a wedged FUSE mount)
        m.start()
        _commit(tiers, 1)
        m.notify()
        deadline = time.time() + 30
        while drive.calls == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert drive.calls > 0  # the mirror is stuck in the durable tier ...
        done = threading.Event()

        def train():
            for s in (2, 3, 4):
                tiers.commit(s, None, {"epoch": s}, keep=2, arrays=_arrays(str(s)))
            done.set()

        threading.Thread(target=train, daemon=True).start()
        assert done.wait(30), "a local commit waited for the durable tier"  # ... commits don't
        drive.up()
        assert m.flush(30) == []
    m.stop()
    assert _durable_verified(tiers) == [1, 2, 3, 4]


def test_durable_folder_removed_or_replaced_by_a_file_is_recreated_and_refilled(tiers, tmp_path):
    import shutil
    m, journal = _mirror(tiers, tmp_path, retention=Retention(keep=2))
    m.start()
    for s in (1, 2):
        _commit(tiers, s)
        m.notify()
    assert m.flush(30) == []
    shutil.rmtree(tiers.durable.root)  # the folder was deleted on Drive
    with open(tiers.durable.root, "w") as f:  # ... and a file took its name
        f.write("not a folder")
    _commit(tiers, 3)
    m.notify()
    assert m.flush(0.5) == [3]  # a file in the way: retried (and 2 not yet known lost)
    os.remove(tiers.durable.root)
    assert m.flush(30) == []
    m.stop()
    assert _durable_verified(tiers) == [2, 3]  # all that retention keeps, verified
    assert _events(journal, "durable_unreachable")[0]["errno"] in (errno.ENOTDIR, errno.EEXIST)


def test_slow_durable_tier_still_flushes_everything_due(tiers, tmp_path):
    m, journal = _mirror(tiers, tmp_path, retention=Retention(keep=2, every_epochs=2))
    with DriveFaults(tiers.durable.root) as drive:
        drive.delay = 0.01
        m.start()
        for s in range(1, 6):
            _commit(tiers, s)
            m.notify()
        assert m.flush(60) == []
    m.stop()
    assert _durable_verified(tiers) == [2, 4, 5]
    assert [c.step for c in tiers.local.list()] == [4, 5]  # durable copies retired locally


def test_a_copy_that_does_not_read_back_is_retried(tiers, tmp_path, monkeypatch):
    from orchestrator.checkpoint.places import LocalPlace
    m, journal = _mirror(tiers, tmp_path)
    real = LocalPlace.write_file
    broken = {"left": 1}

    def copy_then_rot(place, key, src):  # Drive keeps a different byte than was written, once
        real(place, key, src)
        if key.startswith("blobs/") and broken["left"]:
            broken["left"] -= 1
            with open(place.path(key), "r+b") as f:
                f.write(b"?")
    monkeypatch.setattr(LocalPlace, "write_file", copy_then_rot)
    _commit(tiers, 1)
    m.start()
    assert m.flush(30) == []
    m.stop()
    assert _durable_verified(tiers) == [1]
    down = _events(journal, "durable_unreachable")
    assert "does not verify after the copy: blob " in down[0]["error"]
    assert "of model.0000: checksum mismatch" in down[0]["error"]


def test_a_local_copy_that_rots_during_its_upload_leaves_no_durable_copy(tiers, tmp_path,
                                                                         monkeypatch):
    """The local copy verified, then its bytes changed while they were copied (a fault flipping
    them; a failing disk): the durable copy read back bad. It was left in the durable tier, and a
    restore met it and skipped it beside the bad local one (seen in the suite)."""
    from orchestrator.checkpoint.places import LocalPlace
    m, journal = _mirror(tiers, tmp_path)
    real = LocalPlace.write_file

    def rot_then_copy(place, key, src):
        if key.startswith("blobs/"):
            with open(src, "r+b") as f:
                f.write(b"#")
        real(place, key, src)
    monkeypatch.setattr(LocalPlace, "write_file", rot_then_copy)
    _commit(tiers, 1)
    m.start()
    assert m.flush(30) == []
    m.stop()
    assert tiers.durable.list() == []
    assert [e["step"] for e in _events(journal, "checkpoint_skipped")] == [1]


def test_a_corrupt_local_copy_is_never_uploaded_and_a_recommit_is(tiers, tmp_path):
    m, journal = _mirror(tiers, tmp_path)
    _commit(tiers, 1)
    c2 = _commit(tiers, 2)
    with open(ckarrays.blob_path(c2), "r+b") as f:
        f.write(b"#")
    m.start()
    assert m.flush(30) == []
    assert _durable_verified(tiers) == [1] and tiers.durable.list()[-1].step == 1
    _commit(tiers, 2)  # the worker redid the epoch after skipping the corrupt copy
    m.notify()
    assert m.flush(30) == []
    m.stop()
    assert _durable_verified(tiers) == [1, 2]


@pytest.mark.parametrize("after", range(0, 40, 3))
def test_the_mount_dropping_between_any_two_calls_never_ends_the_mirror(tiers, tmp_path, after):
    first, _ = _mirror(tiers, tmp_path)
    for s in (1, 2):
        _commit(tiers, s)
    first.start()
    assert first.flush(30) == []
    first.stop()
    _commit(tiers, 3)
    m, journal = _mirror(tiers, tmp_path)  # a new session: verifies the durable tier again
    with DriveFaults(tiers.durable.root) as drive:
        drive.down_after(after, errno.ENOTCONN)
        m.start()
        deadline = time.time() + 30
        while not drive.failures and m.flush(0.05) and time.time() < deadline:
            pass
        drive.up()
        assert m.flush(30) == []
    assert m._thread.is_alive()
    m.stop()
    assert _durable_verified(tiers) == [1, 2, 3]
    assert len(_events(journal, "durable_unreachable")) == len(_events(journal, "durable_restored"))


def test_the_supervisors_bookkeeping_hashes_a_checkpoint_once_a_restore_every_time(
        tiers, tmp_path, monkeypatch):
    """Between a worker's death and the next one's start the supervisor asks for the newest
    checkpoint four times (the run complete? the epoch reached, journaled, started from): an
    unchanged copy it hashed already is not hashed again. A restore always hashes; a copy
    whose blob changed is hashed again, and a rotten one is passed over."""
    from orchestrator.checkpoint.blobset import BlobSet
    from orchestrator.supervise.ledger import CheckpointLedger

    hashed = []
    real = BlobSet.hashes_right
    monkeypatch.setattr(BlobSet, "hashes_right", lambda self, h: hashed.append(h) or real(self, h))
    _commit(tiers, 1)
    past = time.time() - 10  # written a while ago: not "racily clean" (BlobSet.vouched)
    for root, _, files in os.walk(tiers.local.root):
        for name in files:
            os.utime(os.path.join(root, name), (past, past))
    ledger = CheckpointLedger(tiers, Journal(str(tmp_path / "events.jsonl")), console=None,
                              on_progress=lambda: None, on_scanned=lambda: None)
    assert ledger.latest().step == 1 and hashed  # the first look hashes it
    hashed.clear()
    for _ in range(4):
        assert ledger.latest().step == 1
    assert hashed == []
    assert tiers.latest_valid().step == 1 and hashed  # a restore hashes again
    hashed.clear()
    with open(_blob(tiers.local, 1), "r+b") as f:
        f.write(b"X")  # same size; a new mtime
    assert ledger.latest() is None and hashed


def test_an_error_that_is_no_outage_is_journaled_once_and_the_mirror_lives_on(tiers, tmp_path,
                                                                              monkeypatch):
    """Not an OSError (a storage library's own exception type, a bug): before, the mirror's
    thread died of it and nothing was uploaded again, unseen."""
    m, journal = _mirror(tiers, tmp_path)
    real, calls = tiers.durable.commit_copy, []

    def fails_twice(c):
        calls.append(c.step)
        if len(calls) <= 2:
            raise ValueError("a library's own error")
        return real(c)

    monkeypatch.setattr(tiers.durable, "commit_copy", fails_twice)
    _commit(tiers, 1)
    m.start()
    assert m.flush(30) == []
    assert m.running and calls == [1, 1, 1]
    m.stop()
    assert _durable_verified(tiers) == [1]
    failed = _events(journal, "durable_mirror_failed")
    assert [e["error"] for e in failed] == ["ValueError: a library's own error"]
    assert failed[0]["retry_in_s"] == 0.01

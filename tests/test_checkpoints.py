import os

import pytest

import ckarrays
from orchestrator.checkpoint.store import CheckpointStore


def _payload(text):
    def write(d):
        with open(os.path.join(d, "notes.txt"), "wb") as f:
            f.write(text.encode())
    return write


def test_commit_is_listed_and_verifies(tmp_path):
    store = CheckpointStore(str(tmp_path / "c"))
    c = store.commit(10, _payload("a"), {"epoch": 1, "history": [{"epoch": 1}]},
                     arrays=ckarrays.arrays_of("abc"))
    assert c.epoch == 1 and c.step == 10 and c.path.endswith("0000000010")
    assert store.verify(c.path) is None
    assert [x.step for x in store.list()] == [10]
    assert c.manifest["files"]["notes.txt"]["size"] == 1 and c.manifest["format"] == 2
    assert c.manifest["arrays"][ckarrays.KEY]["shape"] == [3]
    assert (store.read_arrays(c.path)[ckarrays.KEY] == ckarrays.arrays_of("abc")[ckarrays.KEY]).all()


def test_latest_valid_falls_back_past_corrupt_and_reports(tmp_path):
    store = CheckpointStore(str(tmp_path))
    cs = [ckarrays.commit(store, e, f"epoch {e}") for e in (1, 2, 3)]
    with open(ckarrays.blob_path(cs[2]), "r+b") as f:
        f.write(b"X")  # same size, different bytes
    os.remove(os.path.join(store.path_for(2), "manifest.json"))
    skipped = []
    latest = store.latest_valid(on_skip=lambda c, why: skipped.append((c.step, why)))
    assert latest.step == 1
    assert skipped == [(3, f"blob {ckarrays.blob_hash(cs[2])} of model.0000: checksum mismatch"),
                       (2, "manifest missing or unreadable")]


def test_truncated_file_is_detected(tmp_path):
    store = CheckpointStore(str(tmp_path))
    c = ckarrays.commit(store, 1, "0123456789")
    with open(ckarrays.blob_path(c), "r+b") as f:
        f.truncate(3)
    assert "size 3 != 10" in store.verify(c.path, cached=True)


def test_failed_payload_leaves_nothing_committed(tmp_path):
    store = CheckpointStore(str(tmp_path))

    def boom(d):
        _payload("half")(d)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        store.commit(1, boom, {})
    assert store.list() == [] and store.place.children("") == []


def test_partial_dirs_of_dead_writers_are_ignored_then_removed(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.commit(1, _payload("a"), {})
    dead = tmp_path / ".tmp-0000000002-999999999-abcd1234"  # a pid that cannot exist
    dead.mkdir()
    (dead / "refs").write_bytes(b"half")
    assert [c.step for c in store.list()] == [1]
    assert store.remove_partial() == [dead.name]
    assert not dead.exists()


def test_retention_keeps_the_newest_k(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for e in range(1, 6):
        ckarrays.commit(store, e, str(e), keep=2)
    assert [c.step for c in store.list()] == [4, 5]


def test_retention_never_deletes_the_newest_verified_copy(tmp_path):
    store = CheckpointStore(str(tmp_path))
    ckarrays.commit(store, 1, "1")
    os.remove(ckarrays.blob_path(ckarrays.commit(store, 2, "2")))
    assert store.retain(1) == []
    assert store.latest_valid().step == 1


def test_recommit_of_a_corrupt_epoch_replaces_it(tmp_path):
    store = CheckpointStore(str(tmp_path))
    c = ckarrays.commit(store, 1, "old")
    with open(ckarrays.blob_path(c), "wb") as f:
        f.write(b"bad")
    c2 = ckarrays.commit(store, 1, "new")
    assert store.verify(c2.path) is None
    assert store.read_arrays(c2.path)[ckarrays.KEY].tobytes() == b"new"

"""Checkpoint format 2 (docs/checkpoint-format.md): arrays as content-addressed blobs. Frozen
arrays are written once per tier, a corrupt blob sends the restore to the previous checkpoint,
collection never takes a blob a kept checkpoint or a commit in flight names, the mirror uploads
only what the durable tier lacks, and format 1 still restores. Plain numpy arrays, no TF."""
import os
import shutil
import sys
import threading
import time

import numpy as np
import pytest

import ckarrays
from orchestrator.checkpoint import blobs
from orchestrator.checkpoint.mirror import DurableMirror
from orchestrator.checkpoint.store import CheckpointStore, Retention
from orchestrator.checkpoint.tiers import TieredStore
from orchestrator.core.journal import Journal

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoint_format1")


def _state(step: int, frozen_mb: float = 1.0) -> dict[str, np.ndarray]:
    """A frozen backbone (the same bytes at every step) and a head that changes."""
    n = int(frozen_mb * (1 << 20)) // 4
    return {"model.0000": np.random.default_rng(0).standard_normal(n).astype(np.float32),
            "model.0001": np.full((64,), step, np.float32),
            "optimizer.0000": np.array(step, np.int64)}


def _age_blobs(root, seconds=3600):
    """Make every blob older than a collection's grace (as minutes of training would)."""
    past = time.time() - seconds
    for dirpath, _dirs, files in os.walk(os.path.join(root, blobs.BLOBS)):
        for f in files:
            os.utime(os.path.join(dirpath, f), (past, past))


def _disk_bytes(root) -> int:
    return sum(ckarrays.blob_files(root).values())


def test_frozen_arrays_are_written_once_and_each_checkpoint_still_restores_whole(tmp_path):
    store = CheckpointStore(str(tmp_path))
    c1 = store.commit(1, None, {}, arrays=_state(1))
    first = _disk_bytes(tmp_path)
    assert first == sum(a.nbytes for a in _state(1).values())
    c2 = store.commit(2, None, {}, arrays=_state(2))
    changed = _state(2)["model.0001"].nbytes + _state(2)["optimizer.0000"].nbytes
    assert _disk_bytes(tmp_path) - first == changed  # the frozen MiB was not written again
    assert c2.manifest["bytes_written"] == changed and c2.manifest["blobs_reused"] == 1
    for c, step in ((c1, 1), (c2, 2)):
        assert store.verify(c.path) is None
        got = store.read_arrays(c.path)
        assert all(np.array_equal(got[k], a) and got[k].dtype == a.dtype
                   for k, a in _state(step).items())


def test_a_restore_reads_into_memory_without_huge_pages_and_leaves_numpys_switch_as_it_was(
        tmp_path, monkeypatch):
    """numpy asks huge pages for its large arrays; a restore's, filled once and let go, are
    taken with the hint off (their first touch cost 3x on this machine: BENCHMARKS.md)."""
    switch, calls = blobs._HUGEPAGE_SWITCH, []

    def recorded(on):
        calls.append(on)
        return switch(on)

    monkeypatch.setattr(blobs, "_HUGEPAGE_SWITCH", recorded)
    store = CheckpointStore(str(tmp_path))
    c = store.commit(1, None, {}, arrays=_state(1, frozen_mb=8.0))
    got = store.read_arrays(c.path)
    assert all(np.array_equal(got[k], a) for k, a in _state(1, frozen_mb=8.0).items())
    assert calls == [False, True] * 3  # off for each array's allocation, then back as it was
    assert switch(True) is True  # numpy's own setting: on


def test_large_arrays_are_chunked_so_a_partly_changed_one_rewrites_one_chunk(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr(blobs, "CHUNK_BYTES", 1 << 16)
    store = CheckpointStore(str(tmp_path))
    emb = np.arange(1 << 16, dtype=np.float32)  # 256 KiB: 4 chunks
    c1 = store.commit(1, None, {}, arrays={"model.0000": emb})
    emb2 = emb.copy()
    emb2[5] = -1.0  # one row of the first chunk
    c2 = store.commit(2, None, {}, arrays={"model.0000": emb2})
    assert len(c1.manifest["arrays"]["model.0000"]["chunks"]) == 4
    assert c2.manifest["bytes_written"] == 1 << 16 and c2.manifest["blobs_reused"] == 3
    assert np.array_equal(store.read_arrays(c2.path)["model.0000"], emb2)


def test_a_corrupt_blob_falls_back_to_the_previous_checkpoint_naming_blob_and_key(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.commit(1, None, {}, arrays=_state(1))
    c2 = store.commit(2, None, {}, arrays=_state(2))
    head = ckarrays.blob_path(c2, "model.0001")
    with open(head, "r+b") as f:
        f.write(b"\xff\xff")  # same size, other bytes
    h = ckarrays.blob_hash(c2, "model.0001")
    skipped = []
    got = store.latest_valid(on_skip=lambda c, why: skipped.append((c.step, why)))
    assert got.step == 1
    assert skipped == [(2, f"blob {h} of model.0001: checksum mismatch")]
    with pytest.raises(blobs.BlobError, match=f"blob {h} of model.0001: checksum mismatch"):
        store.read_arrays(c2.path)  # the reader hashes what it reads, too
    os.remove(head)
    assert store.verify(c2.path, cached=True) == f"blob {h} of model.0001: missing"


def test_collection_never_deletes_a_blob_a_kept_checkpoint_names(tmp_path):
    store = CheckpointStore(str(tmp_path), blob_grace_s=0.0)
    for step in (1, 2, 3):
        store.commit(step, None, {}, arrays=_state(step))
    frozen = ckarrays.blob_hash(store.list()[0], "model.0000")
    only_1 = ckarrays.blob_hash(store.list()[0], "model.0001")
    _age_blobs(tmp_path)
    assert [os.path.basename(p) for p in store.retain(2)] == ["0000000001"]
    left = ckarrays.blob_files(tmp_path)
    assert frozen in left and only_1 not in left  # shared by 2 and 3: kept; 1's own: gone
    for c in store.list():
        assert store.verify(c.path) is None
    # nothing but what the kept checkpoints name is left
    named = {h for c in store.list() for r in c.array_refs.values() for h, _ in r.chunks}
    assert set(left) == named


def test_a_young_unnamed_blob_outlives_a_collection(tmp_path):
    """A blob written moments ago by a commit whose reference list this collection missed."""
    store = CheckpointStore(str(tmp_path))  # the default grace
    store.commit(1, None, {}, arrays=_state(1))
    store.commit(2, None, {}, arrays=_state(2))
    store.remove(store.list()[0])
    assert store.collect_blobs() == []


class _PausingPlace:
    """The store's LocalPlace, with a pause where a commit writes ``pause_at``."""

    def __init__(self, place, pause_at):
        self._place, self.pause_at = place, pause_at
        self.reached, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._place, name)

    def write_bytes(self, key, data):
        if key.endswith(self.pause_at) and key.startswith(".tmp-"):
            self.reached.set()
            assert self.go.wait(30)
        self._place.write_bytes(key, data)


def _commit_in_thread(store, step):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(
        "c", store.commit(step, None, {}, arrays=_state(step))))
    t.start()
    return t, out


@pytest.mark.parametrize("pause_at", ["manifest.json", "refs"])
def test_a_commit_in_flight_keeps_its_blobs_from_a_concurrent_collection(tmp_path, pause_at):
    """The writer reuses the frozen blob of checkpoint 1 while another process (the mirror's
    retention) removes checkpoint 1 and collects: paused with its blobs written and its
    manifest not (the names come from its ``refs``), or paused before its ``refs`` exist."""
    writer = CheckpointStore(str(tmp_path), blob_grace_s=0.0)
    other = CheckpointStore(str(tmp_path), blob_grace_s=0.0)
    writer.commit(1, None, {}, arrays=_state(1))
    frozen = ckarrays.blob_hash(writer.list()[0], "model.0000")
    _age_blobs(tmp_path)
    writer.place = writer.blobs.place = _PausingPlace(writer.place, pause_at)
    t, out = _commit_in_thread(writer, 2)
    assert writer.place.reached.wait(30)
    other.remove(other.list()[0])
    if pause_at == "refs":  # the collection reads the names, then the commit goes on
        named = other.named_blobs

        def names_then_commit():
            got = named()
            writer.place.go.set()
            while t.is_alive() and not any(n.startswith(".tmp-") and os.path.exists(
                    os.path.join(tmp_path, n, "manifest.json")) for n in os.listdir(tmp_path)):
                time.sleep(0.001)  # the blobs are written once the manifest is
            return got
        other.named_blobs = names_then_commit
    deleted = other.collect_blobs()
    writer.place.go.set()
    t.join(30)
    c2 = out["c"]
    assert frozen not in deleted or os.path.exists(ckarrays.blob_path(c2))
    assert os.path.exists(ckarrays.blob_path(c2)) and writer.verify(c2.path) is None
    assert np.array_equal(writer.read_arrays(c2.path)["model.0000"], _state(2)["model.0000"])


def test_the_mirror_uploads_only_the_blobs_the_durable_tier_lacks(tmp_path):
    tiers = TieredStore(str(tmp_path / "local"), str(tmp_path / "drive"))
    journal = Journal(str(tmp_path / "events.jsonl"))
    m = DurableMirror(tiers, journal, Retention(keep=10), backoff_initial=0.01,
                      backoff_max=0.05).start()
    for step in (1, 2):
        tiers.commit(step, None, {"epoch": step}, arrays=_state(step))
        m.notify()
        assert m.flush(30) == []
    m.stop()
    first, second = journal.events("checkpoint_durable")
    whole = sum(a.nbytes for a in _state(1).values())
    head = whole - _state(1)["model.0000"].nbytes
    assert (first["blobs_uploaded"], first["blobs_reused"]) == (3, 0)
    assert (second["blobs_uploaded"], second["blobs_reused"]) == (2, 1)
    manifest = os.path.getsize(os.path.join(tiers.durable.path_for(2), "manifest.json"))
    assert second["bytes_uploaded"] == head + manifest and second["manifest_bytes"] == manifest
    assert first["bytes_uploaded"] >= whole
    assert _disk_bytes(tmp_path / "drive") == whole + head
    for c in tiers.durable.list():
        assert tiers.durable.verify(c.path) is None


def test_a_checkpoint_of_format_1_still_verifies_and_restores(tmp_path):
    sys.path.insert(0, FIXTURE)
    try:
        from make import arrays
    finally:
        sys.path.remove(FIXTURE)
    shutil.copytree(os.path.join(FIXTURE, "checkpoints"), tmp_path / "ck")
    store = CheckpointStore(str(tmp_path / "ck"))
    latest = store.latest_valid()
    assert latest.step == 20 and "arrays" not in latest.manifest
    from orchestrator.train import state  # no Keras import at module level: its readers only

    for c in store.list():
        got = state.load_arrays(c)
        want = arrays(c.step)
        assert sorted(got) == sorted(want)
        assert all(np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype
                   for k in want)
    # a format-2 commit beside them: both are listed, retention counts both
    store.commit(30, None, {"epoch": 3}, arrays=arrays(30), keep=2)
    assert [c.step for c in store.list()] == [20, 30]


def test_hashes_taken_in_two_threads_at_once_are_each_their_own_bytes(monkeypatch):
    """The mirror and the ledger hash blobs in two threads of the supervisor, each through a
    read buffer kept between calls: neither sees the other's bytes, across piece boundaries."""
    import io

    import xxhash

    monkeypatch.setattr(blobs, "PIECE_BYTES", 64)
    rng = np.random.default_rng(0)
    datas = [rng.bytes(n) for n in (1, 63, 64, 65, 200, 1000)]

    class Slow(io.BytesIO):  # hands the other thread the CPU with a piece just read
        def readinto(self, b):
            n = super().readinto(b)
            time.sleep(0.001)
            return n

    wrong = []

    def hash_all():
        for _ in range(20):
            for d in datas:
                if blobs.hash_stream(Slow(d)) != (xxhash.xxh3_128_hexdigest(d), len(d)):
                    wrong.append(len(d))

    threads = [threading.Thread(target=hash_all) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong

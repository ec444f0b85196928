"""The bucket tier (checkpoint/objectstore.py) against real servers on loopback: the GCS
emulator and moto's S3. A write counts only once the server acknowledged our checksum, a read
refuses bytes the server's checksum does not match, and an outage of the server surfaces as
the OSError the durable mirror retries."""
import errno
import os
import threading
import time

import pytest
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from objectstores import BUCKET, GcsEmulator, MotoS3
from orchestrator.checkpoint import objectstore
from orchestrator.checkpoint.objectstore import FsspecPlace

pytestmark = pytest.mark.integration


@pytest.fixture(params=["gs", "s3"])
def server(request, tmp_path, monkeypatch):
    if request.param == "gs":
        srv = GcsEmulator(str(tmp_path / "gcs")).start()
    else:
        srv = MotoS3().start()
        srv.create_bucket()
    for k, v in srv.env().items():
        monkeypatch.setenv(k, v)
    yield srv
    srv.close()


def place_on(srv, prefix="run") -> FsspecPlace:
    return FsspecPlace(f"{srv.scheme}://{BUCKET}/{prefix}", **srv.options())


def random_file(tmp_path, size: int, name="blob") -> tuple[str, bytes]:
    data = os.urandom(size)
    path = tmp_path / name
    path.write_bytes(data)
    return str(path), data


def test_blobs_and_manifests_round_trip(server, tmp_path, monkeypatch):
    """A blob (a file, in parts on S3: 3 parts of 5 MiB) and a manifest (bytes) go up, list,
    and come back byte for byte through both reads; delete_prefix leaves nothing."""
    import xxhash

    monkeypatch.setattr(objectstore, "S3_PART", 5 * 2**20)
    place = place_on(server)
    path, blob = random_file(tmp_path, 12 * 2**20 + 7)
    name = xxhash.xxh3_128_hexdigest(blob)
    place.write_file(f"blobs/{name[:2]}/{name}", path)
    place.write_bytes("0000000040/manifest.json", b'{"step": 40}')
    assert place.list() == sorted([f"blobs/{name[:2]}/{name}", "0000000040/manifest.json"])
    assert place.children() == ["0000000040", "blobs"]
    assert place.size(f"blobs/{name[:2]}/{name}") == len(blob) and place.size("nope") is None
    assert place.read_bytes(f"blobs/{name[:2]}/{name}", expect_xxh3=name) == blob
    with place.open_read(f"blobs/{name[:2]}/{name}") as f:
        assert f.read() == blob
    assert place.read_bytes("0000000040/manifest.json") == b'{"step": 40}'
    manifest_stat = place.stat_key("0000000040/manifest.json")
    if server.scheme == "s3":
        assert place._server_checksum(place._info(f"blobs/{name[:2]}/{name}")).endswith("-3")
    key = f"blobs/{name[:2]}/{name}"
    stat = place.stat_key(key)
    assert stat == place.stat_key(key) and stat[0] == len(blob) and isinstance(stat[1], int)
    assert abs(place.mtime(key) - time.time()) < 120 and place.mtime("blobs/zz/none") is None
    place.write_bytes("0000000040/manifest.json", b'{"step": 40, "again": 1}')
    assert place.read_bytes("0000000040/manifest.json") == b'{"step": 40, "again": 1}'
    assert place.stat_key("0000000040/manifest.json") != manifest_stat  # other bytes
    assert place.stat_key(key) == stat and place.stat_key("blobs/zz/none") is None
    place.delete_prefix("blobs")
    assert place.list() == ["0000000040/manifest.json"] and place.list("blobs") == []


def test_a_write_the_server_acknowledges_with_another_checksum_is_refused(server, tmp_path):
    """The bytes that reached the server are not the ones we hashed (changed on the way): the
    write raises EIO naming the key and both checksums, and the object is gone."""
    place = place_on(server)
    path, blob = random_file(tmp_path, 1 << 20)
    real_put = place.fs.put_file

    def put_changed_bytes(lpath, rpath, **kw):
        bad = tmp_path / "in-transit"
        bad.write_bytes(blob[:-1] + bytes([blob[-1] ^ 0xFF]))
        return real_put(str(bad), rpath, **kw)

    place.fs.put_file = put_changed_bytes
    with pytest.raises(OSError) as e:
        place.write_file("blobs/aa/x", path)
    assert e.value.errno == errno.EIO
    assert "write of blobs/aa/x" in str(e.value) and "checksum mismatch" in str(e.value)
    assert not place.exists("blobs/aa/x")


def test_bytes_changed_in_the_servers_storage_are_refused_on_read(server, tmp_path,
                                                                   monkeypatch):
    """The server keeps the checksum it acknowledged; the bytes behind it change. botocore
    (>= 1.36) also checks the CRC32 it sent with the upload: switched off here, so that what
    refuses the bytes is our own check (older clients, servers without that checksum)."""
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    place = place_on(server)
    path, blob = random_file(tmp_path, 256 * 1024)
    place.write_file("blobs/bb/y", path)
    server.overwrite_stored("run/blobs/bb/y", blob[:100] + bytes([blob[100] ^ 1]) + blob[101:])
    with pytest.raises(OSError) as e:
        place.read_bytes("blobs/bb/y")
    assert e.value.errno == errno.EIO and "read of blobs/bb/y" in str(e.value)
    with pytest.raises(OSError, match="read of blobs/bb/y: checksum mismatch"):
        place.open_read("blobs/bb/y")


def test_an_s3_bucket_encrypted_with_kms_is_checked_by_its_crc32_its_etag_being_no_md5(
        tmp_path, monkeypatch):
    """SSE-KMS by the bucket's default: writes (one part, and 3 parts of 5 MiB) are
    acknowledged by the CRC32 each upload asks S3 to keep, reads are checked by it, and
    bytes changed behind it are still refused (botocore's own check of the CRC32 switched off,
    as above)."""
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    monkeypatch.setattr(objectstore, "S3_PART", 5 * 2**20)
    srv = MotoS3().start()
    try:
        srv.create_bucket()
        srv.encrypt_with_kms(monkeypatch)
        place = place_on(srv)
        big, big_data = random_file(tmp_path, 12 * 2**20 + 7)
        small, small_data = random_file(tmp_path, 256 * 1024, "small")
        place.write_file("blobs/aa/big", big)
        place.write_file("blobs/bb/small", small)
        place.write_bytes("0000000040/manifest.json", b'{"step": 40}')
        info = place._info("blobs/aa/big")
        assert not info["etag_is_md5"] and info["ETag"].strip('"') != \
            objectstore._S3Digest(len(big_data)).hexdigest()  # the ETag AWS gives
        assert place._server_checksum(info).startswith("crc32:")
        with place.open_read("blobs/aa/big") as f:
            assert f.read() == big_data
        assert place.read_bytes("blobs/bb/small") == small_data
        assert place.read_bytes("0000000040/manifest.json") == b'{"step": 40}'
        srv.overwrite_stored("run/blobs/bb/small",
                             small_data[:100] + bytes([small_data[100] ^ 1]) + small_data[101:])
        with pytest.raises(OSError, match="read of blobs/bb/small: checksum mismatch, computed "
                                          "crc32:"):
            place.read_bytes("blobs/bb/small")
    finally:
        srv.close()


def test_a_server_stopped_for_10_s_is_an_outage_a_retried_write_loop_survives(server, tmp_path):
    """Writes go on while the server is down for 10 s, under the mirror's retry policy (retry
    on OSError, exponential backoff): every object written reads back afterwards. On S3 the
    outage surfaces as OSError (gcsfs retries a refused connection itself for ~30 s, so on GCS
    a write may just take longer)."""
    place = place_on(server)
    place.write_bytes("warm", b"up")
    failures, written = [], {}
    down_for = 10.0

    def outage():
        server.stop()
        time.sleep(down_for)
        server.start()

    retrying = Retrying(retry=retry_if_exception_type(OSError),
                        wait=wait_exponential(multiplier=0.2, max=2), stop=stop_after_delay(90),
                        before_sleep=lambda rs: failures.append(rs.outcome.exception()),
                        reraise=True)
    t0 = time.monotonic()
    stopper = threading.Thread(target=outage)
    stopper.start()
    i = 0
    while time.monotonic() - t0 < down_for + 3 or stopper.is_alive():
        data = os.urandom(1024 + i)
        for attempt in retrying:
            with attempt:
                place.write_bytes(f"loop/{i:04d}", data)
        written[f"loop/{i:04d}"] = data
        i += 1
        time.sleep(0.2)
    stopper.join()
    assert all(isinstance(f, OSError) for f in failures)
    # Whether a failure surfaces at all depends on the library's own retries against the
    # outage's length (botocore's spanned the 10 s beside the suite's other processes; gcsfs's
    # always do): what must hold is that any that did was an OSError (a botocore error would
    # not be retried: the loop would raise it) and that nothing was lost.
    assert place.list("loop") == sorted(written)
    assert all(place.read_bytes(k) == v for k, v in written.items())


def test_a_checkpoint_whose_blob_changed_in_the_bucket_is_skipped_for_the_previous_one(
        server, tmp_path, monkeypatch):
    """The store on a bucket (tiers.durable_store): the newest checkpoint's blob is changed in
    the server's storage; a restore skips it, naming the blob, and takes the one before."""
    from ckarrays import blob_hash, commit
    from orchestrator.checkpoint import blobs, tiers

    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")  # as above
    url = f"{server.scheme}://{BUCKET}/run"
    monkeypatch.setattr(tiers, "FsspecPlace", lambda u: FsspecPlace(u, **server.options()))
    store = tiers.durable_store(url)
    older = commit(store, 10, "older weights ", repeat=500)
    newer = commit(store, 20, "newer weights ", repeat=500)
    assert [c.step for c in store.list()] == [10, 20] and newer.path == f"{url}/0000000020"
    assert store.verify(newer.path) is None
    key = blobs.blob_key(blob_hash(newer))
    stored = store.place.read_bytes(key)
    server.overwrite_stored(f"run/{key}", bytes([stored[0] ^ 1]) + stored[1:])
    skipped = []
    latest = store.latest_valid(on_skip=lambda c, why: skipped.append((c.step, why)))
    assert latest is not None and latest.step == older.step
    assert skipped and skipped[0][0] == 20 and blob_hash(newer) in skipped[0][1], skipped
    assert store.read_arrays(latest.path)["model.0000"].tobytes() == b"older weights " * 500


def test_the_mirror_copies_checkpoints_to_the_bucket_reusing_the_blobs_it_has(
        server, tmp_path, monkeypatch):
    """The durable mirror over a bucket: three local checkpoints sharing most blobs go up,
    each read back and verified; the later ones upload only the blobs the bucket lacks."""
    import numpy as np

    from orchestrator.checkpoint import tiers
    from orchestrator.checkpoint.mirror import DurableMirror
    from orchestrator.core.journal import Journal
    from orchestrator.core.retention import Retention

    monkeypatch.setattr(tiers, "FsspecPlace", lambda u: FsspecPlace(u, **server.options()))
    store = tiers.TieredStore(str(tmp_path / "local"), f"{server.scheme}://{BUCKET}/run")
    frozen = {f"frozen{i}": np.full(256, i, dtype=np.float32) for i in range(8)}
    for step in (10, 20, 30):
        store.commit(step, None, {"epoch": 0},
                     arrays={**frozen, "head": np.full(64, step, dtype=np.float32)})
    journal = Journal(str(tmp_path / "events.jsonl"))
    mirror = DurableMirror(store, journal, Retention(keep=3), backoff_initial=0.1,
                           backoff_max=0.5)
    assert mirror._pass() == []
    copies = {e["step"]: e for e in journal.events() if e["event"] == "checkpoint_durable"}
    assert sorted(copies) == [10, 20, 30]
    assert all(e["path"].startswith(f"{server.scheme}://{BUCKET}/run/") for e in copies.values())
    assert sorted(e["blobs_uploaded"] for e in copies.values()) == [1, 1, 9]
    assert [c.step for c in store.durable.list()] == [10, 20, 30]
    assert all(store.durable.verify(c.path) is None for c in store.durable.list())

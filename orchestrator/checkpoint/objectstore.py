"""A checkpoint tier in a bucket (``gs://bucket/prefix`` through gcsfs, ``s3://`` through s3fs).

The same Place protocol as a folder (places.py), with what "durable" means for a bucket: a
write counts only once the server has acknowledged the object with the checksum WE computed
from the bytes we sent (GCS: the object's CRC32C; S3: its ETag, the MD5 of a single-part
object or the MD5 of the parts' MD5s for a multipart one, whose part size we choose; for an
object encrypted with SSE-KMS or SSE-C, whose ETag S3 documents as not an MD5 of its data, the
CRC32 S3 keeps because every upload asks for one). A mismatch deletes the object and raises
``OSError(EIO)``. A read is checked against the
server's checksum too (and against the caller's xxh3-128 where given), so bytes changed in the
bucket are refused rather than restored.

Every failure of the libraries (HTTP errors, a refused connection, botocore's errors) is
raised as an ``OSError``: the durable mirror retries those with backoff and journals the
outage (mirror.py). Credentials and endpoints are the libraries' own (Application Default
Credentials, ``STORAGE_EMULATOR_HOST``, ``AWS_ENDPOINT_URL``, fsspec's ``FSSPEC_GCS_*`` /
``FSSPEC_S3_*``): nothing here reads or copies them.
"""
from __future__ import annotations

import base64
import contextlib
import datetime
import errno
import hashlib
import importlib
import math
import os
import tempfile
import zlib
from typing import BinaryIO, Iterator

from orchestrator.core.spec import OBJECT_STORES, object_store_problem

CHUNK = 1 << 20
SIMPLE_MAX = 5 * 2**20       # below this, bytes go up in one request on both services
S3_PART = 50 * 2**20         # s3fs's default part size (ours, passed explicitly)
S3_MAX_PARTS = 10_000
S3_SINGLE_MAX = 5 * 2**30    # S3's largest single PUT
S3_CHECKSUM = "CRC32"        # the additional checksum every upload asks S3 to keep
# "Objects encrypted by SSE-C or SSE-KMS have ETags that are not an MD5 digest of their object
# data" (S3 API reference, Object: ETag); DSSE-KMS is KMS's
ETAG_NOT_MD5 = ("aws:kms", "aws:kms:dsse")
_LIBRARY_ERRORS = ("gcsfs", "s3fs", "fsspec", "botocore", "aiobotocore", "aiohttp", "google",
                   "requests", "urllib3")


def is_object_store(url: str) -> bool:
    return url.split("://", 1)[0] in OBJECT_STORES if "://" in url else False


class ChecksumMismatch(OSError):
    """The server holds other bytes than we sent or than it acknowledged."""

    def __init__(self, url: str, what: str, ours: str, theirs: str):
        super().__init__(errno.EIO, f"{what}: checksum mismatch, computed {ours}, the server "
                                    f"says {theirs}", url)


class FsspecPlace:
    """A bucket prefix as a Place (keys are '/'-separated paths below the prefix)."""

    def __init__(self, url: str, **storage_options):
        problem = object_store_problem(url)
        if problem:
            raise ValueError(problem)
        self.url = url.rstrip("/")
        self.scheme, rest = self.url.split("://", 1)
        self.root = rest
        library = OBJECT_STORES[self.scheme][0]
        fsspec = importlib.import_module("fsspec")
        importlib.import_module(library)  # object_store_problem checked it is installed
        options = {"use_listings_cache": False, "skip_instance_cache": True, **storage_options}
        self.fs = fsspec.filesystem(self.scheme, **options)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _key(self, path: str) -> str:
        return path[len(self.root) + 1:] if path.startswith(self.root + "/") else path

    # ---------------------------------------------------------------- checksums
    def _new_digest(self, size: int, info: dict | None = None) -> "_Crc32c | _S3Digest":
        """The checksum of ``size`` bytes in the server's forms: for a read, the form of the
        object's own (``info``: an S3 ETag with ``-N`` is a multipart one)."""
        if self.scheme == "gs":
            return _Crc32c()
        etag = (info or {}).get("ETag")
        return _S3Digest(size, multipart=None if not etag else "-" in etag)

    def _server_checksum(self, info: dict) -> str | None:
        """The checksum the server keeps for an object that ours can be compared with: GCS's
        CRC32C; S3's ETag, or ``crc32:`` and the CRC32 where the ETag is no MD5 (None: S3
        keeps none we can compare, an encrypted object uploaded without our checksum)."""
        if self.scheme == "gs":
            return info.get("crc32c")
        if info.get("etag_is_md5", True):
            etag = info.get("ETag")
            return etag.strip('"') if etag else None
        return f"crc32:{info['crc32']}" if info.get("crc32") else None

    def _info(self, key: str) -> dict:
        with _as_oserror(self.url, key):
            if self.scheme == "s3":
                return self._s3_head(key)
            self.fs.invalidate_cache(self.path(key))
            return self.fs.info(self.path(key))

    def _s3_head(self, key: str) -> dict:
        """HeadObject with the additional checksums (``ChecksumMode``) and the encryption,
        which s3fs's ``info`` leaves out, in ``info``'s keys."""
        bucket, name, _ = self.fs.split_path(self.path(key))
        h = self.fs.call_s3("head_object", Bucket=bucket, Key=name, ChecksumMode="ENABLED")
        return {"size": h.get("ContentLength"), "ETag": h.get("ETag"),
                "LastModified": h.get("LastModified"), "VersionId": h.get("VersionId"),
                "crc32": h.get("ChecksumCRC32"),
                "etag_is_md5": not (h.get("ServerSideEncryption") in ETAG_NOT_MD5
                                    or h.get("SSECustomerAlgorithm"))}

    def _acknowledged(self, key: str, digest: "_Crc32c | _S3Digest") -> None:
        """The object the server now holds carries our checksum, or it is deleted."""
        theirs = self._server_checksum(self._info(key))
        if theirs is None or not digest.matches(theirs):
            with contextlib.suppress(OSError):
                self.delete(key)
            raise ChecksumMismatch(
                self.url, f"write of {key}", digest.like(theirs),
                str(theirs) if theirs else "nothing to compare it with (an encrypted object "
                "whose ETag is no MD5, kept without the CRC32 the upload asked for)")

    # ---------------------------------------------------------------- write
    def _upload_options(self, digest) -> dict:
        """S3: our part size (the ETag's form depends on it) and the CRC32 S3 is asked to keep."""
        if self.scheme != "s3":
            return {}
        return {"chunksize": digest.part, "ChecksumAlgorithm": S3_CHECKSUM}

    def write_file(self, key: str, local_path: str) -> None:
        size = os.path.getsize(local_path)
        digest = self._new_digest(size)
        with open(local_path, "rb") as f:
            for block in iter(lambda: f.read(CHUNK), b""):
                digest.update(block)
        with _as_oserror(self.url, key):
            self.fs.put_file(local_path, self.path(key), **self._upload_options(digest))
        self._acknowledged(key, digest)

    def write_bytes(self, key: str, data: bytes) -> None:
        if len(data) >= SIMPLE_MAX:  # big: the same parts as a file's upload
            with self.open_write(key) as f:
                f.write(data)
            return
        digest = self._new_digest(len(data))
        digest.update(data)
        with _as_oserror(self.url, key):
            self.fs.pipe_file(self.path(key), data, **self._upload_options(digest))
        self._acknowledged(key, digest)

    @contextlib.contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        """A local temporary file, uploaded and acknowledged when the block ends cleanly."""
        with tempfile.NamedTemporaryFile(prefix="orchestrator-upload-") as tmp:
            yield tmp
            tmp.flush()
            self.write_file(key, tmp.name)

    # ---------------------------------------------------------------- read
    def read_bytes(self, key: str, expect_xxh3: str | None = None) -> bytes:
        info = self._info(key)
        with _as_oserror(self.url, key):
            data = self.fs.cat_file(self.path(key))
        digest = self._new_digest(len(data), info)
        digest.update(data)
        self._check_read(key, info, digest)
        if expect_xxh3 is not None:
            got = importlib.import_module("xxhash").xxh3_128_hexdigest(data)
            if got != expect_xxh3:
                raise ChecksumMismatch(self.url, f"read of {key} (xxh3-128)", got, expect_xxh3)
        return data

    def open_read(self, key: str) -> BinaryIO:
        """The object downloaded to an unnamed local file and checked before it is handed out
        (a restore reads nothing that the server's checksum refuses)."""
        info = self._info(key)
        fd, tmp = tempfile.mkstemp(prefix="orchestrator-download-")
        os.close(fd)
        try:
            with _as_oserror(self.url, key):
                self.fs.get_file(self.path(key), tmp)
            f = open(tmp, "rb")
        finally:
            os.unlink(tmp)
        digest = self._new_digest(os.fstat(f.fileno()).st_size, info)
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
        try:
            self._check_read(key, info, digest)
        except OSError:
            f.close()
            raise
        f.seek(0)
        return f

    def _check_read(self, key: str, info: dict, digest) -> None:
        theirs = self._server_checksum(info)
        if theirs is not None and not digest.matches(theirs):
            raise ChecksumMismatch(self.url, f"read of {key}", digest.like(theirs), theirs)

    def exists(self, key: str) -> bool:
        with _as_oserror(self.url, key):
            return self.fs.exists(self.path(key))

    def size(self, key: str) -> int | None:
        try:
            return int(self._info(key)["size"])
        except FileNotFoundError:
            return None

    def mtime(self, key: str) -> float | None:
        """When the object was last written or touched (the server's clock)."""
        try:
            return self._mtime(self._info(key))
        except FileNotFoundError:
            return None

    @staticmethod
    def _mtime(info: dict) -> float:
        when = info.get("updated") or info.get("LastModified")
        if isinstance(when, str):
            when = datetime.datetime.fromisoformat(when.replace("Z", "+00:00"))
        return when.timestamp() if when is not None else 0.0

    def stat_key(self, key: str) -> tuple | None:
        """(size, mtime in ns, the server's checksum and version), as a folder's (size,
        mtime_ns, inode): unchanged means the same bytes."""
        try:
            info = self._info(key)
        except FileNotFoundError:
            return None
        return (int(info["size"]), int(self._mtime(info) * 1e9),
                f"{self._server_checksum(info)}@{info.get('generation') or ''}")

    def list(self, prefix: str = "") -> list[str]:
        with _as_oserror(self.url, prefix):
            found = self.fs.find(self.path(prefix))
        return sorted(self._key(p) for p in found)

    def children(self, prefix: str = "") -> list[str]:
        try:
            with _as_oserror(self.url, prefix):
                names = self.fs.ls(self.path(prefix), detail=False)
        except FileNotFoundError:
            return []
        return sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in names})

    # ---------------------------------------------------------------- delete, move
    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError), _as_oserror(self.url, key):
            self.fs.rm_file(self.path(key))

    def delete_prefix(self, prefix: str) -> None:
        for key in self.list(prefix):
            self.delete(key)

    def move_prefix(self, src: str, dst: str) -> None:
        """A server-side copy of each object, checked against the source's checksum, then
        the source deleted (not atomic: the commit marker written after it commits)."""
        for key in self.list(src):
            new = dst + key[len(src):]
            theirs = self._server_checksum(self._info(key))
            with _as_oserror(self.url, key):
                self.fs.copy(self.path(key), self.path(new))
            copied = self._server_checksum(self._info(new))
            if theirs and "-" not in theirs and copied != theirs:
                raise ChecksumMismatch(self.url, f"copy of {key} to {new}", theirs, str(copied))
        self.delete_prefix(src)


class _Crc32c:
    """GCS's form: base64 of the big-endian CRC32C."""
    part = None

    def __init__(self):
        self._c = importlib.import_module("google_crc32c").Checksum()

    def update(self, data: bytes) -> None:
        self._c.update(data)

    def hexdigest(self) -> str:
        return base64.b64encode(self._c.digest()).decode()

    def like(self, theirs: str | None) -> str:
        return self.hexdigest()

    def matches(self, crc32c: str) -> bool:
        return crc32c == self.hexdigest()


class _S3Digest:
    """S3's two checksums of the bytes we send or read. The ETag: the MD5 of a single-part
    object, else the MD5 of the parts' MD5s and ``-N`` (the part size is ours, given to s3fs).
    The CRC32 S3 keeps when an upload asks for it: the object's, else the CRC32 of the parts'
    CRC32s and ``-N`` (a "composite" checksum). ``multipart``: which form to compute (a read
    takes the object's: a copy on the server may have made a multipart object a single-part
    one); by default the form our upload of ``size`` bytes takes."""

    def __init__(self, size: int, multipart: bool | None = None):
        self.part = max(S3_PART, math.ceil(size / S3_MAX_PARTS))
        single = size < min(S3_SINGLE_MAX, 2 * self.part)
        self.multipart = not single if multipart is None else multipart
        self._md5, self._crc, self._n = hashlib.md5(), 0, 0
        self._parts: list[tuple[bytes, int]] = []  # each whole part's (MD5, CRC32)

    def update(self, data: bytes) -> None:
        if not self.multipart:
            self._md5.update(data)
            self._crc = zlib.crc32(data, self._crc)
            return
        view = memoryview(data)
        while view:
            take = view[:self.part - self._n]
            self._md5.update(take)
            self._crc = zlib.crc32(take, self._crc)
            self._n += len(take)
            view = view[len(take):]
            if self._n == self.part:
                self._end_part()

    def _end_part(self) -> None:
        self._parts.append((self._md5.digest(), self._crc))
        self._md5, self._crc, self._n = hashlib.md5(), 0, 0

    def _all_parts(self) -> list[tuple[bytes, int]]:
        return self._parts + ([(self._md5.digest(), self._crc)] if self._n else [])

    def hexdigest(self) -> str:
        """The ETag."""
        if not self.multipart:
            return self._md5.hexdigest()
        parts = self._all_parts()
        return f"{hashlib.md5(b''.join(m for m, _ in parts)).hexdigest()}-{len(parts)}"

    def crc32(self) -> str:
        """The CRC32 in S3's form, base64 of the big-endian value (and ``-N``)."""
        def b64(c: int) -> str:
            return base64.b64encode(c.to_bytes(4, "big")).decode()
        if not self.multipart:
            return b64(self._crc)
        parts = self._all_parts()
        joined = b"".join(c.to_bytes(4, "big") for _, c in parts)
        return f"{b64(zlib.crc32(joined))}-{len(parts)}"

    def like(self, theirs: str | None) -> str:
        """Ours in the form of ``theirs`` (``_server_checksum``'s)."""
        return f"crc32:{self.crc32()}" if (theirs or "").startswith("crc32:") else \
            self.hexdigest()

    def matches(self, theirs: str) -> bool:
        ours = self.like(theirs)
        if theirs.startswith("crc32:") and "-" not in theirs:
            ours = ours.split("-")[0]  # a server that gives the composite without its -N
        return ours == theirs


@contextlib.contextmanager
def _as_oserror(url: str, key: str):
    """The libraries' own errors (HTTP, connection, botocore) as OSError, so the mirror's
    retries and outage journaling apply; a missing object stays FileNotFoundError."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - only the storage libraries' errors are converted
        if type(exc).__module__.split(".")[0] not in _LIBRARY_ERRORS:
            raise
        raise OSError(errno.EIO, f"{type(exc).__name__}: {exc}", f"{url}/{key}") from exc


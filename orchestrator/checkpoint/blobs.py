"""Arrays as content-addressed blobs: hash, write, read back and digest (checkpoint format 2).

A blob is one array's raw C-order bytes, or one chunk of a large array (``CHUNK_BYTES``), named
by the XXH3-128 hex digest of its bytes and kept at ``blobs/<2 hex>/<hash>`` of its tier. XXH3
is fast (several GB/s on one core) and catches corruption and truncation; it is not a defence
against someone who can write the storage: the manifest's sha256 in the commit marker covers
the manifest, which names every blob. Each chunk is hashed once per checkpoint, from the
array's own memory (a memoryview, never a ``tobytes()`` copy); the state's fingerprints are
digests over these hashes, and restore hashes what it reads while it reads it.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import BinaryIO, Iterable

import numpy as np
import xxhash

BLOBS = "blobs"
# measured in BENCHMARKS.md ("Checkpoint format 2: chunk size"): 64 MiB writes a 1 GB state as
# fast as whole arrays do and rewrites at most 64 MiB of a partly changed embedding
CHUNK_BYTES = 64 << 20
PIECE_BYTES = 8 << 20  # what one write() or readinto() moves: bounded, no copy of the array


# numpy's switch for the huge-page hint on its large arrays (private: numpy 2 ``np._core``,
# 1.x ``np.core``; None where it is missing), and the lock around turning it off (_in_plain_pages)
_NUMPY_CORE = getattr(np, "_core", None) or getattr(np, "core", None)
_HUGEPAGE_SWITCH = getattr(getattr(_NUMPY_CORE, "multiarray", None), "_set_madvise_hugepage",
                           None)
_HUGEPAGE_LOCK = threading.Lock()


class BlobError(Exception):
    """A blob a checkpoint names is missing, short or does not match its hash."""


@dataclass(frozen=True)
class ArrayRef:
    """What a manifest says of one array: its dtype, shape and chunks [(hash, nbytes)]."""
    dtype: str
    shape: tuple
    chunks: tuple

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape),
                "chunks": [[h, n] for h, n in self.chunks]}

    @classmethod
    def from_json(cls, d: dict) -> "ArrayRef":
        return cls(str(d["dtype"]), tuple(int(x) for x in d["shape"]),
                   tuple((str(h), int(n)) for h, n in d["chunks"]))


def blob_key(h: str) -> str:
    return f"{BLOBS}/{h[:2]}/{h}"


def is_blob_name(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def _bytes_view(a: np.ndarray) -> memoryview:
    a = np.ascontiguousarray(a)  # a copy only for an array that is not C-contiguous
    return memoryview(a.reshape(-1).view(np.uint8))


def _chunks(mv: memoryview, chunk: int) -> list[memoryview]:
    return [mv[i:i + chunk] for i in range(0, len(mv), chunk)]


def hash_array(a: np.ndarray, chunk: int | None = None) -> ArrayRef:
    a, chunk = np.asarray(a), chunk or CHUNK_BYTES
    chunks = tuple((xxhash.xxh3_128_hexdigest(c), len(c)) for c in _chunks(_bytes_view(a), chunk))
    return ArrayRef(str(a.dtype), tuple(a.shape), chunks)


def hash_arrays(arrays: dict[str, np.ndarray], chunk: int | None = None) -> dict[str, ArrayRef]:
    return {k: hash_array(a, chunk) for k, a in arrays.items()}


def array_chunks(a: np.ndarray, ref: ArrayRef) -> list[tuple[str, memoryview]]:
    """(hash, bytes) of each chunk of ``a``, as ``ref`` cut it."""
    mv, out, at = _bytes_view(a), [], 0
    for h, n in ref.chunks:
        out.append((h, mv[at:at + n]))
        at += n
    return out


def write_chunk(f: BinaryIO, data: memoryview) -> None:
    for i in range(0, len(data), PIECE_BYTES):
        f.write(data[i:i + PIECE_BYTES])


def read_chunk(f: BinaryIO, into: memoryview, h: str, what: str) -> None:
    """Fill ``into`` from ``f`` and check the bytes' hash in the same pass."""
    hasher, at = xxhash.xxh3_128(), 0
    while at < len(into):
        n = f.readinto(into[at:at + PIECE_BYTES])
        if not n:
            raise BlobError(f"{what}: short, {at} of {len(into)} bytes")
        hasher.update(into[at:at + n])
        at += n
    if f.read(1):
        raise BlobError(f"{what}: longer than {len(into)} bytes")
    if hasher.hexdigest() != h:
        raise BlobError(f"{what}: checksum mismatch")


_pieces = threading.local()  # each thread's read buffer for hash_stream


def hash_stream(f: BinaryIO) -> tuple[str, int]:
    """(hash, size) of what ``f`` holds. The buffer is the thread's own, made once: a fresh
    8 MiB one, zeroed for each blob of a few KiB, was a quarter of the supervisor's CPU."""
    view = getattr(_pieces, "view", None)
    if view is None:
        view = _pieces.view = memoryview(bytearray(PIECE_BYTES))
    hasher, n = xxhash.xxh3_128(), 0
    while True:
        got = f.readinto(view)
        if not got:
            return hasher.hexdigest(), n
        hasher.update(view[:got])
        n += got


def dtype_of(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 and friends, as Keras on JAX holds them

        return np.dtype(getattr(ml_dtypes, name))


def empty_for(ref: ArrayRef) -> np.ndarray:
    a = _in_plain_pages(tuple(ref.shape), dtype_of(ref.dtype))
    if a.nbytes != sum(n for _, n in ref.chunks):
        raise BlobError(f"{ref.dtype}{list(ref.shape)} is {a.nbytes} bytes, its chunks "
                        f"{sum(n for _, n in ref.chunks)}")
    return a


def _in_plain_pages(shape: tuple, dtype) -> np.ndarray:
    """An empty array for a restore to read into, without the huge pages numpy asks for a
    large one (``MADV_HUGEPAGE``): their first touch took 3x as long here and slowed the
    framework's import the read runs beside (BENCHMARKS.md). The array is filled once, copied
    into the model and let go: huge pages buy it nothing. numpy's switch is process-wide (a
    lock keeps two reads from leaving it off) and private: where it is missing, numpy's way."""
    if _HUGEPAGE_SWITCH is None:
        return np.empty(shape, dtype)
    with _HUGEPAGE_LOCK:
        before = _HUGEPAGE_SWITCH(False)
        try:
            return np.empty(shape, dtype)
        finally:
            _HUGEPAGE_SWITCH(before)


def digest(refs: Iterable[ArrayRef]) -> str:
    """sha256 over arrays' dtypes, shapes and chunk hashes, in order: equal arrays, equal
    digest (the checkpoint's ``weights_sha256`` and ``state_sha256``)."""
    h = hashlib.sha256()
    for r in refs:
        h.update(f"{r.dtype}{list(r.shape)}".encode())
        for c, n in r.chunks:
            h.update(f"{c}:{n};".encode())
    return h.hexdigest()


def weights_fingerprint(arrays: Iterable[np.ndarray]) -> str:
    """The digest of plain arrays (a model's weights, a plain fit's in bench/baseline_fit.py)."""
    return digest(hash_array(a) for a in arrays)

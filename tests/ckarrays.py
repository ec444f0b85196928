"""Checkpoints of plain numpy arrays for the store's tests (format 2: content-addressed blobs):
commit a few arrays made from a text, and find the file of the blob a checkpoint names."""
import os

import numpy as np

from orchestrator.checkpoint import blobs

KEY = "model.0000"


def arrays_of(text: str, repeat: int = 1) -> dict[str, np.ndarray]:
    """One uint8 array holding ``text`` ``repeat`` times (so sizes read as in bytes)."""
    return {KEY: np.frombuffer((text * repeat).encode(), dtype=np.uint8).copy()}


def commit(store, step, text, manifest=None, keep=None, repeat=1, **kw):
    return store.commit(step, None, dict(manifest or {}), keep=keep,
                        arrays=kw.pop("arrays", None) or arrays_of(text, repeat), **kw)


def blob_path(c, key: str = KEY, chunk: int = 0) -> str:
    """The file of the blob chunk ``chunk`` of array ``key`` of checkpoint ``c``."""
    h = c.manifest["arrays"][key]["chunks"][chunk][0]
    return os.path.join(os.path.dirname(c.path), *blobs.blob_key(h).split("/"))


def blob_hash(c, key: str = KEY, chunk: int = 0) -> str:
    return c.manifest["arrays"][key]["chunks"][chunk][0]


def blob_files(root) -> dict[str, int]:
    """hash -> size of every blob in a tier's folder."""
    out = {}
    for dirpath, _dirs, files in os.walk(os.path.join(root, blobs.BLOBS)):
        for f in files:
            if blobs.is_blob_name(f):
                out[f] = os.path.getsize(os.path.join(dirpath, f))
    return out

"""Checkpoint format 2 on a ~1 GB numpy state (issue #37): write time of a full checkpoint and of
one where 1 % changed, bytes written, restore time against ``dd`` of the same bytes, for a few
chunk sizes. No TensorFlow, no worker: the store alone, on this machine's disk.

    .venv/bin/python -m bench.checkpoint_format [--dir DIR] [--reps 2] [--chunks 16,64,256,0]

The state: four float32 arrays of 62.5 M (250 M values, 1.0 GB). "1 % changed": a contiguous
1 % of one array (an embedding's rows a batch touched), or a separate head of 1 % (a frozen
backbone). ``--chunks`` in MiB; 0 is no chunking (one blob per array).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np

from orchestrator.checkpoint import blobs
from orchestrator.checkpoint.store import CheckpointStore

N = 62_500_000  # float32 values per array; 4 of them: 1.0 GB


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"model.{i:04d}": rng.standard_normal(N, dtype=np.float32) for i in range(4)}


def _dd_s(paths: list[str]) -> float:
    t0 = time.perf_counter()
    for p in paths:
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=8M", "status=none"], check=True)
    return time.perf_counter() - t0


def _blob_paths(store: CheckpointStore, c) -> list[str]:
    return sorted({store.place.path(blobs.blob_key(h))
                   for r in c.array_refs.values() for h, _ in r.chunks})


def one(root: str, chunk_mib: int, state: dict[str, np.ndarray]) -> dict:
    blobs.CHUNK_BYTES = (chunk_mib << 20) if chunk_mib else (1 << 62)
    store = CheckpointStore(root)
    t0 = time.perf_counter()
    c1 = store.commit(1, None, {}, arrays=state)
    full_s = time.perf_counter() - t0
    emb = state["model.0001"]
    lo = len(emb) // 2
    slice_s = []
    for step in (2, 3):  # the second checkpoint also hashes once what the first wrote
        time.sleep(1.1)  # a checkpoint interval: blobs older than the racily-clean second
        emb[lo:lo + len(emb) // 100] += 1.0  # 1 % of one array, contiguous
        t0 = time.perf_counter()
        c2 = store.commit(step, None, {}, arrays=state)
        slice_s.append(round(time.perf_counter() - t0, 2))
    emb[lo:lo + len(emb) // 100] -= 2.0
    t0 = time.perf_counter()
    got = store.read_arrays(c2.path)  # the page cache holds the blobs: dd reads them warm too
    restore_s = time.perf_counter() - t0
    del got
    dd_s = _dd_s(_blob_paths(store, c2))
    t0 = time.perf_counter()
    reason = store.verify(c2.path)
    verify_s = time.perf_counter() - t0
    assert reason is None, reason
    return {"chunk_mib": chunk_mib, "full_write_s": round(full_s, 2),
            "full_bytes": c1.manifest["bytes_written"],
            "slice_1pct_write_s": slice_s,
            "slice_1pct_bytes": c2.manifest["bytes_written"],
            "restore_s": round(restore_s, 2), "dd_same_bytes_s": round(dd_s, 2),
            "full_verify_s": round(verify_s, 2)}


def head(root: str, state: dict[str, np.ndarray]) -> dict:
    """A frozen backbone (the four arrays) and a 1 % head that changes at each checkpoint."""
    blobs.CHUNK_BYTES = 64 << 20
    store = CheckpointStore(root)
    arrays = dict(state, **{"model.0004": np.zeros(N * 4 // 100, np.float32)})
    store.commit(1, None, {}, arrays=arrays)
    took = []
    for step in (2, 3):
        time.sleep(1.1)
        arrays["model.0004"] += 1.0
        t0 = time.perf_counter()
        c = store.commit(step, None, {}, arrays=arrays)
        took.append(round(time.perf_counter() - t0, 2))
    return {"frozen_backbone_head_1pct_write_s": took,
            "frozen_backbone_head_1pct_bytes": c.manifest["bytes_written"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--chunks", default="16,64,256,0")
    a = ap.parse_args(argv)
    state = _state()
    base = a.dir or tempfile.mkdtemp(prefix="ckformat-")
    out = []
    for rep in range(a.reps):
        for chunk in [int(x) for x in a.chunks.split(",")]:
            root = os.path.join(base, f"c{chunk}-{rep}")
            out.append(dict(one(root, chunk, state), rep=rep))
            shutil.rmtree(root)
            print(json.dumps(out[-1]), flush=True)
        root = os.path.join(base, f"head-{rep}")
        out.append(dict(head(root, state), rep=rep))
        shutil.rmtree(root)
        print(json.dumps(out[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

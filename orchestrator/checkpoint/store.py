"""The checkpoint store: atomic commit, manifest with checksums, newest-valid restore.

This module never imports TensorFlow, so the supervisor, ``status`` and the tests can read and
verify checkpoints. Format 2 (docs/checkpoint-format.md): each array is stored as
content-addressed blobs ``blobs/<2 hex>/<xxh3-128>`` of its tier (blobs.py), written once per
tier and shared by every checkpoint that holds the same bytes (a frozen layer is written once);
a checkpoint is a directory ``<step:010d>/`` (the global training step, so mid-epoch checkpoints
sort too) holding ``manifest.json`` (``format: 2``; ``arrays``: each array's dtype, shape and
chunks; ``files``: small non-array payload; the epochs completed and the batch reached) and the
list of the blobs it names (``refs``). It is written under a temporary name, its reference list
first, then its blobs, then its files and manifest, renamed into place, and then a commit marker
(``COMMITTED``, holding the manifest's sha256) is written inside it: on a POSIX disk the rename
alone is atomic, on a FUSE mount such as Google Drive it may not be, and a directory without a
matching marker is never taken for a checkpoint. Restore takes the newest checkpoint whose
blobs and files match their checksums and falls back past the others, because a checkpoint
that fails to load must never turn into a crash loop. Retention keeps the last K, one every N
epochs and the best by a metric, counting only checkpoints that verify; then it deletes the
blobs that no directory names (a commit in flight names its blobs before writing or reusing
them, so a concurrent collection never takes one from it). Format 1
(``state.npz`` in ``files``, no ``arrays``) still verifies and restores. All file operations
go through the tier's Place (places.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from orchestrator.checkpoint import blobs
from orchestrator.checkpoint.blobs import BlobError, weights_fingerprint  # noqa: F401 - bench
from orchestrator.checkpoint.blobset import BLOB_GRACE_S, BlobSet
from orchestrator.checkpoint.places import LocalPlace
from orchestrator.core.osutil import pid_alive, sha256_file
# defined below the store (the spec builds it), imported from here by its users too
from orchestrator.core.retention import Retention

FORMAT = 2
MANIFEST = "manifest.json"
STATE_FILE = "state.npz"  # format 1's one payload file
COMMIT_MARKER = "COMMITTED"
REFS = "refs"  # the blobs a checkpoint (or a commit in flight) names, one hash a line
_COMMITTED = re.compile(r"^\d{10}$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    manifest: dict
    tier: "CheckpointStore | None" = field(default=None, compare=False, repr=False)

    @property
    def epoch(self) -> int:
        """Epochs completed when this checkpoint was taken."""
        return int(self.manifest.get("epoch", 0))

    def ends_run(self, epochs: int) -> bool:
        """The run is complete at this checkpoint: the last epoch is done, or the job's
        callbacks ended training (EarlyStopping)."""
        return self.epoch >= epochs or bool(self.manifest.get("stopped_early"))

    @property
    def nbytes(self) -> int:
        """The state's bytes as its manifest states them: its files and every chunk of every
        array, shared with other checkpoints or not (what a restore reads)."""
        files = self.manifest.get("files") or {}
        return (sum(int(m.get("size") or 0) for m in files.values() if isinstance(m, dict))
                + sum(n for r in self.array_refs.values() for _, n in r.chunks))

    @property
    def array_refs(self) -> dict[str, blobs.ArrayRef]:
        return {k: blobs.ArrayRef.from_json(v)
                for k, v in (self.manifest.get("arrays") or {}).items()}


def as_retention(keep) -> Retention | None:
    """``commit``/``retain`` take a plain count (the last K) or a full ``Retention``."""
    if keep is None or isinstance(keep, Retention):
        return keep
    return Retention(keep=int(keep))


def _unique_chunks(refs) -> dict[str, tuple[int, str]]:
    """hash -> (nbytes, the first key naming it)."""
    out: dict[str, tuple[int, str]] = {}
    for k, r in refs.items():
        for h, n in r.chunks:
            out.setdefault(h, (n, k))
    return out


class CheckpointStore:
    """One tier: committed checkpoints and their blobs, in one Place.

    ``may_delete(checkpoint)`` says whether retention may remove a checkpoint (the local tier
    keeps what has no verified durable copy yet); by default it may.
    """

    def __init__(self, root: str, may_delete: Callable[[Checkpoint], bool] | None = None,
                 place=None, blob_grace_s: float = BLOB_GRACE_S):
        self.root = root
        self.place = place if place is not None else LocalPlace(root)
        self.may_delete = may_delete
        self.blob_grace_s = blob_grace_s
        self._verified: dict[str, tuple] = {}  # path -> stat key of the files that verified
        self.blobs = BlobSet(self.place, blob_grace_s)
        self.last_copy: dict = {}  # what commit_copy moved: bytes_uploaded, blobs_*

    # ---------------------------------------------------------------- write side
    def commit(self, step: int, write_payload: Callable[[str], None] | None, manifest: dict,
               keep: "int | Retention | None" = None, arrays: dict | None = None,
               refs: dict | None = None) -> Checkpoint:
        """Write the checkpoint of global ``step`` atomically and apply retention.

        ``arrays`` (key -> numpy array) become blobs; ``refs`` are their hashes when the caller
        computed them already (blobs.hash_arrays, for the fingerprints). ``write_payload(dir)``
        writes small non-array files into a fresh temporary directory (may be None).
        """
        arrays = arrays or {}
        refs = refs if refs is not None else blobs.hash_arrays(arrays)

        def fill(tmp: str) -> None:
            self._write_refs(tmp, refs)
            written, reused = self.blobs.write(arrays, refs)
            files = self._write_files(tmp, write_payload)
            full = dict(manifest, format=FORMAT, step=step, files=files,
                        arrays={k: r.to_json() for k, r in refs.items()},
                        bytes_written=written, blobs_reused=reused,
                        committed_at=round(time.time(), 3), pid=os.getpid())
            self.blobs.recheck(arrays, refs)  # a blob reused but collected meanwhile
            return self._write_manifest(tmp, full)

        final = self._commit_dir(step, fill)
        if keep:
            self.retain(keep)
        return self._info(self.path_for(final))

    def _write_refs(self, tmp: str, refs: dict) -> None:
        self.place.write_bytes(f"{tmp}/{REFS}", "".join(
            f"{h}\n" for h in sorted(_unique_chunks(refs))).encode())

    def _write_files(self, tmp: str, write_payload) -> dict:
        if write_payload is None:
            return {}
        local = isinstance(self.place, LocalPlace)
        with tempfile.TemporaryDirectory() as scratch:
            d = self.place.path(tmp) if local else scratch
            write_payload(d)
            files = {}
            for name in sorted(os.listdir(d)):
                if name == REFS:
                    continue
                p = os.path.join(d, name)
                if local:
                    with open(p, "rb") as f:
                        os.fsync(f.fileno())
                else:
                    self.place.write_file(f"{tmp}/{name}", p)
                files[name] = {"sha256": sha256_file(p), "size": os.path.getsize(p)}
        return files

    def _write_manifest(self, tmp: str, manifest: dict) -> bytes:
        data = (json.dumps(manifest, indent=1, default=str) + "\n").encode()
        self.place.write_bytes(f"{tmp}/{MANIFEST}", data)
        return data

    def commit_copy(self, source: Checkpoint) -> Checkpoint:
        """Copy a committed checkpoint of another tier here (manifest byte for byte), with the
        same commit protocol, uploading only the blobs this tier lacks (``last_copy`` says how
        many bytes and blobs). The caller verifies the copy by reading it back."""
        src = source.tier or CheckpointStore(os.path.dirname(source.path))
        skey = os.path.basename(source.path)
        mbytes = src.place.read_bytes(f"{skey}/{MANIFEST}")
        manifest = json.loads(mbytes)
        refs = {k: blobs.ArrayRef.from_json(v) for k, v in (manifest.get("arrays") or {}).items()}
        facts = {"bytes_uploaded": 0, "blobs_uploaded": 0, "blobs_reused": 0, "uploaded": set()}

        def fill(tmp: str) -> bytes:
            self._write_refs(tmp, refs)
            for h, (n, _k) in _unique_chunks(refs).items():
                key = blobs.blob_key(h)
                if self.blobs.reuse(h, n):
                    facts["blobs_reused"] += 1
                    continue
                self._copy_key(src, key, key)
                facts["blobs_uploaded"] += 1
                facts["bytes_uploaded"] += n
                facts["uploaded"].add(h)
            for name in manifest.get("files", {}):
                self._copy_key(src, f"{skey}/{name}", f"{tmp}/{name}")
                facts["bytes_uploaded"] += int(manifest["files"][name]["size"])
            self.place.write_bytes(f"{tmp}/{MANIFEST}", mbytes)
            facts["bytes_uploaded"] += len(mbytes)
            facts["manifest_bytes"] = len(mbytes)
            return mbytes

        final = self._commit_dir(source.step, fill)
        self.last_copy = facts
        return self._info(self.path_for(final))

    def _copy_key(self, src: "CheckpointStore", skey: str, dkey: str) -> None:
        if isinstance(src.place, LocalPlace):
            self.place.write_file(dkey, src.place.path(skey))
            return
        with src.place.open_read(skey) as f, self.place.open_write(dkey) as out:
            shutil.copyfileobj(f, out, blobs.PIECE_BYTES)

    def _commit_dir(self, step: int, fill: Callable[[str], bytes]) -> str:
        """tmp dir -> fill -> rename -> commit marker. Returns the final key."""
        tmp = f".tmp-{step:010d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        final = f"{step:010d}"
        try:
            mbytes = fill(tmp)
            if self.place.children(final):
                if self.verify(self.path_for(step)) is None:
                    self.place.delete_prefix(tmp)
                    return final
                trash = f".trash-{uuid.uuid4().hex[:8]}"
                self.place.move_prefix(final, trash)
                self.place.delete_prefix(trash)
            self.place.move_prefix(tmp, final)
        except BaseException:
            self.place.delete_prefix(tmp)
            raise
        self.place.write_bytes(f"{final}/{COMMIT_MARKER}",
                               hashlib.sha256(mbytes).hexdigest().encode())
        return final

    def retain(self, keep: "int | Retention") -> list[str]:
        """Delete the checkpoints ``keep`` does not select, then the blobs nothing names.
        Never the newest verified one, nothing newer than it (it may be mid-commit), nothing
        ``may_delete`` protects."""
        policy = as_retention(keep)
        committed = self.list()
        verified = [c for c in committed if self.verify(c.path, cached=True) is None]
        if not verified:
            return []
        kept = policy.select(verified) | {verified[-1].step}
        removed = []
        for c in committed:
            if c.step in kept or c.step > verified[-1].step:
                continue
            if self.may_delete is not None and not self.may_delete(c):
                continue
            self.remove(c)
            removed.append(c.path)
        if removed:
            self.collect_blobs()
        return removed

    def collect_blobs(self, grace_s: float | None = None) -> list[str]:
        """Delete the blobs no checkpoint or commit in flight names (BlobSet.collect);
        ``grace_s``: 0 once no one else can be writing (the end of a completed run)."""
        return self.blobs.collect(self.named_blobs, grace_s)

    def remove(self, c: Checkpoint) -> None:
        """Delete one checkpoint's directory (its blobs go at the next ``collect_blobs``)."""
        self.place.delete_prefix(os.path.basename(c.path))
        self._verified.pop(c.path, None)

    def named_blobs(self) -> set[str]:
        """Every blob a directory of this tier names: committed, partial or in flight."""
        named: set[str] = set()
        for name in self.place.children(""):
            if not (_COMMITTED.match(name) or name.startswith(".tmp-")):
                continue
            try:
                named.update(self.place.read_bytes(f"{name}/{REFS}").decode().split())
                continue
            except FileNotFoundError:
                pass  # a commit not yet past mkdir, or a checkpoint with no blobs
            try:
                manifest = json.loads(self.place.read_bytes(f"{name}/{MANIFEST}"))
            except (FileNotFoundError, ValueError):
                continue
            for r in (manifest.get("arrays") or {}).values():
                named.update(h for h, _ in r.get("chunks", []))
        return named

    def remove_partial(self) -> list[str]:
        """Remove temporary directories left by writers that died mid-commit."""
        removed = []
        for name in self.place.children(""):
            if name.startswith((".tmp-", ".trash-")):
                parts = name.split("-")
                pid = int(parts[2]) if name.startswith(".tmp-") and len(parts) > 2 else None
                if pid is not None and pid != os.getpid() and pid_alive(pid):
                    continue
                self.place.delete_prefix(name)
                removed.append(name)
        return removed

    def cut_short(self, path: str) -> bool:
        """True when the directory at ``path`` was renamed into place but never got its commit
        marker (its writer died or lost the mount in between): no later write completes it, so
        it never becomes a checkpoint. An unreadable marker (an outage) is not taken for a
        missing one."""
        try:
            self.place.read_bytes(f"{os.path.basename(path)}/{COMMIT_MARKER}")
        except FileNotFoundError:
            return True
        return False

    # ---------------------------------------------------------------- read side
    def path_for(self, step: "int | str") -> str:
        return os.path.join(self.root, step if isinstance(step, str) else f"{step:010d}")

    def list(self) -> list[Checkpoint]:
        """Committed checkpoints, oldest first (not yet verified). A missing root is empty;
        any other error (a lost mount, a file in its place) is raised, not taken for empty."""
        return [self._info(self.path_for(n)) for n in self.place.children("")
                if _COMMITTED.match(n)]

    def verify(self, path: str, cached: bool = False, rehash: set | None = None) -> str | None:
        """None when the checkpoint at ``path`` is complete and intact, else the reason.

        ``cached`` (retention, listings, the mirror's passes): the manifest, the marker, each
        blob's existence and size, and the hash of each blob (and file) this process has not
        hashed before with the same size, mtime and inode: a frozen layer is hashed once per
        process, a corrupt copy is still found. Otherwise (restore, the read-back of a durable
        copy) every blob is hashed again, or only those in ``rehash`` (the mirror: the blobs it
        just uploaded).
        """
        if self._foreign(path):
            return CheckpointStore(os.path.dirname(path)).verify(path, cached, rehash)
        key = os.path.basename(path)
        try:
            mbytes = self.place.read_bytes(f"{key}/{MANIFEST}")
            manifest = json.loads(mbytes)
        except (OSError, ValueError):
            return "manifest missing or unreadable"
        if not isinstance(manifest, dict) or "files" not in manifest:
            return "manifest missing or unreadable"
        try:
            marker = self.place.read_bytes(f"{key}/{COMMIT_MARKER}").decode(
                errors="replace").strip()
        except OSError as exc:
            return f"commit marker {COMMIT_MARKER} missing ({exc.strerror or exc})"
        if marker != hashlib.sha256(mbytes).hexdigest():
            return "commit marker does not match the manifest"
        try:
            refs = {k: blobs.ArrayRef.from_json(v)
                    for k, v in (manifest.get("arrays") or {}).items()}
        except (KeyError, TypeError, ValueError):
            return f"{MANIFEST}: 'arrays' is not a map of dtype, shape and chunks"
        for h, (n, k) in _unique_chunks(refs).items():
            bkey = blobs.blob_key(h)
            what = f"blob {h} of {k}"
            try:
                size = self.place.size(bkey)
                if size is None:
                    return f"{what}: missing"
                if size != n:
                    return f"{what}: size {size} != {n}"
                if (not self.blobs.vouched(h)) if cached else (rehash is None or h in rehash):
                    if not self.blobs.hashes_right(h):
                        return f"{what}: checksum mismatch"
            except OSError as exc:
                return f"{what}: {exc.strerror or exc}"
        return self._verify_files(path, key, manifest["files"], cached)

    def _verify_files(self, path: str, key: str, files: dict, cached: bool) -> str | None:
        stat = getattr(self.place, "stat_key", None)
        stamp = tuple(stat(f"{key}/{n}") for n in files) if stat else None
        if cached and stamp is not None and None not in stamp and self._verified.get(
                path) == stamp:
            return None
        for name, meta in files.items():
            try:
                size = self.place.size(f"{key}/{name}")
                if size is None:
                    return f"{name}: No such file or directory"
                if size != meta["size"]:
                    return f"{name}: size {size} != {meta['size']}"
                with self.place.open_read(f"{key}/{name}") as f:
                    if hashlib.file_digest(f, "sha256").hexdigest() != meta["sha256"]:
                        return f"{name}: checksum mismatch"
            except OSError as exc:
                return f"{name}: {exc.strerror or exc}"
        if stamp is not None and None not in stamp:
            self._verified[path] = stamp
        return None

    def digest(self, path: str) -> str | None:
        """What names the commit at ``path`` wherever a copy of it is: its commit marker (the
        manifest's sha256; a copy to another tier is byte for byte). A rank tells the
        supervisor of a commit with it, and the supervisor's copy must match it (ledger.py).
        None: not committed (yet)."""
        try:
            if self._foreign(path):
                with open(os.path.join(path, COMMIT_MARKER), "rb") as f:
                    data = f.read()
            else:
                data = self.place.read_bytes(f"{os.path.basename(path)}/{COMMIT_MARKER}")
        except OSError:
            return None
        return data.decode(errors="replace").strip() or None

    def read_arrays(self, path: str) -> dict[str, np.ndarray]:
        """The arrays of the checkpoint at ``path``, each read straight into its own array and
        hashed in the same pass (BlobError names the blob and key that does not match). A
        format-1 checkpoint is read from its ``state.npz`` (never unpickling)."""
        if self._foreign(path):
            return CheckpointStore(os.path.dirname(path)).read_arrays(path)
        key = os.path.basename(path)
        manifest = json.loads(self.place.read_bytes(f"{key}/{MANIFEST}"))
        if "arrays" not in manifest:
            if STATE_FILE not in manifest.get("files", {}):
                raise BlobError(f"{path}: manifest has neither 'arrays' (format {FORMAT}) nor "
                                f"{STATE_FILE} (format 1) in 'files'")
            with self.place.open_read(f"{key}/{STATE_FILE}") as f, \
                    np.load(f, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        return {k: self.blobs.read(r, f"{path}: blob {{}} of {k}")
                for k, r in Checkpoint(0, path, manifest).array_refs.items()}

    def latest_valid(self, on_skip: Callable[[Checkpoint, str], None] | None = None
                     ) -> Checkpoint | None:
        """The newest checkpoint that verifies; ``on_skip`` hears of each one passed over."""
        for c in reversed(self.list()):
            reason = self.verify(c.path)
            if reason is None:
                return c
            if on_skip:
                on_skip(c, reason)
        return None

    def _foreign(self, path: str) -> bool:
        """A path of another folder (a caller holding the other tier's copy): its blobs are
        that folder's."""
        return isinstance(self.place, LocalPlace) and os.path.normpath(
            os.path.dirname(path)) != os.path.normpath(self.root)

    def _info(self, path: str) -> Checkpoint:
        try:
            manifest = json.loads(self.place.read_bytes(f"{os.path.basename(path)}/{MANIFEST}"))
        except (OSError, ValueError):
            manifest = {}
        return Checkpoint(int(os.path.basename(path)), path,
                          manifest if isinstance(manifest, dict) else {}, self)

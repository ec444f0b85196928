"""JAX's persistent compile cache, kept in the local tier and mirrored to the run directory.

Every JAX worker compiles into ``<local tier>/../jax-cache`` and copies its new entries to
``<run_dir>/jax-cache`` in the background after the first step and each epoch end: a recovery
on this VM starts warm, and a recycled VM first pulls the run directory's copy. Entries are
written once and never changed (a copy is a rename into place; a stale entry is only a miss).
A failed copy is said once and tried again at the next push; it never stops training. Why
(compiling is most of a JAX cold start): BENCHMARKS.md, "5.4 The compile cache".
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid

log = logging.getLogger(__name__)

CACHE_DIR = "jax-cache"
JAX_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own setting, read as the local folder


def _copy_missing(src: str, dst: str, skip: frozenset = frozenset()) -> int:
    """Copy the files of ``src`` that ``dst`` lacks, but those in ``skip``; returns how many."""
    try:
        names = os.listdir(src)
    except FileNotFoundError:
        return 0
    os.makedirs(dst, exist_ok=True)
    have = set(os.listdir(dst))
    n = 0
    for name in names:
        path = os.path.join(src, name)
        if name in have or name in skip or name.startswith(".tmp-") or not os.path.isfile(path):
            continue
        tmp = os.path.join(dst, f".tmp-{uuid.uuid4().hex[:8]}-{name}")
        shutil.copyfile(path, tmp)
        os.replace(tmp, os.path.join(dst, name))
        n += 1
    return n


class CompileCache:
    """The local cache folder JAX compiles into, and its mirror in the run directory."""

    def __init__(self, local: str, durable: str, shared: bool = False):
        self.local, self.durable = local, durable
        # A folder the runtime or the user keeps for every run of the machine holds other
        # runs' executables: only what this run compiles is its to mirror (copying a shared
        # cache of hundreds of entries into every run directory, a Drive folder, would cost
        # each run that much upload). Those found there at start are skipped.
        self.shared = shared
        self.found: frozenset = frozenset()  # the entries here once pulled (the start's)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._said = False
        self.pushed = 0

    @classmethod
    def for_spec(cls, spec, env=None) -> "CompileCache":
        """The local folder: ``JAX_COMPILATION_CACHE_DIR`` where the runtime or the user set
        one (a cache shared by every run of this machine), else beside the local tier."""
        env = os.environ if env is None else env
        base = os.path.dirname(os.path.abspath(spec.checkpoint.local_dir))
        local = env.get(JAX_CACHE_ENV) or os.path.join(base, CACHE_DIR)
        return cls(local, os.path.join(spec.run_dir, CACHE_DIR),
                   shared=bool(env.get(JAX_CACHE_ENV)))

    def pull(self) -> int:
        """Before JAX compiles anything: the run directory's entries this disk lacks (a
        recycled VM). Returns how many were copied."""
        os.makedirs(self.local, exist_ok=True)
        try:
            return _copy_missing(self.durable, self.local)
        except OSError as exc:
            self._say(f"not pulled from {self.durable} ({exc}); compiling afresh")
            return 0
        finally:
            self.found = frozenset(n for n in os.listdir(self.local) if not n.startswith("."))

    def enable(self) -> None:
        """Point JAX at the local folder, caching every executable (JAX's defaults skip those
        compiled in under a second, which on a TPU are most of a small model's)."""
        import jax

        jax.config.update("jax_compilation_cache_dir", self.local)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

    def push_soon(self) -> None:
        """Copy new entries to the run directory, in a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="compile-cache-push",
                                            daemon=True)
            self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self.push()

    def push(self) -> int:
        try:
            n = _copy_missing(self.local, self.durable,
                              skip=self.found if self.shared else frozenset())
        except OSError as exc:
            self._say(f"not copied to {self.durable} yet ({exc}); tried again later")
            return 0
        self.pushed += n
        return n

    def _say(self, what: str) -> None:
        if not self._said:
            self._said = True
            log.info(f"compile cache: {what}")

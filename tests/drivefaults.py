"""Drive-like failures injected at the filesystem-call boundary, for paths under one folder.

``DriveFaults(root)`` patches the ``os`` functions and ``open`` that the checkpoint code reaches
(in this process only) so that, for paths under ``root``, they raise what a failing Google
Drive FUSE mount raises - the real errno and its real text (``os.strerror``: ``[Errno 107]
Transport endpoint is not connected``, ``[Errno 5] Input/output error``, ``[Errno 28] No space
left on device``) - or block until released (a hung mount), or are slow. Every other path is
untouched. Tests run as root, so permissions cannot make a folder unreadable; this can.
"""
from __future__ import annotations

import builtins
import os
import threading
import time

_OS_FUNCS = ("open", "listdir", "scandir", "mkdir", "makedirs", "rename", "replace", "stat",
             "lstat", "remove", "unlink", "rmdir")


class DriveFaults:
    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        self.errno: int | None = None   # raise this errno
        self.hang = threading.Event()   # set: calls block until released
        self._release = threading.Event()
        self.delay = 0.0                # seconds added to each call
        self.calls = 0                  # calls that touched root
        self.failures = 0
        self._fail_from: tuple | None = None  # (call number, errno): fail from that call on
        self._saved: dict = {}

    # ------------------------------------------------------------- modes
    def down(self, err: int) -> None:
        self.errno = err

    def down_after(self, calls: int, err: int) -> None:
        """Fail from the ``calls``-th next call on: the mount drops between any two calls."""
        self._fail_from = (self.calls + calls, err)

    def up(self) -> None:
        self.errno = None
        self._fail_from = None
        self.delay = 0.0
        self.hang.clear()
        self._release.set()

    def block(self) -> None:
        self._release.clear()
        self.hang.set()

    # ------------------------------------------------------------- patching
    def _hit(self, path) -> bool:
        if isinstance(path, int):
            return False
        try:
            p = os.fsdecode(os.fspath(path))
        except TypeError:
            return False
        p = os.path.abspath(p)
        return p == self.root or p.startswith(self.root + os.sep)

    def _wrap(self, real, multi_path=False):
        def wrapper(*args, **kwargs):
            paths = args[:2] if multi_path else args[:1]
            if any(self._hit(p) for p in paths):
                self.calls += 1
                if self._fail_from and self.calls > self._fail_from[0]:
                    self.errno = self._fail_from[1]
                if self.hang.is_set():
                    self._release.wait(timeout=60)
                if self.delay:
                    time.sleep(self.delay)
                if self.errno is not None:
                    self.failures += 1
                    raise OSError(self.errno, os.strerror(self.errno), os.fspath(args[0]))
            return real(*args, **kwargs)

        return wrapper

    def __enter__(self) -> "DriveFaults":
        for name in _OS_FUNCS:
            real = getattr(os, name)
            self._saved[("os", name)] = real
            setattr(os, name, self._wrap(real, multi_path=name in ("rename", "replace")))
        self._saved[("builtins", "open")] = builtins.open
        builtins.open = self._wrap(builtins.open)
        return self

    def __exit__(self, *exc) -> None:
        self.up()
        for (mod, name), real in self._saved.items():
            setattr(os if mod == "os" else builtins, name, real)

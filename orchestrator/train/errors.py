"""The worker's own errors, in a leaf every train/ module may import.

Both say "the job is wrong, retrying will not help": the worker exits ``EXIT_CONFIG`` with a
fatal error record (train/outcome.py), which the supervisor classifies as ``user_error``.
"""
from __future__ import annotations


class JobError(Exception):
    """The job's configuration or code is wrong; retrying will not help. ``key`` is the job
    file's key at fault (``model``, ``compile.optimizer`` ...), when one is."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class DataError(Exception):
    """The data factory returned something this tool cannot train on."""

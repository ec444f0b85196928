"""The worker's one seam to the Keras backend it trains on: TensorFlow or JAX.

Everything the worker, the standby, the exporter and the doctor's job check do that depends on
the framework under Keras goes through a ``Backend``: importing it (and saying which extra is
missing), setting devices up before the framework initialises them, seeding, placing the model
(a distribution strategy, or JAX's ``keras.distribution``), the data pipeline, reading the
state for a checkpoint, the error types a shape mismatch raises, and the export. The rest of
the worker (callbacks, checkpoints, resume, heartbeat) is backend-independent Keras.

``for_name`` is told the backend by the supervisor (``core/backends.py`` resolves it, and
``ENV_BACKEND`` carries it); it sets ``KERAS_BACKEND`` before Keras is first imported, which is
the only moment Keras reads it.
"""
from __future__ import annotations

import os
import sys

from orchestrator.core import backends as names
from orchestrator.train.backends.base import BackendUnavailable, Placement, exactness  # noqa: F401
from orchestrator.train.backends.jax_backend import JaxBackend
from orchestrator.train.backends.tf_backend import TensorFlowBackend


_current = None


def for_name(name: str):
    """The process's backend, from now on also ``current()``; sets ``KERAS_BACKEND`` (Keras
    must not be imported yet, or must already be on this backend)."""
    global _current
    if name == names.AUTO:
        name = names.resolve(name)[0]
    if _current is not None and _current.name == name:
        return _current  # configured already (its devices, its compile cache)
    os.environ[names.KERAS_BACKEND_ENV] = name
    if name == names.JAX:
        _current = JaxBackend()
    else:
        _current = TensorFlowBackend()
    return _current


def current():
    """The backend ``for_name`` chose in this process; else the one Keras is on (a test or a
    tool that imported Keras itself)."""
    if _current is not None:
        return _current
    keras = sys.modules.get("keras")
    if keras is not None:
        return for_name(keras.backend.backend())
    return for_name(os.environ.get(names.KERAS_BACKEND_ENV) or names.AUTO)


def leave(rc: int) -> int:
    """The worker's exit status, once its attempt ended; a failed rank of a JAX group does not
    return from here (it exits at once: ``JaxBackend.leave`` says why)."""
    return _current.leave(rc) if _current is not None else rc

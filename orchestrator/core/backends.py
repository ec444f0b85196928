"""Which Keras backend a run trains on, decided without importing any framework.

Keras 3 trains on TensorFlow or on JAX. Colab's TPU runtimes (TPU VMs) ship JAX and Keras and
no TensorFlow; its GPU runtimes ship both. A job says ``backend: auto | tensorflow | jax``:
``auto`` follows Keras's own choice (``KERAS_BACKEND``, then ``~/.keras/keras.json``'s
``backend``, then TensorFlow, Keras's default), and when the backend it names is not installed
it takes the one that is (JAX on a TPU VM). The answer is frozen with the run: it is part of
the training hash, because numerics, RNG streams and the data order differ between backends.

The supervisor decides it here from the environment and the installed distributions
(``importlib.util.find_spec``: nothing is imported), and tells the worker by environment
(``ENV_BACKEND``), which also sets ``KERAS_BACKEND`` before Keras is imported.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os

from orchestrator.core import rundir

AUTO = "auto"
TENSORFLOW = "tensorflow"
JAX = "jax"
BACKENDS = (AUTO, TENSORFLOW, JAX)
# What the supervisor tells the worker: the backend the run trains on (never "auto"); named
# with the other variables in core/rundir.py.
ENV_BACKEND = rundir.ENV_BACKEND
# Keras reads its backend from here at its first import (keras/src/backend/config.py).
KERAS_BACKEND_ENV = "KERAS_BACKEND"

# The module each backend imports, and the distributions that provide it (the first installed
# one is the runtime's own build: tensorflow-tpu on a TPU VM, tensorflow-cpu here).
MODULES = {TENSORFLOW: "tensorflow", JAX: "jax"}
DISTRIBUTIONS = {
    TENSORFLOW: ("tensorflow-tpu", "tensorflow", "tensorflow-cpu", "tf-nightly"),
    JAX: ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt",
          "jax-cuda13-plugin", "jax-cuda13-pjrt"),
}


def installed(backend: str) -> bool:
    """The backend's framework can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(MODULES[backend]) is not None
    except (ImportError, ValueError):  # a broken install: a parent package that fails
        return False


def keras_choice(env=None, home: str | None = None) -> tuple[str | None, str]:
    """The backend Keras itself would take, and where that choice comes from; (None, ...)
    when neither the environment nor keras.json names one (Keras then takes TensorFlow)."""
    env = os.environ if env is None else env
    if env.get(KERAS_BACKEND_ENV):
        return env[KERAS_BACKEND_ENV].strip().lower(), f"{KERAS_BACKEND_ENV}={env[KERAS_BACKEND_ENV]}"
    keras_home = env.get("KERAS_HOME") or os.path.join(
        home or os.path.expanduser("~"), ".keras")
    path = os.path.join(keras_home, "keras.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):  # none, or not JSON: Keras then ignores it too
        return None, "Keras's default"
    chosen = config.get("backend") if isinstance(config, dict) else None
    if isinstance(chosen, str) and chosen:
        return chosen.strip().lower(), f"{path}"
    return None, "Keras's default"


def resolve(requested: str, env=None, home: str | None = None,
            is_installed=installed) -> tuple[str, str]:
    """``(backend, why)`` for the job's ``backend`` setting. ``auto``: Keras's choice, else
    TensorFlow; when that one is not installed and the other is, the other (a TPU VM has no
    TensorFlow). A named backend is taken as named: the worker says in one line when it is
    not installed."""
    if requested != AUTO:
        return requested, "the job's backend"
    chosen, source = keras_choice(env, home)
    if chosen not in (TENSORFLOW, JAX):  # unset, or torch/numpy: we train on these two only
        note = f" ({source} names {chosen!r}, which this tool does not train on)" if chosen else ""
        chosen, source = TENSORFLOW, "Keras's default" + note
    other = JAX if chosen == TENSORFLOW else TENSORFLOW
    if not is_installed(chosen) and is_installed(other):
        return other, f"{source} names {chosen}, which is not installed; {other} is"
    return chosen, source


def versions(backend: str) -> dict[str, str]:
    """The installed distributions of ``backend`` and Keras, with their versions (from their
    metadata: nothing is imported). The reinstall action pins to these; doctor shows them."""
    out = {}
    for name in DISTRIBUTIONS[backend] + ("keras",):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def jax_platforms(strategy: str, tpu_vm: bool, env=None) -> str | None:
    """The ``JAX_PLATFORMS`` a JAX process for a worker of ``strategy`` runs with (None: unset,
    JAX chooses): ``cpu`` for ``strategy: cpu``; on a TPU VM, for ``auto`` and ``tpu``, the TPU
    named first unless the environment names the platforms already, because JAX skips a TPU
    that fails to initialise (held by another process) and trains on the CPU, quietly, unless
    the platform is named. The worker sets it (train/backends/jax_backend.py), and so does
    ``doctor``'s JAX probe, which must see the devices the worker would see."""
    env = os.environ if env is None else env
    if strategy == "cpu":
        return "cpu"
    if strategy in (AUTO, "tpu") and tpu_vm:
        return env.get("JAX_PLATFORMS", "tpu,cpu")
    return env.get("JAX_PLATFORMS")

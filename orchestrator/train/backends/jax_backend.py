"""Keras on JAX: Colab's TPU runtimes (TPU VMs ship JAX and Keras, no TensorFlow), and GPUs.

What differs from TensorFlow, and why:

- **Nothing imports TensorFlow.** ``keras.utils.set_random_seed`` imports it whenever it is
  installed (2.5 s, and on a TPU VM it may take libtpu); ``seed`` does what it does for JAX
  without it. The data of in-memory arrays is a NumPy generator whose order is a function of
  (seed, epoch) alone (``array_batches``), so a resumed epoch replays the same batches; a
  ``tf.data`` job still works where TensorFlow is installed, through the TensorFlow pipeline.
- **The state lives outside the Keras variables during ``fit``.** The JAX trainer holds it in
  ``model._jax_state`` and empties the variables; ``state.sync`` puts it back before anything
  reads them (a checkpoint, a fingerprint), and the trainer takes it from the variables again
  at the next step.
- **Devices are set by the environment before JAX initialises its backend**: a CPU split
  (``--xla_force_host_platform_device_count``), ``JAX_PLATFORMS=cpu`` for ``strategy: cpu``,
  ``tpu,cpu`` on a TPU VM (unnamed, a TPU that fails to open is skipped for the CPU, quietly),
  no preallocation of 75 % of a GPU when a standby shares it, XLA's deterministic GPU ops for
  ``deterministic: true``. Several devices train under ``keras.distribution.DataParallel``
  (one replica per device); the last partial batch is dropped there, as on a TPU, because it
  cannot be split evenly across the devices.
- **Compilation is most of a cold start** (digits: 11-17 s to the first step without a
  cache, 5 s with a warm one). The persistent compile cache lives in the local tier and is
  mirrored to the run directory (``compile_cache.py``), so a recovery and a recycled VM start
  warm.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from orchestrator.train.backends import Placement

# XLA's flag for a CPU split into N devices (tests; DataParallel on one host).
_CPU_SPLIT_FLAG = "--xla_force_host_platform_device_count"
# Deterministic GPU reductions and scatter (XLA refuses ops it cannot make deterministic).
DETERMINISTIC_GPU_FLAGS = ("--xla_gpu_deterministic_ops=true",)


def _add_xla_flags(*flags: str) -> None:
    have = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=")[0] for f in have}
    os.environ["XLA_FLAGS"] = " ".join(have + [f for f in flags if f.split("=")[0] not in names])


class _Replicated:
    """JAX's stand-in for a ``tf.distribute`` strategy: what the worker asks of one (a scope
    to build the model in, the replica count)."""

    def __init__(self, distribution=None, replicas: int = 1):
        self.distribution, self.num_replicas_in_sync = distribution, replicas

    def scope(self):
        import contextlib

        return self.distribution.scope() if self.distribution is not None \
            else contextlib.nullcontext()


def array_batches(x, y, seed: int, begin: int, end: int, global_batch: int,
                  drop_remainder: bool, skip_batches: int = 0):
    """Batches of epochs ``begin .. end-1`` of in-memory ``(x, y)``, each epoch in the order of
    a permutation drawn from ``(seed, epoch)`` alone, less the first ``skip_batches`` of
    ``begin``. A generator: ``fit`` draws exactly ``steps_per_epoch`` batches per epoch."""
    n = len(y)
    last = n - global_batch + 1 if drop_remainder else n
    for epoch in range(begin, end):
        order = np.random.default_rng([seed, epoch]).permutation(n)
        for i, start in enumerate(range(0, max(last, 0), global_batch)):
            if epoch == begin and i < skip_batches:
                continue
            idx = order[start:start + global_batch]
            yield x[idx], y[idx]


class JaxBackend:
    name = "jax"
    # where bit-exact resume under kills is proven: the CPU (the end-to-end tests), and one
    # GPU with XLA's deterministic ops (an H200: bench/gpu_check.py); never on a TPU yet
    exact_on = ("CPU", "GPU")
    cache = None  # compile_cache.CompileCache, once configured for a run
    traced_reader = False  # Snapshot.warm traces the reader before the first checkpoint

    def import_framework(self) -> None:
        """Import JAX and Keras on it, or say in one line what to install."""
        from orchestrator.train.jobcode import JobError

        try:
            import jax  # noqa: F401
            import keras
        except ModuleNotFoundError as exc:
            if exc.name not in ("jax", "jaxlib", "keras"):
                raise
            raise JobError(
                f"JAX is not installed for {sys.executable}: install the extra "
                f"`pip install 'orchestrator[jax]'` (a Colab TPU or GPU runtime ships JAX: "
                f"`pip install orchestrator` there, which never replaces it)") from None
        if keras.backend.backend() != "jax":
            raise JobError(f"Keras was imported on the {keras.backend.backend()} backend before "
                           f"the worker could set KERAS_BACKEND=jax")
        if self.cache is not None:
            self.cache.enable()

    def versions(self) -> dict:
        import jax
        import jaxlib
        import keras

        return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                "keras": keras.__version__, "platform": jax.default_backend()}

    def configure(self, spec, cpu_devices: str | None, standby: bool) -> None:
        """Before JAX initialises its backend (its first device query): the environment is all
        it reads then."""
        from orchestrator.core import tpuvm
        from orchestrator.core.rundir import ENV_STRATEGY

        if cpu_devices and int(cpu_devices) > 1:
            _add_xla_flags(f"{_CPU_SPLIT_FLAG}={int(cpu_devices)}")
        strategy = os.environ.get(ENV_STRATEGY) or spec.strategy  # a fallback's, if any
        if strategy == "cpu":
            os.environ["JAX_PLATFORMS"] = "cpu"
        elif strategy in ("auto", "tpu") and tpuvm.device_files():
            # JAX skips a TPU that fails to initialise and trains on the CPU, quietly, unless
            # the platform is named: a TPU held by another process must fail this attempt
            # with libtpu's own words, for the supervisor to classify and recover
            os.environ.setdefault("JAX_PLATFORMS", "tpu,cpu")
        if standby:  # a standby beside the worker: neither takes 75 % of the GPU up front
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        if spec.deterministic:
            _add_xla_flags(*DETERMINISTIC_GPU_FLAGS)
        from orchestrator.train.compile_cache import CompileCache

        self.cache = CompileCache.for_spec(spec)
        self._pulled = self.cache.pull()
        self._entries_at_start = len([n for n in os.listdir(self.cache.local)
                                      if not n.startswith(".")])

    def after_compile(self) -> None:
        """New executables were compiled (the first step, an epoch's evaluation): mirror the
        cache's new entries to the run directory in the background."""
        if self.cache is not None:
            self.cache.push_soon()

    def facts(self) -> dict:
        """For ``worker_ready``: the compile cache this worker started with."""
        if self.cache is None:
            return {}
        return {"compile_cache": {"dir": self.cache.local, "pulled": self._pulled,
                                  "entries_at_start": self._entries_at_start}}

    def seed(self, seed: int, deterministic: bool) -> None:
        """``keras.utils.set_random_seed`` without its TensorFlow import: the global seed Keras
        draws unseeded SeedGenerators from, and Python's and NumPy's generators."""
        import random

        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator
        from keras.src.utils import rng_utils

        global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
        global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
        random.seed(seed)
        np.random.seed(seed)

    def placement(self, spec, group, reinitialise: bool) -> Placement:
        import jax
        import keras

        from orchestrator.train.accelerators import AcceleratorUnavailable

        if group is not None:
            raise AcceleratorUnavailable(
                "several workers (workers: N) on the JAX backend are not supported yet; "
                "train on one worker, or on backend: tensorflow")
        devices = jax.devices()
        platform = devices[0].platform
        wanted = {"tpu": "tpu", "gpu": "gpu"}.get(spec.strategy)
        if wanted and platform != wanted:
            raise AcceleratorUnavailable(
                f"strategy '{spec.strategy}' was asked for but JAX sees {len(devices)} "
                f"{platform} device(s) (check the runtime type and that jax's {wanted} plugin "
                f"is installed, or set strategy: auto)")
        kind = {"tpu": "TPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU"}.get(platform, "CPU")
        is_tpu = kind == "TPU"
        if len(devices) > 1:
            dp = keras.distribution.DataParallel(devices=devices)
            keras.distribution.set_distribution(dp)
            return Placement(_Replicated(dp, len(devices)),
                             f"{kind} x{len(devices)} (JAX DataParallel)", len(devices),
                             is_tpu, plain=False, drop_remainder=True)
        return Placement(_Replicated(), f"{kind} (JAX, {devices[0].device_kind})", 1, is_tpu,
                         plain=kind == "CPU", drop_remainder=is_tpu)

    def train_data(self, data, seed: int, begin: int, end: int, global_batch: int,
                   drop_remainder: bool, skip_batches: int = 0):
        from orchestrator.train import datasets

        if datasets.is_tf_dataset(data.train):  # TensorFlow is installed: the job made one
            return datasets.train_dataset(data, seed, begin, end, global_batch, drop_remainder,
                                          skip_batches=skip_batches)
        x, y = data.train
        return array_batches(x, y, seed, begin, end, global_batch, drop_remainder,
                             skip_batches)

    def validation_data(self, data, global_batch: int, drop_remainder: bool):
        from orchestrator.train import datasets

        if data.validation is None or datasets.is_tf_dataset(data.validation):
            return datasets.validation_dataset(data, global_batch, drop_remainder)
        x, y = data.validation
        if drop_remainder:
            keep = len(y) - len(y) % global_batch
            x, y = x[:keep], y[:keep]
        return x, y

    def fit_options(self, global_batch: int) -> dict:
        return {"validation_batch_size": global_batch, "shuffle": False}  # ours, by (seed, epoch)

    def validation_sample(self, val, global_batch: int):
        """One validation batch of the real shape (the standby's traced step compiles the
        evaluation for it)."""
        if val is None or not isinstance(val, tuple):
            return val.take(1) if val is not None else None
        return val[0][:global_batch], val[1][:global_batch]

    def input_errors(self) -> tuple:
        # jax.numpy's shape errors are TypeErrors ("dot_general requires contracting
        # dimensions to have the same shape"); Keras's own checks raise ValueError
        return (ValueError, TypeError)

    def reader(self, variables):
        """Every variable's value in one transfer to the host."""
        import jax

        return lambda: jax.device_get([v.value for v in variables])

    def can_export_saved_model(self) -> str | None:
        """Why a SavedModel cannot be written in this process, or None: Keras writes it from
        JAX through TensorFlow (jax2tf), which a TPU VM does not have. Installed is not enough:
        it must import here, or the export would fail as a whole instead of writing
        ``model.keras`` and the weights and saying why in ``export.json``."""
        try:
            import tensorflow  # noqa: F401
            from jax.experimental import jax2tf  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - whatever stops the import is the reason given
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return (f"TensorFlow, which writing a SavedModel from JAX needs, cannot be "
                    f"imported in the exporter process ({why})")
        return None

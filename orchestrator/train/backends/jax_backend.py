"""Keras on JAX: Colab's TPU runtimes (TPU VMs ship JAX and Keras, no TensorFlow), and GPUs.

What differs from TensorFlow, and why:

- **Nothing imports TensorFlow.** ``keras.utils.set_random_seed`` imports it whenever it is
  installed (seconds, and on a TPU VM it may take libtpu); ``seed`` does what it does for JAX
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
- **Several workers** (``workers: N``) are one JAX program over N processes
  (``jax.distributed``, ``join_group``) under ``keras.distribution.DataParallel`` over every
  process's devices; each rank feeds only its own rows of every global batch
  (``Cluster.rows``), so N processes train exactly as one process with N devices would.
- **Compilation is most of a cold start** (BENCHMARKS.md, 5.4). The persistent compile cache
  lives in the local tier and is mirrored to the run directory (``compile_cache.py``), so a
  recovery and a recycled VM start warm.
"""
from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

from orchestrator.core import backends, tpuvm
from orchestrator.core.rundir import ENV_STRATEGY
from orchestrator.train import datasets
from orchestrator.train.accelerators import AcceleratorUnavailable
from orchestrator.train.backends.base import Placement
from orchestrator.train.compile_cache import CompileCache
from orchestrator.train.epochdata import EpochData, is_pydataset
from orchestrator.train.errors import JobError

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
        return self.distribution.scope() if self.distribution is not None \
            else contextlib.nullcontext()


def array_batches(x, y, seed: int, begin: int, end: int, global_batch: int,
                  drop_remainder: bool, skip_batches: int = 0, rows: slice | None = None):
    """``part_batches`` of an ``(x, y)`` pair."""
    return part_batches((x, y), seed, begin, end, global_batch, drop_remainder,
                        skip_batches, rows)


def part_batches(part, seed: int, begin: int, end: int, global_batch: int,
                 drop_remainder: bool, skip_batches: int = 0, rows: slice | None = None):
    """Batches of epochs ``begin .. end-1`` of in-memory data (``datasets.JobData``'s part: x,
    (x, y), (x, y, sample_weight), dicts or tuples of arrays), each epoch in the order of a
    permutation drawn from ``(seed, epoch)`` alone, less the first ``skip_batches`` of
    ``begin``. A generator: ``fit`` draws exactly ``steps_per_epoch`` batches per epoch; each
    batch is a tuple (x alone: ``(x,)``), as Keras requires of a generator's.
    ``rows``: only these rows of every global batch (a rank of a group feeds its own part)."""
    n = datasets.rows(part)
    last = n - global_batch + 1 if drop_remainder else n
    for epoch in range(begin, end):
        order = np.random.default_rng([seed, epoch]).permutation(n)
        for i, start in enumerate(range(0, max(last, 0), global_batch)):
            if epoch == begin and i < skip_batches:
                continue
            idx = order[start:start + global_batch]
            if rows is not None:
                idx = idx[rows]
            batch = datasets.map_part(lambda a, idx=idx: a[idx], part)
            # Keras takes a generator's batch only as a tuple: x alone is (x,), which its
            # unpack_x_y_sample_weight (Keras's train_step, and a job's own) reads as x
            yield batch if isinstance(batch, tuple) else (batch,)


def rank_rows_of(n: int, global_batch: int, rows: slice) -> np.ndarray:
    """The indices of ``rows`` of every whole global batch of ``n`` examples in order (a rank's
    part of the validation data); a partial last batch is left out."""
    starts = np.arange(n // global_batch)[:, None] * global_batch
    return (starts + np.arange(global_batch)[rows][None, :]).ravel()


def join_group(group) -> None:
    """Make this process rank ``group.rank`` of one JAX program over ``group.size`` processes,
    before anything initialises JAX's devices (``jax.distributed.initialize`` must come
    first), with every socket pinned to the addresses the engine gave the group:

    - the coordination service runs in rank 0 on rank 0's address, bound to exactly that
      address (JAX's default binds every interface, ``[::]:port``); cluster auto-detection is
      off (SLURM, MPI or a TPU pod's metadata would override what the supervisor says);
    - the CPU collectives (gloo) listen on this rank's own host (JAX's default resolves the
      machine's hostname, which is not loopback where the engine placed the group on it);
    - JAX's preemption service is off: it takes SIGTERM, and the worker's own SIGTERM
      handling (the emergency checkpoint, ``preemption.py``) must keep it.

    A restarted group gets fresh ports from the supervisor (``supervise/group.py``), and the
    old service died with the old rank 0, which the supervisor killed."""
    import jax

    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(coordinator_address=group.coordinator,
                               num_processes=group.size, process_id=group.rank,
                               coordinator_bind_address=group.coordinator,
                               cluster_detection_method="deactivate")
    _pin_cpu_collectives(group.host)


def _pin_cpu_collectives(host: str) -> None:
    """JAX's CPU client with gloo bound to ``host``: JAX offers no setting for the address
    gloo listens on (it calls ``make_gloo_tcp_collectives`` without a hostname), so the CPU
    backend's factory is registered again with the collectives made here; JAX creates the
    client from it at the first device query."""
    import functools

    from jax._src import distributed, xla_bridge
    from jaxlib import _jax

    collectives = _jax.make_gloo_tcp_collectives(distributed.global_state.client,
                                                 hostname=host)
    xla_bridge.register_backend_factory(
        "cpu", functools.partial(xla_bridge.make_cpu_client, collectives=collectives),
        priority=0, fail_quietly=False)


class JaxBackend:
    name = "jax"
    # where bit-exact resume under kills is proven: the CPU (the end-to-end tests), and one
    # GPU with XLA's deterministic ops (an H200: bench/gpu_check.py); never on a TPU yet
    exact_on = ("CPU", "GPU")
    cache = None  # compile_cache.CompileCache, once configured for a run
    traced_reader = False  # Snapshot.warm traces the reader before the first checkpoint
    group = None  # multiworker.Cluster, once this process joined its group (placement)

    def import_framework(self) -> None:
        """Import JAX and Keras on it, or say in one line what to install."""
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
        if cpu_devices and int(cpu_devices) > 1:
            _add_xla_flags(f"{_CPU_SPLIT_FLAG}={int(cpu_devices)}")
        strategy = os.environ.get(ENV_STRATEGY) or spec.strategy  # a fallback's, if any
        # a TPU held by another process must fail this attempt with libtpu's own words, for
        # the supervisor to classify and recover, not train on the CPU (doctor's probe too)
        platforms = backends.jax_platforms(strategy, bool(tpuvm.device_files()))
        if platforms is not None:
            os.environ["JAX_PLATFORMS"] = platforms
        if standby:  # a standby beside the worker: neither takes 75 % of the GPU up front
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        if spec.deterministic:
            _add_xla_flags(*DETERMINISTIC_GPU_FLAGS)
        self.cache = CompileCache.for_spec(spec)
        self._pulled = self.cache.pull()

    def after_compile(self) -> None:
        """New executables were compiled (the first step, an epoch's evaluation): mirror the
        cache's new entries to the run directory in the background."""
        if self.cache is not None:
            self.cache.push_soon()

    def facts(self) -> dict:
        """For ``worker_ready``: the compile cache this worker started with; in a group, the
        coordination service it joined (a restarted group's is a new one)."""
        facts = {}
        if self.cache is not None:
            facts["compile_cache"] = {"dir": self.cache.local, "pulled": self._pulled,
                                      "entries_at_start": len(self.cache.found)}
        if self.group is not None:
            facts["distributed"] = {"coordinator": self.group.coordinator,
                                    "processes": self.group.size, "process": self.group.rank}
        return facts

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

        if group is not None and self.group is None:
            join_group(group)
            self.group = group
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
            # in a group every rank feeds its own rows (Cluster.rows): Keras must not shard
            # the data again (it would insist on a tf.data dataset to shard)
            dp = keras.distribution.DataParallel(devices=devices,
                                                 auto_shard_dataset=self.group is None)
            keras.distribution.set_distribution(dp)
            where = "" if self.group is None else \
                f", {self.group.size} processes, rank {self.group.rank}"
            return Placement(_Replicated(dp, len(devices)),
                             f"{kind} x{len(devices)} (JAX DataParallel{where})", len(devices),
                             is_tpu, plain=False, drop_remainder=True)
        return Placement(_Replicated(), f"{kind} (JAX, {devices[0].device_kind})", 1, is_tpu,
                         plain=kind == "CPU", drop_remainder=is_tpu)

    def train_data(self, data, seed: int, begin: int, end: int, global_batch: int,
                   drop_remainder: bool, skip_batches: int = 0):
        if isinstance(data.train, EpochData):  # the job's own batches (one process: fixed())
            return data.train.batches(seed, begin, end, skip_batches)
        rows = self.group.rows(global_batch) if self.group is not None else None
        if datasets.is_tf_dataset(data.train):  # TensorFlow is installed: the job made one
            ds = datasets.train_dataset(data, seed, begin, end, global_batch, drop_remainder,
                                        skip_batches=skip_batches)
            return ds if rows is None else _rank_part(ds, rows)
        return part_batches(data.train, seed, begin, end, global_batch, drop_remainder,
                            skip_batches, rows=rows)

    def validation_data(self, data, global_batch: int, drop_remainder: bool):
        if data.validation is None or is_pydataset(data.validation):
            return data.validation  # a PyDataset: Keras's evaluate reads it in index order
        if datasets.is_tf_dataset(data.validation):
            ds = datasets.validation_dataset(data, global_batch, drop_remainder)
            return ds if ds is None or self.group is None else \
                _rank_part(ds, self.group.rows(global_batch))
        val, n = data.validation, datasets.rows(data.validation)
        if self.group is not None:  # this rank's rows of every whole global batch
            idx = rank_rows_of(n, global_batch, self.group.rows(global_batch))
            return datasets.map_part(lambda a: a[idx], val)
        if drop_remainder:
            keep = n - n % global_batch
            val = datasets.map_part(lambda a: a[:keep], val)
        return val

    def fit_options(self, global_batch: int) -> dict:
        """The validation arrays in batches of what this process feeds (a rank of a group: its
        part of the global batch); the training order is ours, by (seed, epoch)."""
        per_process = global_batch // (self.group.size if self.group is not None else 1)
        return {"validation_batch_size": per_process, "shuffle": False}

    def validation_sample(self, val, global_batch: int):
        """One validation batch of the real shape (the standby's traced step compiles the
        evaluation for it)."""
        if val is None or is_pydataset(val):
            return None  # a PyDataset's evaluation is traced at the first epoch's end
        if datasets.is_tf_dataset(val):
            return val.take(1)
        return datasets.map_part(lambda a: a[:global_batch], val)

    def input_errors(self) -> tuple:
        # jax.numpy's shape errors are TypeErrors ("dot_general requires contracting
        # dimensions to have the same shape"); Keras's own checks raise ValueError
        return (ValueError, TypeError)

    def reader(self, variables):
        """Every variable's value in one transfer to the host. In a group a variable spans
        every process's devices; it is replicated (DataParallel), so this process's own copy
        is the value, read without the other processes (``local_value``)."""
        import jax

        return lambda: jax.device_get([local_value(v.value) for v in variables])

    def view(self, variable) -> np.ndarray:
        """A variable's value to read now: its array's host buffer (``.numpy()`` copies it),
        this process's own copy in a group (``local_value``). Not to be kept."""
        return np.asarray(local_value(variable.value))

    def leave(self, rc: int) -> int:
        """A rank of a group that failed exits at once: JAX's exit hook would otherwise wait
        in a shutdown barrier for every rank (300 s), while the others wait in a collective
        for this one: the supervisor would see no exit until the hang clock fired, and call
        it a hang (measured: the failing rank sat 300 s in the barrier, then aborted). The
        supervisor stops the other ranks when this one's exit reaches it."""
        if rc != 0 and self.group is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return rc

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

    @contextlib.contextmanager
    def saving(self):
        """Keras's serialisation asks whether TensorFlow is importable before testing each
        value against its types (``tf.available`` in ``serialization_lib``), and so imports it
        into a JAX process that saves a ``.keras`` file: 1.7 s and its memory at the end of a
        digits run. No value can be of a TensorFlow type in a process that never imported
        TensorFlow, so there the answer is no, for the length of the save."""
        lazy = getattr(sys.modules.get("keras.src.utils.module_utils"), "tensorflow", None)
        if "tensorflow" in sys.modules or getattr(lazy, "_available", False) is not None:
            yield  # imported, already answered, or a Keras that asks otherwise
            return
        lazy._available = False
        try:
            yield
        finally:
            if "tensorflow" not in sys.modules:
                lazy._available = None  # asked afresh by whatever needs the real answer


def local_value(array):
    """A replicated array's value from this process's own devices (its first addressable
    shard); an array that is all on this process as it is. A variable sharded over other
    processes' devices has no local whole value: say so rather than gather it."""
    if getattr(array, "is_fully_addressable", True):
        return array
    if not array.is_fully_replicated:
        raise ValueError(f"a variable of shape {array.shape} is sharded over other processes' "
                         f"devices ({array.sharding}); a checkpoint reads replicated variables "
                         f"only (DataParallel)")
    return array.addressable_data(0)


def _rank_part(ds, rows: slice):
    """This rank's rows of every global batch of a ``tf.data`` pipeline."""
    import tensorflow as tf

    return ds.map(lambda *batch: tf.nest.map_structure(lambda t: t[rows], batch))

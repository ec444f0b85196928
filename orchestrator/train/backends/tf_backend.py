"""Keras on TensorFlow: what the worker did before it had a second backend, bit for bit.

Strategies from ``tf.distribute`` (accelerators.py, multiworker.py), the data as ``tf.data``
pipelines whose order is a function of (seed, epoch) (datasets.py), op determinism, and the
state read by one compiled function (state.py's ``Snapshot``).
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np

from orchestrator.train import datasets, multiworker
from orchestrator.train.accelerators import gpu_memory_growth, resolve_strategy, split_cpu
from orchestrator.train.backends.base import Placement
from orchestrator.train.epochdata import is_pydataset
from orchestrator.train.errors import JobError


class TensorFlowBackend:
    name = "tensorflow"
    # where bit-exact resume under kills is proven (the end-to-end tests: one CPU, a CPU split
    # into replicas, a group of CPU workers); a GPU's or a TPU's kernels were never run by this
    # project on TensorFlow
    exact_on = ("CPU", "MultiWorkerMirrored")
    traced_reader = True  # Snapshot.warm traces the reader before the first checkpoint

    def import_framework(self) -> None:
        """Import TensorFlow and Keras, or say in one line which extra to install."""
        try:
            import tensorflow as tf  # noqa: F401
            import keras  # noqa: F401
        except ModuleNotFoundError as exc:
            if exc.name not in ("tensorflow", "keras"):
                raise
            raise JobError(
                f"TensorFlow is not installed for {sys.executable}: install the extra "
                f"`pip install 'orchestrator[cpu]'` (or '[tensorflow]' for GPU); on a Colab TPU "
                f"runtime train on JAX (`backend: jax`), which the image ships (no tensorflow-tpu "
                f"fits today's image); never install plain tensorflow there") from None

    def versions(self) -> dict:
        import keras
        import tensorflow as tf

        return {"tensorflow": tf.__version__, "keras": keras.__version__}

    def configure(self, spec, cpu_devices: str | None, standby: bool) -> None:
        """Before TensorFlow initialises its devices: the CPU split (tests), and memory growth
        when a standby shares the GPU."""
        self.import_framework()  # a missing TensorFlow is the one line naming the extra
        split_cpu(cpu_devices)
        if standby:
            gpu_memory_growth()

    def seed(self, seed: int, deterministic: bool) -> None:
        import keras
        import tensorflow as tf

        keras.utils.set_random_seed(seed)
        if deterministic:
            tf.config.experimental.enable_op_determinism()

    def placement(self, spec, group, reinitialise: bool) -> Placement:
        import tensorflow as tf

        strategy, described = (multiworker.strategy(group) if group else
                               resolve_strategy(spec.strategy, reinitialise=reinitialise))
        is_tpu = isinstance(strategy, tf.distribute.TPUStrategy)
        return Placement(strategy, described, strategy.num_replicas_in_sync, is_tpu,
                         plain=strategy is tf.distribute.get_strategy(), drop_remainder=is_tpu)

    def normalise(self, result, where: str):
        return datasets.normalise(result, where)

    def train_data(self, data, seed: int, begin: int, end: int, global_batch: int,
                   drop_remainder: bool, skip_batches: int = 0):
        return datasets.train_dataset(data, seed, begin, end, global_batch, drop_remainder,
                                      skip_batches=skip_batches)

    def validation_data(self, data, global_batch: int, drop_remainder: bool):
        return datasets.validation_dataset(data, global_batch, drop_remainder)

    def fit_options(self, global_batch: int) -> dict:
        return {}

    def validation_sample(self, val, global_batch: int):
        """One validation batch (the standby's traced step); none of a PyDataset, whose
        evaluation is traced at the first epoch's end."""
        return val.take(1) if val is not None and not is_pydataset(val) else None

    def input_errors(self) -> tuple:
        """What a model and data that do not fit raise in the first step's forward pass."""
        import tensorflow as tf

        return (ValueError, tf.errors.InvalidArgumentError)

    def reader(self, variables):
        """One ``tf.function`` returning every variable's value (one call instead of one per
        variable) as tensors, which ``np.asarray`` views without a copy (``.numpy()`` copies
        into fresh memory: 0.5 s of page faults for 1.26 GB, before the snapshot's own copy);
        None for distributed variables, which are read one by one."""
        import tensorflow as tf

        raw = [getattr(v, "value", v) for v in variables]
        if any(isinstance(r, tf.distribute.DistributedValues) for r in raw) \
                or tf.distribute.has_strategy():
            return None
        fn = tf.function(lambda: [tf.identity(r) for r in raw])
        return fn

    def view(self, variable) -> np.ndarray:
        """A variable's value to read now, as an array over the tensor TensorFlow reads it into
        (``.numpy()`` copies that into fresh memory: seconds of page faults for gigabytes);
        a distributed variable's through ``.numpy()``. Not to be kept: TensorFlow copies a
        variable on its next update while a read of it is held (copy-on-write)."""
        import tensorflow as tf

        value = getattr(variable, "value", variable)
        if isinstance(value, tf.distribute.DistributedValues) or not hasattr(value, "read_value"):
            return np.asarray(variable.numpy())
        return np.asarray(value.read_value())

    def can_export_saved_model(self) -> str | None:
        return None

    def saving(self):
        """TensorFlow is this process's framework: Keras's saving asks nothing it lacks."""
        return contextlib.nullcontext()

    def after_compile(self) -> None:
        """TensorFlow keeps no compile cache across processes: nothing to mirror."""

    def facts(self) -> dict:
        return {}

    def leave(self, rc: int) -> int:
        """A failed rank exits as any process does: MWMS holds no exit barrier."""
        return rc

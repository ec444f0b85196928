"""The job's data as tf.data pipelines whose order is a function of (seed, epoch) alone.

Keras shuffles with a process-local stream, so an epoch replayed after a restart would see a
different order. Here each epoch's permutation is drawn from a stateless RNG keyed by the seed
and the epoch number, inside the graph (TPU-safe: no Python generators), and the epochs are
chained in one dataset that ``fit`` consumes with ``steps_per_epoch``. A run resumed in the
middle of an epoch skips the batches that epoch already trained on.
"""
from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import numpy as np


class DataError(Exception):
    """The data factory returned something this tool cannot train on."""


@dataclass
class JobData:
    train: tuple | object  # (x, y) arrays, or an unbatched tf.data.Dataset of (x, y)
    validation: tuple | object | None
    num_examples: int


def is_tf_dataset(obj) -> bool:
    """A ``tf.data.Dataset``, asked without importing TensorFlow (the JAX backend may have
    none): an object of that class can only exist where TensorFlow was imported."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(obj, tf.data.Dataset)


def normalise(result, where: str) -> JobData:
    """Accept ``{"train": ..., "validation": ...}``, ``(train, validation)`` or ``(x, y)``."""
    if isinstance(result, dict):
        unknown = set(result) - {"train", "validation"}
        if "train" not in result or unknown:
            raise DataError(f"{where}: expected a dict with 'train' and optionally 'validation', "
                            f"got keys {sorted(result)}")
        train, val = result["train"], result.get("validation")
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], np.ndarray):
        train, val = result, None
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        train, val = result
    elif is_tf_dataset(result):
        train, val = result, None
    else:
        raise DataError(f"{where}: expected (x, y) arrays, (train, validation), a dict with "
                        f"'train'/'validation' or a tf.data.Dataset; got {type(result).__name__}")
    for name, part in (("train", train), ("validation", val)):
        if part is None or is_tf_dataset(part):
            continue
        if not (isinstance(part, (tuple, list)) and len(part) == 2):
            raise DataError(f"{where}: {name} data must be an (x, y) pair of arrays, "
                            f"got {type(part).__name__}")
        if len(part[0]) != len(part[1]):
            raise DataError(f"{where}: {name} x has {len(part[0])} rows but y has {len(part[1])}")
    if is_tf_dataset(train):
        n = int(train.cardinality())
        if n < 0:  # unknown or infinite: count once
            n = int(train.reduce(np.int64(0), lambda c, _: c + 1))
    else:
        train = (np.asarray(train[0]), np.asarray(train[1]))
        n = len(train[0])
    if n == 0:
        raise DataError(f"{where}: the training data is empty")
    if val is not None and not is_tf_dataset(val):
        val = (np.asarray(val[0]), np.asarray(val[1]))
    return JobData(train, val, n)


def steps_per_epoch(num_examples: int, global_batch: int, drop_remainder: bool) -> int:
    steps = num_examples // global_batch if drop_remainder else math.ceil(num_examples / global_batch)
    if steps == 0:
        raise DataError(f"{num_examples} training examples are fewer than one global batch of "
                        f"{global_batch}: lower batch_size")
    return steps


def train_dataset(data: JobData, seed: int, start_epoch: int, end_epoch: int, global_batch: int,
                  drop_remainder: bool, skip_batches: int = 0):
    """Batches for epochs ``start_epoch .. end_epoch-1``, each in its own (seed, epoch) order,
    less the first ``skip_batches`` of ``start_epoch``."""
    import tensorflow as tf

    if isinstance(data.train, tf.data.Dataset):
        base = data.train

        def epoch(e):
            return base.shuffle(min(data.num_examples, 10_000), seed=seed * 1_000_003 + e,
                                reshuffle_each_iteration=False).batch(global_batch, drop_remainder)
    else:
        x, y = (tf.constant(a) for a in data.train)
        n = data.num_examples

        def epoch(e):
            key = tf.stack([tf.constant(seed, tf.int64), e])
            perm = tf.argsort(tf.random.stateless_uniform([n], seed=key))
            idx = tf.data.Dataset.from_tensor_slices(perm).batch(global_batch, drop_remainder)
            return idx.map(lambda i: (tf.gather(x, i), tf.gather(y, i)))

    if isinstance(data.train, tf.data.Dataset):
        # The epochs one after another with a Python int for each shuffle's seed: a seed tensor
        # (flat_map over a range) fails TensorFlow's own seed check when the global seed is 0
        # (`seed: 0`: "Using a symbolic tf.Tensor as a Python bool", random_seed.get_seed
        # compares the pair with (0, 0)); with an int the order is the same as it was.
        ds = functools.reduce(lambda a, b: a.concatenate(b),
                              [epoch(e) for e in range(start_epoch, end_epoch)])
    else:
        ds = tf.data.Dataset.range(start_epoch, end_epoch).flat_map(epoch)
    if skip_batches:
        ds = ds.skip(skip_batches)
    if isinstance(data.train, tf.data.Dataset):
        return ds.prefetch(tf.data.AUTOTUNE)  # the job's pipeline: its own tuning
    return _in_memory(ds.prefetch(2))


def _in_memory(ds):
    """No tf.data autotuning for batches gathered from tensors in memory: it has nothing to
    tune, and its model thread, when the iterator is deleted at the end of ``fit``, was measured
    here to hold the main thread for up to 20 s (in ~RootDataset::Iterator) before the last
    checkpoint could be committed."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def validation_dataset(data: JobData, global_batch: int, drop_remainder: bool):
    if data.validation is None:
        return None
    import tensorflow as tf

    if isinstance(data.validation, tf.data.Dataset):
        return data.validation.batch(global_batch, drop_remainder)
    return _in_memory(tf.data.Dataset.from_tensor_slices(data.validation)
                      .batch(global_batch, drop_remainder))


def sample_batch(data: JobData, size: int):
    """A few training examples ``(x, y)``, to build the model's and the metrics' variables
    before training (a checkpoint can only be restored into variables that exist)."""
    if is_tf_dataset(data.train):
        return next(iter(data.train.batch(size)))
    return data.train[0][:size], data.train[1][:size]

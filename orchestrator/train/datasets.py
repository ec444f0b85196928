"""The job's data as tf.data pipelines whose order is a function of (seed, epoch) alone.

Keras shuffles with a process-local stream, so an epoch replayed after a restart would see a
different order. Here each epoch's permutation is drawn from a stateless RNG keyed by the seed
and the epoch number, inside the graph (TPU-safe: no Python generators), and the epochs are
chained in one dataset that ``fit`` consumes with ``steps_per_epoch``. A run resumed in the
middle of an epoch skips the batches that epoch already trained on. Data whose batches the job
makes (a ``keras.utils.PyDataset``, a generator function of the epoch) is ``epochdata.py``'s.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import numpy as np

from orchestrator.train import epochdata
# leaves, unpack and DataError are re-exported: datasets.X for the backends and the tests
from orchestrator.train.batches import leaves, steps_per_epoch, unpack  # noqa: F401
from orchestrator.train.errors import DataError  # noqa: F401


# The keys of the dict a data factory may return; the last two only with a PyDataset or a
# generator function as 'train' (epochdata.py).
EPOCH_DATA_KEYS = ("steps_per_epoch", "shuffle")
DATA_KEYS = {"train", "validation", *EPOCH_DATA_KEYS}


@dataclass
class JobData:
    # a part: (x,) / (x, y) / (x, y, sample_weight), or x alone (an array or a dict of arrays),
    # each of x, y, sample_weight an array or a dict or tuple of arrays; or an unbatched
    # tf.data.Dataset of such elements; or an epochdata.EpochData (a PyDataset, a generator
    # function of the epoch), whose batches are the job's
    train: tuple | object
    validation: tuple | object | None
    num_examples: int


def is_tf_dataset(obj) -> bool:
    """A ``tf.data.Dataset``, asked without importing TensorFlow (the JAX backend may have
    none): an object of that class can only exist where TensorFlow was imported."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(obj, tf.data.Dataset)


def map_part(fn, part):
    """``part`` with ``fn`` applied to each of its arrays, its structure kept (lists become
    tuples: tf.data would stack a list of arrays into one tensor)."""
    if isinstance(part, dict):
        return {k: map_part(fn, v) for k, v in part.items()}
    if isinstance(part, (tuple, list)):
        return tuple(map_part(fn, v) for v in part)
    return fn(part)


def _part(part, name: str, where: str):
    """One of train / validation as arrays, checked: every array has the same number of rows."""
    if part is None or is_tf_dataset(part) or epochdata.is_pydataset(part):
        return part
    if epochdata.is_generator_like(part):
        raise DataError(f"{where}: {name} data is a {type(part).__name__}: a generator is read "
                        f"once and cannot be rewound; give arrays, a tf.data.Dataset or a "
                        f"keras.utils.PyDataset")
    if isinstance(part, (tuple, list)) and not 1 <= len(part) <= 3:
        raise DataError(f"{where}: {name} data must be x, (x,), (x, y) or (x, y, sample_weight) "
                        f"(as Keras's fit takes them), got a {type(part).__name__} of "
                        f"{len(part)} items")
    if not isinstance(part, (tuple, list, dict, np.ndarray)) and not hasattr(part, "__array__"):
        raise DataError(f"{where}: {name} data must be arrays: x, (x, y) or (x, y, "
                        f"sample_weight), got {type(part).__name__}")
    part = map_part(np.asarray, part)
    rows = {len(a) if a.ndim else 0 for a in leaves(part)}
    if len(rows) != 1:
        raise DataError(f"{where}: {name} arrays have different numbers of rows "
                        f"({', '.join(str(r) for r in sorted(rows))}): x, y and sample_weight "
                        f"must have one row per example")
    return part


def rows(part) -> int:
    return len(leaves(part)[0])


def normalise(result, where: str) -> JobData:
    """Accept ``{"train": ..., "validation": ...}``, ``(train, validation)``, ``(x, y)``, or x
    alone (an array: a model whose ``train_step`` needs no labels). A part is what Keras's
    ``fit`` takes: x, (x,), (x, y) or (x, y, sample_weight), where x, y and the weights may be
    dicts or tuples of arrays (several inputs or outputs); a tuple of inputs with no labels is
    written ((x1, x2),)."""
    own = {}  # the data dict's keys for a PyDataset or a generator function
    if isinstance(result, dict):
        unknown = set(result) - DATA_KEYS
        if "train" not in result or unknown:
            raise DataError(f"{where}: expected a dict with 'train' and optionally "
                            f"'validation' (and, for a PyDataset or a generator function, "
                            f"'steps_per_epoch', 'shuffle'), got keys {sorted(result)}")
        train, val = result["train"], result.get("validation")
        own = {k: result[k] for k in EPOCH_DATA_KEYS if k in result}
    elif isinstance(result, np.ndarray):
        train, val = result, None
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], np.ndarray):
        train, val = result, None
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        train, val = result
    elif (is_tf_dataset(result) or epochdata.is_pydataset(result)
          or epochdata.is_generator_like(result)):  # the last refused by make, saying why
        train, val = result, None
    else:
        raise DataError(f"{where}: expected x or (x, y) arrays, (train, validation), a dict with "
                        f"'train'/'validation', a tf.data.Dataset or a keras.utils.PyDataset; "
                        f"got {type(result).__name__}")
    if epochdata.is_pydataset(train) or epochdata.is_generator_like(train):
        made = epochdata.make(train, own.get("steps_per_epoch"), own.get("shuffle"), where)
        return JobData(made, _part(val, "validation", where), made.steps * made.rows)
    if own:
        raise DataError(f"{where}: {', '.join(repr(k) for k in sorted(own))} apply to a "
                        f"keras.utils.PyDataset or a generator function of the epoch only; "
                        f"arrays and tf.data are batched by batch_size in the (seed, epoch) order")
    train, val = _part(train, "train", where), _part(val, "validation", where)
    if is_tf_dataset(train):
        n = int(train.cardinality())
        if n < 0:  # unknown or infinite: count once
            n = int(train.reduce(np.int64(0), lambda c, _: c + 1))
    else:
        n = rows(train)
    if n == 0:
        raise DataError(f"{where}: the training data is empty")
    return JobData(train, val, n)


def batching(data: JobData, global_batch: int, drop_remainder: bool, replicas: int,
             in_group: bool) -> tuple[int, int]:
    """(global batch, steps per epoch) of ``data``: ``batch_size`` x replicas over its examples,
    or, for a PyDataset or a generator function, its own batch and steps (``EpochData.fixed``,
    which refuses several replicas or workers)."""
    if isinstance(data.train, epochdata.EpochData):
        return data.train.fixed(replicas, in_group)
    return global_batch, steps_per_epoch(data.num_examples, global_batch, drop_remainder)


def train_dataset(data: JobData, seed: int, start_epoch: int, end_epoch: int, global_batch: int,
                  drop_remainder: bool, skip_batches: int = 0):
    """Batches for epochs ``start_epoch .. end_epoch-1``, each in its own (seed, epoch) order,
    less the first ``skip_batches`` of ``start_epoch``. A PyDataset's or a generator
    function's are a Python generator (Keras's fit takes one on either backend)."""
    if isinstance(data.train, epochdata.EpochData):
        return data.train.batches(seed, start_epoch, end_epoch, skip_batches)
    import tensorflow as tf

    if isinstance(data.train, tf.data.Dataset):
        base = data.train

        def epoch(e):
            return base.shuffle(min(data.num_examples, 10_000), seed=seed * 1_000_003 + e,
                                reshuffle_each_iteration=False).batch(global_batch, drop_remainder)

        # The epochs one after another with a Python int for each shuffle's seed: a seed tensor
        # (flat_map over a range) fails TensorFlow's own seed check when the global seed is 0
        # (`seed: 0`: "Using a symbolic tf.Tensor as a Python bool", random_seed.get_seed
        # compares the pair with (0, 0)); with an int the order is the same as it was.
        ds = functools.reduce(lambda a, b: a.concatenate(b),
                              [epoch(e) for e in range(start_epoch, end_epoch)])
    else:
        arrays = map_part(tf.constant, data.train)
        n = data.num_examples

        def epoch(e):
            key = tf.stack([tf.constant(seed, tf.int64), e])
            perm = tf.argsort(tf.random.stateless_uniform([n], seed=key))
            idx = tf.data.Dataset.from_tensor_slices(perm).batch(global_batch, drop_remainder)
            return idx.map(lambda i: map_part(lambda t: tf.gather(t, i), arrays))

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
    if data.validation is None or epochdata.is_pydataset(data.validation):
        return data.validation  # a PyDataset: Keras's evaluate reads it in index order
    import tensorflow as tf

    if isinstance(data.validation, tf.data.Dataset):
        return data.validation.batch(global_batch, drop_remainder)
    return _in_memory(tf.data.Dataset.from_tensor_slices(data.validation)
                      .batch(global_batch, drop_remainder))


def sample_batch(data: JobData, size: int):
    """A few training examples in the structure of a training batch (``unpack`` gives x, y,
    sample_weight), to build the model's and the metrics' variables before training (a
    checkpoint can only be restored into variables that exist)."""
    if is_tf_dataset(data.train):
        return next(iter(data.train.batch(size)))
    if isinstance(data.train, epochdata.EpochData):
        return map_part(lambda a: np.asarray(a)[:size], data.train.first)
    return map_part(lambda a: a[:size], data.train)

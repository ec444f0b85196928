"""What a part of the job's data is made of, and how many batches an epoch holds: a leaf shared
by the in-memory pipelines (datasets.py) and the job's own batches (epochdata.py)."""
from __future__ import annotations

import math

from orchestrator.train.errors import DataError


def leaves(part) -> list:
    """The arrays of a part, in order (dicts by their insertion order)."""
    if isinstance(part, dict):
        return [a for v in part.values() for a in leaves(v)]
    if isinstance(part, (tuple, list)):
        return [a for v in part for a in leaves(v)]
    return [part]


def unpack(batch) -> tuple:
    """(x, y, sample_weight) of a batch, by the rule Keras's ``fit`` applies to one
    (``unpack_x_y_sample_weight``): a tuple of 1, 2 or 3 is (x), (x, y), (x, y, sw); anything
    else is x alone."""
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple):
        return batch, None, None
    return tuple(batch) + (None,) * (3 - len(batch))


def steps_per_epoch(num_examples: int, global_batch: int, drop_remainder: bool) -> int:
    """Batches in an epoch of ``num_examples``; none is a DataError naming the batch size."""
    steps = (num_examples // global_batch if drop_remainder
             else math.ceil(num_examples / global_batch))
    if steps == 0:
        raise DataError(f"{num_examples} training examples are fewer than one global batch of "
                        f"{global_batch}: lower batch_size")
    return steps

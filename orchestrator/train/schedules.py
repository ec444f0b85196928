"""Learning-rate schedules by epoch, as plain functions ``(epoch, lr) -> lr`` (no TensorFlow).

The built-in schedules are functions of the epoch and of the base rate alone (``initial``, or the
rate the optimizer was compiled with, read before any checkpoint is restored), so a resumed run
re-derives the same rate at each epoch as an uninterrupted one. A user function may also use the
current rate: that rate lives in the optimizer's state, which every checkpoint holds.
"""
from __future__ import annotations

import bisect
import math
from typing import Callable

from orchestrator.core.spec import LearningRateSpec

Schedule = Callable[[int, float], float]


def get_learning_rate(optimizer) -> float | None:
    """The current rate through the public property (wrappers such as LossScaleOptimizer
    forward it to the optimizer they wrap); None for a model compiled without an optimizer (a
    custom ``train_step`` with optimizers of its own)."""
    if optimizer is None:
        return None
    import keras  # here, not above: the doctor's schedule checks run without a framework

    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def step_decay(initial: float, factor: float = 0.1, every: int = 1) -> Schedule:
    """``initial * factor ** (epoch // every)``."""
    return lambda epoch, lr: initial * factor ** (epoch // every)


def cosine(initial: float, epochs: int, minimum: float = 0.0, warmup_epochs: int = 0,
           decay_epochs: int | None = None) -> Schedule:
    """Linear warm-up to ``initial``, then a half cosine down to ``minimum`` over the rest."""
    span = decay_epochs if decay_epochs is not None else max(1, epochs - warmup_epochs)

    def rate(epoch: int, lr: float) -> float:
        if epoch < warmup_epochs:
            return initial * (epoch + 1) / warmup_epochs
        t = min(epoch - warmup_epochs, span) / span
        return minimum + (initial - minimum) * 0.5 * (1.0 + math.cos(math.pi * t))

    return rate


def piecewise(boundaries: list[int], values: list[float]) -> Schedule:
    """``values[i]`` from epoch ``boundaries[i-1]`` (0 for the first) until ``boundaries[i]``."""
    return lambda epoch, lr: values[bisect.bisect_right(boundaries, epoch)]


def build(spec: LearningRateSpec, base_lr: float, epochs: int,
          function: Callable | None = None) -> Schedule:
    """The schedule the spec describes; ``function`` is the user's, already imported."""
    p = dict(spec.params)
    if spec.schedule == "function":
        if function is None:
            raise ValueError("a 'function' schedule needs the imported function")
        return lambda epoch, lr: float(function(epoch, lr))
    if spec.schedule == "piecewise":
        return piecewise(p["boundaries"], p["values"])
    initial = p.pop("initial", base_lr)
    if spec.schedule == "step_decay":
        return step_decay(initial, **p)
    if spec.schedule == "cosine":
        return cosine(initial, epochs, **p)
    raise ValueError(f"unknown schedule {spec.schedule!r}")

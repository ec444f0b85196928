"""What every backend returns or raises, in a leaf its implementations import (the package's
``__init__`` chooses among them)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Placement:
    """Where the model lives: ``strategy`` has ``scope()`` and ``num_replicas_in_sync`` (a
    ``tf.distribute`` strategy, or JAX's stand-in for one); ``plain`` is one default device
    and no distribution (the exporter process would build the same model: the worker may
    export it itself)."""

    strategy: object
    described: str
    replicas: int
    is_tpu: bool
    plain: bool
    drop_remainder: bool


def exactness(placement: Placement, deterministic: bool, verified_on: tuple) -> str | None:
    """None where a resume has been verified bit-exact on this kind of device, else why it
    is not promised (journaled with ``worker_ready``): a guarantee is only what was measured."""
    if not deterministic:
        return "deterministic is off"
    kind = placement.described.split()[0]
    if kind in verified_on:
        return None
    return (f"exact resume is not verified on {kind} with this backend (verified on "
            f"{', '.join(verified_on)}); the run resumes, the weights may differ in the last bits")


class BackendUnavailable(Exception):
    """The run's backend is not installed here; the message names what to install."""

"""Several worker processes training one model: MultiWorkerMirroredStrategy from ``TF_CONFIG``.

The supervisor (supervise/group.py) starts one worker per rank with a ``TF_CONFIG`` naming every
worker's address and this one's index; rank 0 is the chief. Under MWMS:

- every rank reads the same global batches (Keras auto-shards a distributed dataset by data, so
  each rank takes its part of every batch) and all-reduces gradients: the ranks stay identical;
- saving follows TensorFlow's rule for MWMS: every rank runs the save (a read of a variable may
  be a collective), the chief writes the checkpoint and the others write to a temporary folder
  that is deleted (train/callbacks.py);
- every rank restores the one step the supervisor names (``ORCHESTRATOR_RESTORE_STEP``), so
  that no rank resumes from a checkpoint another rank cannot see.

On JAX the same ``TF_CONFIG`` makes the ranks one ``jax.distributed`` program (rank 0's address
is the coordinator: ``Cluster.coordinator``) under ``keras.distribution.DataParallel``, each rank
feeding its own rows of every global batch (``Cluster.rows``); the rest is
``backends/jax_backend.py``'s.

Keras 3 (3.15 here) cannot ``fit`` under MWMS as it ships: the first batch is reduced with
``strategy.reduce(MEAN)`` outside a ``tf.function`` to build the model symbolically, and each
step's scalar logs with ``reduce(MEAN, axis=0)``; both raise ``ValueError`` ("Attempt to convert
a value (PerReplica...)", "Invalid reduction dimension 0 for input with 0 dimensions").
keras-team/keras#20585 and tensorflow/tensorflow#72388 report the first; Ray Train's own
TensorFlow example fails on it (ray-project/ray#47464). ``patch_keras`` replaces those two
reductions, for MWMS only: the symbolic build takes this rank's first replica's batch (only its
shapes are used), and the logs are averaged over every replica with ``axis=None``. Without it
the 2-worker end-to-end test fails at the first ``fit``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    rank: int
    size: int
    addresses: tuple

    @property
    def chief(self) -> bool:
        return self.rank == 0

    @property
    def coordinator(self) -> str:
        """Rank 0's address: where JAX's coordination service listens (jax.distributed). The
        supervisor picks a free port for every rank of every attempt, so a restarted group
        never meets the service of a dead one."""
        return self.addresses[0]

    @property
    def host(self) -> str:
        """This rank's own host, as the engine placed it (loopback for the local engine, the
        node's address under Ray): what this rank's own listening sockets bind to."""
        return self.addresses[self.rank].rsplit(":", 1)[0]

    def rows(self, global_batch: int) -> slice:
        """This rank's rows of every global batch, when each rank feeds its own part (JAX):
        rank r takes rows [r * per_rank, (r + 1) * per_rank), the rows that land on its devices
        when one process holds them all, so N ranks train as one process with N devices."""
        if global_batch % self.size:
            raise ValueError(f"a global batch of {global_batch} cannot be split evenly over "
                             f"{self.size} workers")
        per_rank = global_batch // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)


def cluster(env=None) -> Cluster | None:
    """This worker's place in a multi-worker ``TF_CONFIG``, or None for a single worker."""
    raw = (os.environ if env is None else env).get("TF_CONFIG")
    if not raw:
        return None
    config = json.loads(raw)
    workers = tuple(config.get("cluster", {}).get("worker", ()))
    if len(workers) <= 1:
        return None
    return Cluster(int(config["task"]["index"]), len(workers), workers)


def in_group() -> bool:
    return cluster() is not None


def rank() -> int:
    """This worker's rank in its group (0 alone): from TF_CONFIG, read without TensorFlow;
    0 where TF_CONFIG cannot be read (an error record must still be written)."""
    try:
        group = cluster()
    except (ValueError, KeyError, TypeError):
        return 0
    return group.rank if group else 0


def strategy(c: Cluster):
    """MWMS over the cluster, with Keras made able to fit under it."""
    import tensorflow as tf

    s = tf.distribute.MultiWorkerMirroredStrategy()
    patch_keras()
    return s, (f"MultiWorkerMirrored ({c.size} workers, rank {c.rank}, "
               f"{s.num_replicas_in_sync} replicas)")


_PATCHED = False


def patch_keras() -> None:
    global _PATCHED
    if _PATCHED:
        return
    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer as tf_trainer

    def is_mwms(s) -> bool:
        return isinstance(s, tf.distribute.MultiWorkerMirroredStrategy)

    build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build

    def local_build(self, iterator=None, data_batch=None):
        s = self._distribute_strategy
        if s is not None and is_mwms(s) and iterator is not None and data_batch is None:
            for _, _, it in iterator:
                data_batch = tf.nest.map_structure(
                    lambda v: s.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues) else v, next(it))
                break
            iterator = None
        return build(self, iterator=iterator, data_batch=data_batch)

    reduce = tf_trainer.reduce_per_replica

    def reduce_per_replica(values, s, reduction):
        if reduction in ("auto", "mean") and is_mwms(s):
            return tf.nest.map_structure(
                lambda v: s.reduce("MEAN", v, axis=None)
                if isinstance(v, tf.distribute.DistributedValues) else v, values)
        return reduce(values, s, reduction)

    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = local_build
    tf_trainer.reduce_per_replica = reduce_per_replica
    _PATCHED = True

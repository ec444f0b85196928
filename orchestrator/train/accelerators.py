"""Strategy resolution for the worker: TPU, then GPU, then CPU, as the job allows.

TensorFlow is imported inside the functions only, so that importing this module stays cheap;
the supervisor still never calls into it.
"""
from __future__ import annotations

import logging
import os

from orchestrator.core import tpuvm

log = logging.getLogger(__name__)


class AcceleratorUnavailable(RuntimeError):
    """The job asked for an accelerator that this runtime does not offer (now)."""


def tpu_address() -> str | None:
    """What TPUClusterResolver should be given on this runtime, or None if no TPU is in sight.

    TPU VMs (Colab's TPU runtimes today) have the chips locally (``/dev/accel*`` or
    ``/dev/vfio``) and take ``tpu='local'``; old Colab TPU runtimes exposed a TPU node at
    ``COLAB_TPU_ADDR`` (gRPC). Local chips come first: a stale address left in the environment
    must not send a TPU VM's worker to a gRPC node (doctor checks in the same order).
    """
    if os.environ.get("TPU_NAME"):
        return os.environ["TPU_NAME"]
    if tpuvm.device_files():  # /dev/vfio/N, not /dev/vfio/vfio (any VFIO host has that one)
        return "local"
    addr = os.environ.get("COLAB_TPU_ADDR")
    if addr:
        return addr if addr.startswith("grpc://") else f"grpc://{addr}"
    return None


def split_cpu(devices: str | int | None) -> None:
    """Make the host CPU ``devices`` logical devices (before TensorFlow initialises them)."""
    if not devices or int(devices) <= 1:
        return
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(int(devices))])


def resolve_strategy(kind: str, reinitialise: bool = False):
    """Return ``(strategy, description)`` for ``kind`` in auto|tpu|gpu|cpu.

    ``reinitialise``: shut the TPU system down before initialising it (the recovery ladder's
    "reinitialise the accelerator" for a TPU context left broken by an earlier process).
    """
    import tensorflow as tf

    if kind in ("auto", "tpu"):
        addr = tpu_address()
        if addr is not None:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=addr)
            if addr != "local":
                tf.config.experimental_connect_to_cluster(resolver)
            if reinitialise:
                shutdown_tpu_system(tf, resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
            strategy = tf.distribute.TPUStrategy(resolver)
            return strategy, f"TPU ({addr}, {strategy.num_replicas_in_sync} cores)"
        if kind == "tpu":
            raise AcceleratorUnavailable(
                "strategy 'tpu' was asked for but no TPU is in sight: COLAB_TPU_ADDR and "
                "TPU_NAME are unset and there is no /dev/accel* (change the runtime type to TPU, "
                "or set strategy: auto)")
    if kind in ("auto", "gpu"):
        gpus = tf.config.list_logical_devices("GPU")
        if len(gpus) > 1:
            s = tf.distribute.MirroredStrategy()
            return s, f"GPU x{len(gpus)} (MirroredStrategy)"
        if gpus:
            return tf.distribute.OneDeviceStrategy(gpus[0].name), f"GPU ({gpus[0].name})"
        if kind == "gpu":
            raise AcceleratorUnavailable(
                "strategy 'gpu' was asked for but TensorFlow sees no GPU "
                "(check the runtime type, or set strategy: auto)")
    cpus = tf.config.list_logical_devices("CPU")
    if len(cpus) > 1:
        return tf.distribute.MirroredStrategy([d.name for d in cpus]), f"CPU x{len(cpus)}"
    return tf.distribute.get_strategy(), "CPU"


def shutdown_tpu_system(tf, resolver) -> None:
    """Best effort: a TPU system that was never initialised cannot be shut down, which is fine."""
    try:
        tf.tpu.experimental.shutdown_tpu_system(resolver)
        log.info("TPU system shut down before initialising it again")
    except (tf.errors.OpError, RuntimeError, ValueError) as exc:
        log.info(f"TPU system shutdown before re-initialisation failed ({exc}); "
                 f"initialising anyway")


def gpu_memory_growth() -> None:
    """Let TensorFlow take GPU memory as it needs it instead of nearly all of it at start, so
    that a standby worker can hold its model beside the training one (and the training one
    finds room when the standby is promoted). Before TensorFlow initialises its devices."""
    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError as exc:  # devices already initialised: nothing to change now
            log.info(f"GPU memory growth not set ({exc})")

"""The failure kinds and the recovery actions, each defined once.

A failed attempt gets one kind (recovery/failures.py classifies it); each kind has a ladder of
actions (recovery/policy.py). The names live here, in core/, because the job spec validates
``recovery.ladders`` against them and both processes read the spec. They are plain strings in
the journal and in the job file.
"""
from __future__ import annotations


class Kind:
    """What an attempt died of."""

    #: broken TensorFlow build or TPU context: a fresh process, then a fresh TPU system or TF
    ACCELERATOR_CONTEXT = "accelerator_context"
    #: the accelerator is lost or unreachable: wait for it
    ACCELERATOR_UNAVAILABLE = "accelerator_unavailable"
    #: the accelerator is held by another process
    ACCELERATOR_BUSY = "accelerator_busy"
    OUT_OF_MEMORY = "out_of_memory"
    #: the checkpoint place is unreachable or failing
    STORAGE = "storage"
    #: no heartbeat for hang_timeout (startup_timeout before the first step)
    HANG = "hang"
    #: the process vanished: a signal from outside, a recycled VM
    KILLED = "killed"
    #: the job's own code or configuration: retrying will not help
    USER_ERROR = "user_error"
    UNKNOWN = "unknown"


class Action:
    """What the supervisor does about a failure, one rung of a kind's ladder."""

    RESTART = "restart"
    REINIT_ACCELERATOR = "reinit_accelerator"
    REINSTALL_TENSORFLOW = "reinstall_tensorflow"
    WAIT_ACCELERATOR = "wait_accelerator"
    FALLBACK_STRATEGY = "fallback_strategy"
    HALVE_BATCH = "halve_batch"
    GIVE_UP = "give_up"


KINDS = tuple(v for k, v in vars(Kind).items() if k.isupper())
ACTIONS = tuple(v for k, v in vars(Action).items() if k.isupper())

"""Where everything lives in a run directory: the one place both processes agree on names.

The run directory (``root``) is often a Google Drive mount, which can vanish for seconds or
minutes. So the *control state* both processes write while a run is live - the journal, the
heartbeat, the attempt logs and error records, the fault marks - is written first to a folder on
the local disk (``control``, beside the local checkpoint tier) and mirrored to ``root`` by the
supervisor (supervise/controlmirror.py). What only matters once written (``run.json``, the job
copy, checkpoints, the export) lives in ``root``. A ``RunDir`` with no ``control`` (the
operator's commands, which read a run from anywhere) reads everything from ``root``.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

# The worker's exit code for "this will fail the same way again" (configuration, job code,
# missing TensorFlow): the supervisor does not spend restarts on it. sysexits' EX_CONFIG.
EXIT_CONFIG = 78
# `orchestrator run` stopped by a signal; the run is resumable (128 + SIGINT, as shells do).
EXIT_STOPPED = 130
# The worker saved its state on SIGTERM (a preemption notice) and exited (128 + SIGTERM).
EXIT_PREEMPTED = 143
# Another supervisor took the run directory over while this one could not reach it (core/lock.py's
# takeover rule); this one stopped. sysexits' EX_TEMPFAIL.
EXIT_LOCK_LOST = 75

# Split the host CPU into this many logical devices before TensorFlow starts (a worker then
# trains under a multi-replica MirroredStrategy on a CPU, as it would on 8 TPU cores): for tests.
CPU_DEVICES_ENV = "ORCHESTRATOR_CPU_DEVICES"

# What the supervisor tells the next worker attempt (recovery actions), by environment.
ENV_STRATEGY = "ORCHESTRATOR_STRATEGY"          # strategy fallback: tpu|gpu|cpu
ENV_BATCH_SIZE = "ORCHESTRATOR_BATCH_SIZE"      # per-replica batch after halving on OOM
# "1": shut down + initialise the TPU system (TensorFlow; on JAX a new process is a fresh
# context and the supervisor clears a stale libtpu lock instead: never set)
ENV_REINIT = "ORCHESTRATOR_REINIT_ACCELERATOR"
# Several workers: every rank restores exactly this step (none: start afresh), so that no rank
# resumes from a checkpoint another rank cannot see (supervise/group.py).
ENV_RESTORE_STEP = "ORCHESTRATOR_RESTORE_STEP"
# The backend the run trains on, never "auto" (core/backends.py resolves it).
ENV_BACKEND = "ORCHESTRATOR_BACKEND"
# The faults injected into the run (`--fault`, JSON; recovery/faults.py fires them).
ENV_FAULTS = "ORCHESTRATOR_FAULTS"
# Every variable above starts so: what a recovery action changed for the next worker is the
# environment's variables with this prefix (a standby started before it is discarded).
ENV_PREFIX = "ORCHESTRATOR_"
# Read by the supervisor only: how long Ray may take to place a group's workers (seconds).
ENV_RAY_PLACEMENT_TIMEOUT = "ORCHESTRATOR_RAY_PLACEMENT_TIMEOUT"
# Read by the supervisor only: the address of the Ray node it runs on, when Ray cannot find it
# itself (a cluster on loopback addresses other than 127.0.0.1: Ray would take 127.0.0.1, where
# no node of that cluster is, and wait for a raylet that never comes).
ENV_RAY_NODE_ADDRESS = "ORCHESTRATOR_RAY_NODE_ADDRESS"


# The control state's names, relative to ``RunDir.control`` and, mirrored, to ``RunDir.root``.
JOURNAL_FILE = "events.jsonl"
ATTEMPTS_DIR = "attempts"
FAULTS_DIR = "faults"
# TensorBoard's logs when a job says `tensorboard: true` (train/tensorboard.py), in ``root``.
TENSORBOARD_DIR = "tensorboard"


class RunDirUnreachable(Exception):
    """A supervisor cannot start: its run directory cannot be written (its lock is there)."""


@dataclass(frozen=True)
class RunDir:
    root: str
    local: str | None = None  # where the live control state is written first (local disk)

    @classmethod
    def for_spec(cls, spec) -> "RunDir":
        """The supervisor's and the worker's view: control state on the local disk."""
        return cls(spec.run_dir, control_dir_for(spec.checkpoint.local_dir))

    @property
    def control(self) -> str:
        return self.local or self.root

    @property
    def journal(self) -> str:
        return os.path.join(self.control, JOURNAL_FILE)

    @property
    def faults(self) -> str:
        """Fault marks (recovery/faults.py): which injected faults have fired."""
        return os.path.join(self.control, FAULTS_DIR)

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.root, "checkpoints")

    @property
    def attempts(self) -> str:
        return os.path.join(self.control, ATTEMPTS_DIR)

    @property
    def job_copy(self) -> str:
        return os.path.join(self.root, "job.yaml")

    @property
    def run_info(self) -> str:
        """Frozen facts of the run: job path, training hash, created."""
        return os.path.join(self.root, "run.json")

    @property
    def export(self) -> str:
        """The final model for inference (.keras, .weights.h5, saved_model/, export.json)."""
        return os.path.join(self.root, "export")

    def attempt_log(self, n: int, rank: int = 0) -> str:
        return os.path.join(self.attempts, f"{n}.log" if not rank else f"{n}.r{rank}.log")

    def standby_log(self, for_attempt: int) -> str:
        """A standby's output until it is promoted (then it becomes ``attempt_log``)."""
        return os.path.join(self.attempts, f"standby-{for_attempt}.log")

    def error_record(self, n: int, rank: int = 0) -> str:
        return os.path.join(self.attempts, f"{n}.error.json" if not rank
                            else f"{n}.r{rank}.error.json")

    def for_rank(self, rank: int) -> str:
        """Where a worker of rank > 0 keeps its own journal and heartbeat: rank 0 (the chief)
        speaks for the group in the run's journal; the others' would say the same again."""
        return rank_dir(self.control, rank)

    def make(self) -> "RunDir":
        """Create what a run needs to start; ``checkpoints/`` (the durable tier) is created by
        its first commit, so a Drive that fails there cannot stop a start. Only the control
        folder: a worker starting while the run directory is down must not fail here."""
        os.makedirs(self.attempts, exist_ok=True)
        return self


# An export is written into a folder beside its place and renamed into it (train/export.py), the
# export it replaces renamed aside and removed: a process killed half-way leaves one of them.
EXPORT_STAGING, EXPORT_TRASH = ".tmp-", ".trash-"


def export_staging(final: str) -> str:
    """Where a process writes the export bound for ``final`` before renaming it into place."""
    return f"{final}{EXPORT_STAGING}{os.getpid()}-{uuid.uuid4().hex[:6]}"


def export_trash(final: str) -> str:
    """Where the export ``final`` is renamed to while it is removed."""
    return f"{final}{EXPORT_TRASH}{uuid.uuid4().hex[:6]}"


def export_leftovers(final: str) -> list[str]:
    """The staging and trash folders of ``final`` that are there (a killed export's)."""
    folder, name = os.path.split(os.path.abspath(final))
    return sorted(os.path.join(folder, n) for n in os.listdir(folder)
                  if n.startswith((name + EXPORT_STAGING, name + EXPORT_TRASH)))


def rank_dir(control: str, rank: int) -> str:
    """``RunDir.for_rank`` from the control folder alone (the hang clock, the relay)."""
    return control if not rank else os.path.join(control, f"rank-{rank}")


def rank_of(control: str, folder: str) -> int | None:
    """The rank whose folder ``folder`` is (``rank_dir``'s inverse), None for another one."""
    folder, control = os.path.normpath(folder), os.path.normpath(control)
    if folder == control:
        return 0
    name = os.path.basename(folder)
    if os.path.dirname(folder) == control and name.startswith("rank-") and name[5:].isdigit():
        return int(name[5:])
    return None


def default_local_dir(name: str, run_dir: str) -> str:
    """A per-run folder on the local disk, stable across supervisor restarts on one machine."""
    import hashlib
    import tempfile

    tag = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), "orchestrator", f"{name}-{tag}", "checkpoints")


def control_dir_for(local_dir: str) -> str:
    """The local control folder, beside the local checkpoint tier (not inside it: the tier's
    folder holds checkpoints only)."""
    return os.path.normpath(local_dir) + "-control"

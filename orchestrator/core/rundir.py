"""Where everything lives in a run directory: the one place both processes agree on names."""
from __future__ import annotations

import os
from dataclasses import dataclass

# The worker's exit code for "this will fail the same way again" (configuration, job code,
# missing TensorFlow): the supervisor does not spend restarts on it. sysexits' EX_CONFIG.
EXIT_CONFIG = 78
# `orchestrator run` stopped by a signal; the run is resumable (128 + SIGINT, as shells do).
EXIT_STOPPED = 130
# The worker saved its state on SIGTERM (a preemption notice) and exited (128 + SIGTERM).
EXIT_PREEMPTED = 143

# Split the host CPU into this many logical devices before TensorFlow starts (a worker then
# trains under a multi-replica MirroredStrategy on a CPU, as it would on 8 TPU cores): for tests.
CPU_DEVICES_ENV = "ORCHESTRATOR_CPU_DEVICES"

# What the supervisor tells the next worker attempt (recovery actions), by environment.
ENV_STRATEGY = "ORCHESTRATOR_STRATEGY"          # strategy fallback: tpu|gpu|cpu
ENV_BATCH_SIZE = "ORCHESTRATOR_BATCH_SIZE"      # per-replica batch after halving on OOM
ENV_REINIT = "ORCHESTRATOR_REINIT_ACCELERATOR"  # "1": shut down + initialise the TPU system


@dataclass(frozen=True)
class RunDir:
    root: str

    @property
    def journal(self) -> str:
        return os.path.join(self.root, "events.jsonl")

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.root, "checkpoints")

    @property
    def attempts(self) -> str:
        return os.path.join(self.root, "attempts")

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

    def attempt_log(self, n: int) -> str:
        return os.path.join(self.attempts, f"{n}.log")

    def error_record(self, n: int) -> str:
        return os.path.join(self.attempts, f"{n}.error.json")

    def make(self) -> "RunDir":
        """Create what a run needs to start; ``checkpoints/`` (the durable tier) is created by
        its first commit, so a Drive that fails there cannot stop a start."""
        os.makedirs(self.attempts, exist_ok=True)
        return self

def default_local_dir(name: str, run_dir: str) -> str:
    """A per-run folder on the local disk, stable across supervisor restarts on one machine."""
    import hashlib
    import tempfile

    tag = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), "orchestrator", f"{name}-{tag}", "checkpoints")

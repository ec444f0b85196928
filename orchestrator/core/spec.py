"""Job spec: the validated dataclasses a job file becomes, with each field's default.

``specload.load`` reads the YAML into them; every error names the file, the line, the key and
what was expected, because the person reading it is usually looking at a notebook cell hours
after they wrote the YAML. The loader imports this module, never the other way round: the
classes and their defaults are what both the loader and every reader of a spec need.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.retention import Retention
from orchestrator.core.standbymode import StandbyMode


STRATEGIES = ("auto", "tpu", "gpu", "cpu")
SCHEDULES = ("step_decay", "cosine", "piecewise")  # SCHEDULE_PARAMS's keys, in this order
BUILTIN_CALLBACKS = ("early_stopping", "reduce_lr_on_plateau", "terminate_on_nan")
STANDBY_MODES = StandbyMode.SETTINGS
ENGINES = ("local", "ray")  # who places the workers of a multi-worker job
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# The module name of the functions ``orchestrator.run(model=fn, data=fn, ...)`` carries by value
# (core/cellcode.py): ``__cell__:build_model`` is no importable module, it names a function in
# the job's ``code`` file.
CELL_MODULE = "__cell__"


class SpecError(Exception):
    """A job file that cannot be used; the message is meant for the user as it is."""

    def __init__(self, path: str, line: int | None, key: str | None, expected: str):
        self.path, self.line, self.key, self.expected = path, line, key, expected
        where = f"{path}:{line}" if line else path
        what = f"key '{key}': " if key else ""
        super().__init__(f"{where}: {what}{expected}")
        self.errors = [self]

    @classmethod
    def combined(cls, errors: list["SpecError"]) -> "SpecError":
        """Every mistake of one job file in one error (one line each); the first one's
        file, line and key stay on it."""
        if len(errors) == 1:
            return errors[0]
        errors = sorted(errors, key=lambda x: x.line or 0)  # in the file's order
        first = errors[0]
        e = cls(first.path, first.line, first.key, first.expected)
        Exception.__init__(e, f"{len(errors)} problems in {first.path}:\n"
                           + "\n".join(str(x) for x in errors))
        e.errors = list(errors)
        return e


@dataclass(frozen=True)
class Factory:
    """A user function named ``module:function``, called with ``args`` as keyword arguments."""

    target: str
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CompileSpec:
    optimizer: Any = "adam"
    loss: Any = None
    metrics: tuple = ()


@dataclass(frozen=True)
class CheckpointSpec:
    """When to checkpoint, what to keep, and the two tiers (see ``tiers.py``)."""

    every_epochs: int = 1
    keep: int = 3
    every_steps: int | None = None         # also commit mid-epoch every N steps ...
    every_seconds: float | None = None     # ... and/or every T seconds
    keep_every_epochs: int | None = None   # also keep one checkpoint every N epochs
    keep_best: str | None = None           # also keep the best by this metric (e.g. val_loss)
    keep_best_mode: str = "min"
    local_dir: str = ""                    # the fast tier; "" until load() fills the default
    remount: str | None = None             # "colab" or module:function, called with the dir
    flush_timeout: float = 600.0           # how long the end of a run waits for durable copies
    upload_backoff_initial: float = 1.0
    upload_backoff_max: float = 60.0
    # write checkpoints off the training thread (checkpoint/writer.py); false: in line
    background: bool = True
    # what "durable" means for the durable tier (checkpoint/settle.py): auto (a write-back
    # cache under /content/drive), writeback or none (settled at fsync)
    durable_cache: str = "auto"
    durable_max_bytes: int | None = None   # the durable tier's space cap (None: no cap)
    writeback_quiet_s: float = 15.0        # a write-back cache uploads a file left alone this
    writeback_bytes_per_s: float = 10e6    # long, at about this rate (until one is measured)
    writeback_margin: float = 2.0

    @property
    def retention(self) -> Retention:
        return Retention(self.keep, self.keep_every_epochs, self.keep_best, self.keep_best_mode)


@dataclass(frozen=True)
class LearningRateSpec:
    """A per-epoch learning rate: a built-in ``schedule`` with ``params``, or a ``function``
    ``module:function(epoch, lr) -> lr``."""

    schedule: str | None = None
    params: dict = field(default_factory=dict)
    function: Factory | None = None


# The parameters of each built-in ``learning_rate`` schedule, with their defaults: the loader's
# keys and defaults (specload.py), the keyword arguments of train/schedules.py's functions.
@dataclass(frozen=True)
class StepDecayParams:
    initial: float | None = None  # None: the optimizer's own rate
    factor: float = 0.1
    every: int = 1


@dataclass(frozen=True)
class CosineParams:
    initial: float | None = None
    minimum: float = 0.0
    decay_epochs: int | None = None  # None: the epochs after the warm-up
    warmup_epochs: int = 0


@dataclass(frozen=True)
class PiecewiseParams:
    boundaries: tuple = ()
    values: tuple = ()


SCHEDULE_PARAMS = {"step_decay": StepDecayParams, "cosine": CosineParams,
                   "piecewise": PiecewiseParams}


@dataclass(frozen=True)
class CallbackSpec:
    """A Keras callback: a built-in by ``name`` with keyword ``args``, or a user ``factory``."""

    name: str | None = None
    args: dict = field(default_factory=dict)
    factory: Factory | None = None


@dataclass(frozen=True)
class TensorBoardSpec:
    """Scalars for TensorBoard (train/tensorboard.py): per epoch, and every ``every_steps``
    global steps (multiples of it, so that every attempt writes at the same steps; 0: per
    epoch only). Steps are the run's global step, which continues across restarts."""

    dir: str = ""          # "" until load() fills <run_dir>/tensorboard; relative: to run_dir
    every_steps: int = 100


@dataclass(frozen=True)
class RestartSpec:
    max: int = 3                     # failures of the job or the runtime since the last new checkpoint
    preemptions: int | None = None   # kills from outside (preemptions); None: no limit
    backoff_initial: float = 1.0
    backoff_max: float = 60.0
    backoff_multiplier: float = 2.0




@dataclass(frozen=True)
class Rung:
    """One step of a recovery ladder: ``action``, ``times`` in a row (None: while the restart
    budget lasts)."""

    action: str
    times: int | None = 1


@dataclass(frozen=True)
class CrashLoopSpec:
    same_failure: int = 3       # the same kind at the same step this many times in a row
    failures: int = 4           # ... or this many failures
    window_minutes: float = 10  # ... within this window, without a new checkpoint


@dataclass(frozen=True)
class RecoverySpec:
    ladders: tuple = ()                 # ((kind, (Rung, ...)), ...) replacing the defaults
    reinstall_tensorflow: bool = False  # opt-in: pip-reinstall the installed TF distribution
    reinstall_max: int = 1              # per run
    pip: tuple = ()                     # command prefix; () = (sys.executable, -m, pip)
    pip_args: tuple = ()                # extra arguments to `pip install` (index, target)
    tensorflow_distributions: tuple = ("tensorflow-tpu", "tensorflow", "tensorflow-cpu")
    verify_import: str = "tensorflow"   # the module a fresh process imports to verify
    halve_batch: bool = False           # on out_of_memory, halve the per-replica batch
    min_batch_size: int = 1
    strategy_fallback: bool = False     # TPU -> GPU -> CPU
    wait_initial: float = 5.0           # wait_accelerator: probe backoff
    wait_max: float = 60.0
    wait_timeout: float = 600.0
    crash_loop: CrashLoopSpec = CrashLoopSpec()

    def ladder(self, kind: str):
        return dict(self.ladders).get(kind)


@dataclass(frozen=True)
class CodeSpec:
    """The functions of a job defined in a notebook cell or a script's ``__main__``
    (``orchestrator.run(model=fn, data=fn, ...)``), carried by value (core/cellcode.py).

    ``file`` (next to the frozen job) holds them, cloudpickled; ``sha256`` is that file's hash,
    checked before anything in it is unpickled; ``fingerprint`` identifies the code itself,
    the same in every process that runs the same cell, and is part of the training hash: the
    file's bytes differ from one kernel to the next, the code they carry does not."""

    file: str = "code.pkl"
    sha256: str = ""
    fingerprint: str = ""


@dataclass(frozen=True)
class JobSpec:
    name: str
    model: Factory
    data: Factory
    epochs: int
    batch_size: int
    run_dir: str
    job_path: str
    job_dir: str
    strategy: str = "auto"
    seed: int = 0
    compile: CompileSpec | None = None
    checkpoint: CheckpointSpec = CheckpointSpec()
    restarts: RestartSpec = RestartSpec()
    heartbeat_interval: float = 1.0
    deterministic: bool = False
    learning_rate: LearningRateSpec | None = None
    callbacks: tuple = ()
    hang_timeout: float = 300.0      # no heartbeat for this long while training: a hang
    startup_timeout: float = 1800.0  # ... before the first training heartbeat of an attempt
    stop_grace: float = 10.0         # SIGTERM -> SIGKILL of a worker's process group
    preempt_grace: float = 20.0      # SIGTERM -> emergency checkpoint and exit (spot VMs: ~30 s)
    standby: str = StandbyMode.AUTO  # a warm standby worker: auto | on | off | import_only
    probe_interval: float = 60.0     # accelerator probe period while an attempt runs
    lock_stale_after: float = 120.0  # a lock silent this long may be taken over (another VM)
    workers: int = 1                 # worker processes training together (MultiWorkerMirrored)
    engine: str = "local"            # local: processes here; ray: placed by Ray (ENGINES)
    address: str | None = None       # the Ray cluster (else RAY_ADDRESS, else a local Ray)
    worker_resources: tuple = (("CPU", 1.0),)  # one Ray bundle per worker holds these
    recovery: RecoverySpec = RecoverySpec()
    tensorboard: TensorBoardSpec | None = None  # None: no TensorBoard logs (the default)
    code: CodeSpec | None = None     # the functions orchestrator.run(model=fn, ...) carried
    backend: str = "auto"            # Keras's backend: auto | tensorflow | jax (core/backends.py)

    def training_relevant(self) -> dict:
        """What decides the trained model (not epochs, restarts, checkpoints or paths). The
        carried code's fingerprint only where there is one: the hash of a YAML job, and so its
        resume, is what it was before code could be carried. The backend (resolved by
        ``load``: never "auto" there) only when it is not TensorFlow, for the same reason: a
        resume under another backend is refused (numerics, RNG and data order differ)."""
        code = {"code": self.code.fingerprint} if self.code else {}
        # likewise the backend: a run that trained on TensorFlow keeps its hash
        backend = {"backend": self.backend} if self.backend not in ("auto", "tensorflow") else {}
        return json.loads(json.dumps({
            **code, **backend,
            "model": dataclasses.asdict(self.model),
            "data": dataclasses.asdict(self.data),
            "compile": dataclasses.asdict(self.compile) if self.compile else None,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "deterministic": self.deterministic,
            "learning_rate": dataclasses.asdict(self.learning_rate) if self.learning_rate else None,
            "callbacks": [dataclasses.asdict(c) for c in self.callbacks],
        }, sort_keys=True, default=str))

    def training_hash(self) -> str:
        """A hash of ``training_relevant()``: a run may only resume under the same one."""
        blob = json.dumps(self.training_relevant(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()


"""Job spec: the frozen value a job file becomes, with the attribute API the rest of the code
reads.

The job file's keys, their types, bounds, defaults and descriptions are declared once, in
``jobfile.py``; each default here is read from there. ``specload.load`` validates a file against
those models and builds these dataclasses; every error names the file, the line, the key and
what was expected.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.jobfile import (  # noqa: F401 (the vocabularies, read from here too)
    BUILTIN_CALLBACKS, CELL_MODULE, ENGINES, FACTORY_RE as _FACTORY_RE, SCHEDULES,
    STANDBY_MODES, STRATEGIES, default)
from orchestrator.core.retention import Retention

# checkpoint.durable as a bucket: URL scheme -> (the fsspec library, the extra installing it)
OBJECT_STORES = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}


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
    optimizer: Any = default("compile.optimizer")
    loss: Any = None
    metrics: tuple = ()


@dataclass(frozen=True)
class CheckpointSpec:
    """When to checkpoint, what to keep, and the two tiers (see ``tiers.py``)."""

    every_epochs: int = default("checkpoint.every_epochs")
    keep: int = default("checkpoint.keep")
    every_steps: int | None = default("checkpoint.every_steps")
    every_seconds: float | None = default("checkpoint.every_seconds")
    keep_every_epochs: int | None = default("checkpoint.keep_every_epochs")
    keep_best: str | None = None           # checkpoint.keep_best.metric
    keep_best_mode: str = default("checkpoint.keep_best.mode")
    local_dir: str = ""                    # the fast tier; "" until load() fills the default
    remount: str | None = default("checkpoint.remount")
    flush_timeout: float = default("checkpoint.flush_timeout")
    upload_backoff_initial: float = default("checkpoint.upload_backoff.initial")
    upload_backoff_max: float = default("checkpoint.upload_backoff.max")
    background: bool = default("checkpoint.background")
    durable: str | None = default("checkpoint.durable")
    durable_cache: str = default("checkpoint.durable_cache")   # checkpoint/settle.py
    durable_max_bytes: int | None = default("checkpoint.durable_max_bytes")
    writeback_quiet_s: float = default("checkpoint.writeback.quiet_s")
    writeback_bytes_per_s: float = default("checkpoint.writeback.bytes_per_s")
    writeback_margin: float = default("checkpoint.writeback.margin")

    @property
    def retention(self) -> Retention:
        return Retention(self.keep, self.keep_every_epochs, self.keep_best, self.keep_best_mode)


def object_store_problem(url: str) -> str | None:
    """What is wrong with ``url`` as a bucket tier (an unknown scheme, its library missing),
    or None."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in OBJECT_STORES or not rest.strip("/"):
        return f"expected gs://bucket/prefix or s3://bucket/prefix, got {url!r}"
    library, extra = OBJECT_STORES[scheme]
    if importlib.util.find_spec(library) is None:
        return f"{url!r} needs {library}: pip install 'orchestrator[{extra}]'"
    return None


@dataclass(frozen=True)
class LearningRateSpec:
    """A per-epoch learning rate: a built-in ``schedule`` with ``params``, or a ``function``
    ``module:function(epoch, lr) -> lr``."""

    schedule: str | None = None
    params: dict = field(default_factory=dict)
    function: Factory | None = None


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
    every_steps: int = default("tensorboard.every_steps")


@dataclass(frozen=True)
class ExportSpec:
    """What the end of a run exports (train/export.py). A SavedModel from a JAX run costs a
    TensorFlow import in the worker; a gigabyte model is written once per format."""

    at_end: bool = default("export.at_end")
    saved_model: bool = default("export.saved_model")


@dataclass(frozen=True)
class RestartSpec:
    max: int = default("restarts.max")
    preemptions: int | None = default("restarts.preemptions")
    backoff_initial: float = default("restarts.backoff.initial")
    backoff_max: float = default("restarts.backoff.max")
    backoff_multiplier: float = default("restarts.backoff.multiplier")


@dataclass(frozen=True)
class Rung:
    """One step of a recovery ladder: ``action``, ``times`` in a row (None: while the restart
    budget lasts)."""

    action: str
    times: int | None = 1


@dataclass(frozen=True)
class CrashLoopSpec:
    same_failure: int = default("recovery.crash_loop.same_failure")
    failures: int = default("recovery.crash_loop.failures")
    window_minutes: float = default("recovery.crash_loop.window_minutes")


@dataclass(frozen=True)
class RecoverySpec:
    ladders: tuple = ()                 # ((kind, (Rung, ...)), ...) replacing the defaults
    reinstall_tensorflow: bool = default("recovery.reinstall_tensorflow")
    reinstall_max: int = default("recovery.reinstall_max")
    pip: tuple = default("recovery.pip")  # () = (sys.executable, -m, pip)
    pip_args: tuple = default("recovery.pip_args")
    tensorflow_distributions: tuple = default("recovery.tensorflow_distributions")
    verify_import: str = default("recovery.verify_import")
    halve_batch: bool = default("recovery.halve_batch")
    min_batch_size: int = default("recovery.min_batch_size")
    strategy_fallback: bool = default("recovery.strategy_fallback")
    wait_initial: float = default("recovery.wait.initial")
    wait_max: float = default("recovery.wait.max")
    wait_timeout: float = default("recovery.wait.timeout")
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
    strategy: str = default("strategy")
    seed: int = default("seed")
    compile: CompileSpec | None = None
    checkpoint: CheckpointSpec = CheckpointSpec()
    restarts: RestartSpec = RestartSpec()
    heartbeat_interval: float = default("heartbeat_interval")
    deterministic: bool = default("deterministic")
    learning_rate: LearningRateSpec | None = None
    callbacks: tuple = ()
    hang_timeout: float = default("hang_timeout")
    startup_timeout: float = default("startup_timeout")
    stop_grace: float = default("stop_grace")
    preempt_grace: float = default("preempt_grace")
    standby: str = default("standby")
    probe_interval: float = default("probe_interval")
    lock_stale_after: float = default("lock_stale_after")
    workers: int = default("workers")
    engine: str = default("engine")
    address: str | None = default("address")
    worker_resources: tuple = tuple(sorted(default("worker_resources").items()))
    recovery: RecoverySpec = RecoverySpec()
    tensorboard: TensorBoardSpec | None = None  # None: no TensorBoard logs (the default)
    export: ExportSpec = ExportSpec()
    code: CodeSpec | None = None     # the functions orchestrator.run(model=fn, ...) carried
    backend: str = default("backend")  # resolved by load (core/backends.py): never "auto" there

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


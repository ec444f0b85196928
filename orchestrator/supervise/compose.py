"""The supervisor's parts, grouped, each group built from what was built before it.

``Supervisor.__init__`` is the composition root: it builds the worker slot (slot.py), then
the run directory's group, then recovery's, then the checkpoints', then the standby and the
end, in that order, and hands each group the objects it needs. Nothing refers forward and no
part calls back into the supervisor; the one late link is explicit (the lease, built before
the durable mirror, tells it to stop when the lock is lost). As NVRx's in-process restart
injects one object per stage and Orbax gathers its options in one dataclass, a test replaces a
whole stage (``Commands``: the fake worker with no standby and no exporter), never a hidden
default resolved by identity.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable

from orchestrator.checkpoint import tiers
from orchestrator.checkpoint.mirror import DurableMirror, remount_hook
from orchestrator.checkpoint.settle import Settling, policy_for
from orchestrator.core.backends import ENV_BACKEND, KERAS_BACKEND_ENV
from orchestrator.core.clock import Clock
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.lock import Lease, RunLock
from orchestrator.core.outage import Outage
from orchestrator.core.rundir import RunDir
from orchestrator.core.spec import JobSpec
from orchestrator.recovery import faults as faults_mod
from orchestrator.recovery.actions import Remedies
from orchestrator.recovery.policy import RecoveryPolicy
from orchestrator.supervise.console import Progress
from orchestrator.supervise.controlmirror import SEGMENT_S, ControlMirror
from orchestrator.supervise.lease import LeaseKeeper
from orchestrator.supervise.ledger import CheckpointLedger
from orchestrator.supervise.slot import WorkerSlot

log = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------- what is started
def worker_command(spec: JobSpec, attempt: int) -> list[str]:
    return [sys.executable, "-m", "orchestrator.train.worker", spec.job_path,
            "--run-dir", spec.run_dir, "--attempt", str(attempt)]


def standby_command(spec: JobSpec, attempt: int, mode: str) -> list[str]:
    return worker_command(spec, attempt) + ["--standby", mode]


def export_command(spec: JobSpec) -> list[str]:
    return [sys.executable, "-m", "orchestrator.train.export", spec.run_dir]


@dataclass(frozen=True)
class Commands:
    """The processes the supervisor starts, each named: an attempt's worker, the standby
    (None: never one) and the exporter at the end (None: no export)."""

    worker: Callable[[JobSpec, int], list[str]] = worker_command
    standby: Callable[[JobSpec, int, str], list[str]] | None = standby_command
    export: Callable[[JobSpec], list[str]] | None = export_command

    @classmethod
    def worker_only(cls, worker: Callable[[JobSpec, int], list[str]]) -> "Commands":
        """Another worker (the tests' fake one): no standby and no exporter, which would run
        the real worker's code."""
        return cls(worker, None, None)


# ---------------------------------------------------------------------- the run directory
class RunDirectory:
    """The run directory and what writes to it: its layout, the journal, the console, the lock
    and its lease, whether it answers (``Outage``), the control mirror."""

    def __init__(self, spec: JobSpec, rd: RunDir, out, slot: WorkerSlot, clock: Clock):
        self.rd = rd
        self.journal = Journal(rd.journal)
        self.console = Progress(out or sys.stdout, rd.control, spec.epochs)
        self.lock = RunLock(rd.root, stale_after=spec.lock_stale_after)
        self.outage = Outage(self.journal, rd.root, clock=clock)
        # past the lease the worker is paused through the slot; a lost lock stops the run
        self.lease = LeaseKeeper(self.lock, Lease(spec.lock_stale_after, clock), self.outage,
                                 self.journal, slot.hang, slot.signal,
                                 on_lost=lambda lost: slot.stop(), clock=clock)
        writeback = policy_for(spec.checkpoint, rd.checkpoints).writeback
        self.control = ControlMirror(rd, self.outage, hold=self.lease.hold, clock=clock,
                                     segment_s=SEGMENT_S if writeback else None)

    def take(self) -> dict | None:
        """Make the run directory and take its lock; the stale lock taken over, if any."""
        os.makedirs(self.rd.root, exist_ok=True)
        self.rd.make()
        return self.lock.acquire()


# ---------------------------------------------------------------------- recovery
class Recovery:
    """What a failure may change and who decides: the workers' environment (the run's
    backend, the remedies' overrides, the injected faults), the remedies, the policy, and the
    accelerator watch the remedies read."""

    def __init__(self, spec: JobSpec, env: dict | None, faults, slot: WorkerSlot,
                 run_dir: RunDirectory, clock: Clock):
        self.spec, self.env, self.journal = spec, env, run_dir.journal
        self.faults = [faults_mod.parse(f).text for f in faults]
        faults_mod.check_ranks(self.faults, spec.workers)
        self.remedies = Remedies(spec, self.base_env, own_pgid=slot.pgid, sleep=slot.sleep)
        self.policy = RecoveryPolicy(spec.recovery, spec.restarts,
                                     applicable=self.remedies.applicable, clock=clock.time)
        self._accel_ok: bool | None = None

    def base_env(self) -> dict:
        """The environment of every process the supervisor starts; the run's backend in it, so
        that the worker, the standby and the exporter train and build on the one frozen with
        the run (``KERAS_BACKEND`` for the job's own imports of Keras too)."""
        env = dict(self.env if self.env is not None else os.environ)
        env[ENV_BACKEND] = env[KERAS_BACKEND_ENV] = self.spec.backend
        return env

    def export_env(self) -> dict:
        return _worker_env(self.base_env())

    def attempt_env(self, consume: bool = False) -> dict:
        """The next worker's (or standby's) environment; ``consume``: it starts that attempt
        (a one-shot override is used up)."""
        env = self.remedies.worker_env(_worker_env(self.base_env()), consume=consume)
        env.pop(faults_mod.ENV, None)
        if self.faults:
            env[faults_mod.ENV] = json.dumps(self.faults)
        return env

    def probe(self, attempt: int, running: bool = False) -> None:
        """Probe the accelerator: before an attempt (journaled), and while it runs (journaled
        when the answer changes; a loss said on the console)."""
        res = self.remedies.probe()()
        self.remedies.probed(res)
        changed = res.ok != self._accel_ok
        if not running or changed:
            self.journal.append(Event.ACCELERATOR_PROBE, attempt=attempt, running=running,
                                **res.as_dict())
        if running and changed and not res.ok:
            self.journal.append(Event.ACCELERATOR_LOST, attempt=attempt, **res.as_dict())
            log.info(f"accelerator lost during attempt {attempt}: {res.detail}")
        self._accel_ok = res.ok


def _worker_env(base) -> dict:
    """The worker must run this very orchestrator package, wherever the job's cwd is."""
    paths = [REPO_ROOT] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(base, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(paths))


# ---------------------------------------------------------------------- checkpoints
class Checkpoints:
    """The two tiers, the durable mirror that copies one to the other, and the ledger that
    journals what is committed (and tells the policy of progress)."""

    def __init__(self, spec: JobSpec, run_dir: RunDirectory, recovery: Recovery, remount,
                 clock: Clock):
        c = spec.checkpoint
        self.store = tiers.for_spec(spec)
        self.settling = Settling(policy_for(c, self.store.durable.root), run_dir.journal,
                                 self.store.durable.root, clock)
        self.mirror = DurableMirror(self.store, run_dir.journal, c.retention,
                                    c.upload_backoff_initial, c.upload_backoff_max,
                                    remount=remount or remount_hook(spec),
                                    hold=run_dir.lease.hold,
                                    outage=run_dir.outage, clock=clock,
                                    settling=self.settling, max_bytes=c.durable_max_bytes)
        self.ledger = CheckpointLedger(self.store, run_dir.journal, run_dir.console,
                                       on_progress=recovery.policy.progress,
                                       on_scanned=self.mirror.notify)

    def flush(self, timeout: float) -> list[int]:
        """The steps still not durable after waiting up to ``timeout`` (none when the mirror
        does not run)."""
        return self.mirror.flush(timeout) if self.mirror.running else []

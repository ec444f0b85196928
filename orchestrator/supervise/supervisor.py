"""The supervisor: run attempts until the job completes or the policy gives up.

It never imports TensorFlow (a broken TensorFlow must be fixable from here, and a TPU must never
be held by this process). The loop (``_supervise``) is the policy, read top to bottom as torch
elastic's agent loop: run an attempt, judge its outcome (classify it into a ``Failure``), ask
``policy.decide`` for the action, the delay and the reason, carry it out, wait, go on. The
pieces live beside it, one reason to change each:

- ``admission.py``: may this job resume this run directory (training hash, ``--force``);
- ``attempt.py``: spawn, wait on events, stop a hung worker, kill the process group;
- ``ledger.py``: journal epochs and checkpoints from what is committed, exactly once;
- ``finish.py``: the end of a run, completed (flush, export) or given up (the report);
- ``recovery/``: classify, the policy (budgets, ladders, crash loops, backoff), the actions.

The watchers (committed checkpoints in either tier, the heartbeat file) and the worker's exit
all feed one queue, so nothing is polled; the durable mirror is a thread of this process, and so
is the control mirror (``controlmirror.py``: the journal, heartbeat and logs are written on the
local disk and copied to the run directory, which may be a Drive mount that comes and goes). The
control mirror's thread also keeps the lock, under the takeover rule of ``core/lock.py``.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import sys
import threading

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential
from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from orchestrator.checkpoint import tiers
from orchestrator.checkpoint.mirror import DurableMirror, remount_hook
from orchestrator.checkpoint.store import COMMIT_MARKER
from orchestrator.core import heartbeat
from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.lock import Lease, LockLost, RunLock
from orchestrator.core.rundir import (ENV_RESTORE_STEP, EXIT_LOCK_LOST, EXIT_STOPPED, RunDir,
                                      RunDirUnreachable)
from orchestrator.core.backends import ENV_BACKEND, KERAS_BACKEND_ENV
from orchestrator.core.spec import JobSpec
from orchestrator.recovery import faults as faults_mod
from orchestrator.recovery.actions import Remedies
from orchestrator.recovery.evidence import JobContext
from orchestrator.recovery.failures import classify, read_tail, signal_name
from orchestrator.recovery.policy import GIVE_UP, Decision, Failure, RecoveryPolicy, is_preemption
from orchestrator.supervise import admission
from orchestrator.supervise.attempt import Attempt, Every, Outcome, Stopped, kill_orphans
from orchestrator.supervise.console import Progress
from orchestrator.supervise.controlmirror import ControlMirror, Outage
from orchestrator.supervise.finish import RunEnd, summary
from orchestrator.supervise.group import GroupAttempt, LocalEngine
from orchestrator.supervise.hangs import HangClock, HeartbeatEvents
from orchestrator.supervise.lease import LeaseKeeper
from orchestrator.supervise.ledger import CheckpointLedger
from orchestrator.supervise.messages import Committed, Stop
from orchestrator.supervise.standby import Keeper

# A run directory that does not answer at start is retried this long (a Drive mount that is
# remounting takes seconds), then the start fails with a clear message.
START_RETRY_S = 30.0
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _CheckpointEvents(FileSystemEventHandler):
    """Commits only: a checkpoint directory renamed into place, or its commit marker written."""

    def __init__(self, q: queue.Queue):
        self.q = q

    def on_moved(self, event):
        self._maybe(event.dest_path)

    def on_created(self, event):
        self._maybe(event.src_path)

    def _maybe(self, path) -> None:
        name = os.path.basename(os.fsdecode(path))
        if name == COMMIT_MARKER or (len(name) == 10 and name.isdigit()):
            self.q.put(Committed(path))


def worker_command(spec: JobSpec, attempt: int) -> list[str]:
    return [sys.executable, "-m", "orchestrator.train.worker", spec.job_path,
            "--run-dir", spec.run_dir, "--attempt", str(attempt)]


def standby_command(spec: JobSpec, attempt: int, mode: str) -> list[str]:
    return worker_command(spec, attempt) + ["--standby", mode]


def export_command(spec: JobSpec) -> list[str]:
    return [sys.executable, "-m", "orchestrator.train.export", spec.run_dir]


class Supervisor:
    def __init__(self, spec: JobSpec, worker_cmd=worker_command, out=None, env=None,
                 faults=(), force: bool = False, remount=None, export_cmd="auto", cell=None,
                 standby_cmd="auto", clock: Clock = SYSTEM):
        """``force`` resumes under a changed training hash. ``remount(durable_dir)`` replaces
        the job's ``checkpoint.remount`` hook (a notebook may pass its own). ``export_cmd(spec)``
        is the exporter, ``standby_cmd(spec, attempt, mode)`` the standby worker; "auto" means
        the real one with the real worker and none with a custom worker command (tests' fake
        workers). ``cell``: a job given to ``orchestrator.run`` as keywords
        (core/cellcode.CellJob), frozen with its code once the run is admitted. ``clock``: what
        the lease, the hang clock, the mirrors and the waits between attempts read."""
        self.spec, self.force, self.worker_cmd, self.env = spec, force, worker_cmd, env
        self.clock = clock
        self.cell = cell
        if export_cmd == "auto":
            export_cmd = export_command if worker_cmd is worker_command else None
        if standby_cmd == "auto":
            standby_cmd = standby_command if worker_cmd is worker_command else None
        self.standby_cmd = standby_cmd
        self.faults = [faults_mod.parse(f).text for f in faults]
        self.rd = RunDir.for_spec(spec)
        self.out = out or sys.stdout
        self.journal = Journal(self.rd.journal)
        self.store = tiers.for_spec(spec)
        c = spec.checkpoint
        self.mirror = DurableMirror(self.store, self.journal, c.retention,
                                    c.upload_backoff_initial, c.upload_backoff_max,
                                    remount=remount or remount_hook(spec), say=self.say,
                                    hold=lambda: self.keeper.hold(), clock=clock)
        self.lock = RunLock(self.rd.root, stale_after=spec.lock_stale_after)
        self.outage = Outage(self.journal, self.rd.root, self.say, clock=clock)
        self.control = ControlMirror(self.rd, self.outage, hold=lambda: self.keeper.hold(),
                                     clock=clock)
        self.q: queue.Queue = queue.Queue()
        self.attempt: Attempt | None = None
        self._stop = threading.Event()
        self.stop_signal: int | None = None  # what stopped us: SIGINT is a cell interrupt
        self.restarts = 0
        self.progress = Progress(self.out, self.rd.control, spec.epochs)
        self.hang = HangClock(self.rd.control, spec.hang_timeout, spec.startup_timeout, clock)
        self.keeper = LeaseKeeper(self.lock, Lease(spec.lock_stale_after, clock), self.outage,
                                  self.journal, self.hang, self._signal_worker,
                                  on_lost=self._on_lock_lost, say=self.say, clock=clock)
        self.remedies = Remedies(spec, self._base_env, own_pgid=self._worker_pgid,
                                 sleep=self._sleep, say=self.say)
        self.policy = RecoveryPolicy(spec.recovery, spec.restarts,
                                     applicable=self.remedies.applicable, clock=clock.time)
        self.ledger = CheckpointLedger(self.store, self.journal, self.progress,
                                       on_progress=self.policy.progress,
                                       on_scanned=self.mirror.notify)
        self.end = RunEnd(spec, self.rd, self.journal, self.mirror, self.progress, export_cmd,
                          export_env=lambda: _worker_env(self._base_env()),
                          run_dir_back=self.control.flush)
        self._accel_ok: bool | None = None
        self._attempts_before = 0
        self.engine = None  # several workers: who places them (supervise/group.py)
        self.standby = Keeper(spec, standby_cmd, self.rd, self.q, self.journal,
                              env=self._attempt_env, strategy=self.remedies.current_strategy,
                              accelerator=lambda: self.remedies.seen,
                              stopping=self._stop.is_set)

    # ------------------------------------------------------------------ public
    def run(self) -> int:
        """Run (or resume) the job to completion. Returns the process exit code."""
        stale = self._retry_start(self._take_run_dir)  # LockedError propagates to the caller
        old_handlers = self._install_signal_handlers()
        observer = Observer()
        try:
            self.progress.start()
            self._retry_start(lambda: self._open_run(stale, self.control.merge_on_start()))
            self.engine = self._group_engine()
            self._watch(observer)
            self.mirror.start()
            self.control.start()
            return self._supervise()
        except (Stopped, KeyboardInterrupt) as exc:
            if self.lock_lost is not None:
                return self._stand_down()
            if isinstance(exc, KeyboardInterrupt):
                self.stop_signal = signal.SIGINT
            self._stop_for_preemption()
            self.journal.append(Event.SUPERVISOR_STOPPED, reason="signal")
            self.say("stopped; the run resumes when `orchestrator run` is started again")
            return EXIT_STOPPED
        finally:
            self._stop_worker()
            self.standby.discard("the supervisor stopped")
            if observer.is_alive():
                observer.stop()
                observer.join(timeout=5)
            if self.engine is not None:
                self.engine.close()
            self.mirror.stop()
            self.control.stop(self.spec.checkpoint.flush_timeout if self.lock_lost is None
                              else None)
            self.progress.stop()
            self._restore_signal_handlers(old_handlers)
            self.lock.release()

    def say(self, msg: str) -> None:
        self.progress.say(msg)

    def _take_run_dir(self) -> dict | None:
        os.makedirs(self.rd.root, exist_ok=True)
        self.rd.make()
        return self.lock.acquire()

    def _retry_start(self, step):
        """A start step that touches the run directory, retried while it does not answer."""
        retrying = Retrying(retry=retry_if_exception_type(OSError), reraise=True,
                            stop=stop_after_delay(START_RETRY_S),
                            wait=wait_exponential(multiplier=0.5, max=5.0))
        try:
            return retrying(step)
        except OSError as exc:
            raise RunDirUnreachable(
                f"{self.rd.root}: the run directory cannot be written ({exc}), retried for "
                f"{START_RETRY_S:.0f} s; the supervisor needs it to start (its lock and journal "
                f"are there). Check the mount (on Colab: drive.mount(..., force_remount=True)) "
                f"and run again: nothing was lost.") from exc

    # ------------------------------------------------------------------ the loop
    def _supervise(self) -> int:
        while not self.ledger.completed(self.spec.epochs):
            outcome = self._run_attempt()
            failure = self._judge(outcome)
            if failure is None:
                break  # the last checkpoint is committed: a death after it loses nothing
            decision = self.policy.decide(failure)
            self._apply(outcome, decision)
            if decision.action == GIVE_UP:
                self.standby.discard("the run failed")
                return self.end.failed(outcome, decision, failure.evidence,
                                       self.ledger.latest_epoch(), self._counters())
            self._restart(outcome, decision)
        if self.lock_lost is not None:
            raise Stopped()  # the run is another supervisor's now: it completes it
        self.standby.discard("the run completed")
        return self.end.completed(self.ledger.latest(), self._counters())

    def _run_attempt(self) -> Outcome:
        """Probe, spawn, wait until it exits or hangs, journal how it ended."""
        n = self._attempts_before = self._attempts_before + 1
        if not self.keeper.wait_held(self._stop):  # paused by the lease: start nothing
            raise Stopped()
        self._probe_accelerator(attempt=n)
        env = self._attempt_env(consume=True)
        args = (n, self.worker_cmd(self.spec, n), env, self.spec.job_dir,
                self.rd.attempt_log(n), self.q, self.hang, self.journal, self.say,
                self.rd.error_record(n), self.spec.stop_grace)
        if self.engine is None:
            self.attempt = Attempt(*args)
        else:
            self.attempt = GroupAttempt(*args, engine=self.engine, size=self.spec.workers,
                                        rd=self.rd)
            self.attempt.env[ENV_RESTORE_STEP] = self._group_restore_step()
        promoted, path = self.standby.promote(n, env)  # or, with why not, a cold start
        if promoted is not None:
            self.attempt.adopt(promoted, self.ledger.latest_epoch(), path)
        else:
            self.attempt.start(self.ledger.latest_epoch(), path)
        self.progress.attempt_started(n, self.ledger.latest_epoch())
        outcome = self.attempt.wait(
            on_checkpoint=self.ledger.scan, on_training=lambda: self.standby.start(n + 1),
            on_other_exit=lambda proc, rc: self.standby.exited(proc, rc, n + 1), duties=[
                Every(self.spec.probe_interval, lambda: self._probe_accelerator(n, running=True))])
        self.attempt = None
        self.ledger.scan()
        self.remedies.ran_on(self._ready_strategy(n))
        return outcome

    def _judge(self, outcome: Outcome) -> Failure | None:
        """Journal ``attempt_ended``; classify it unless the run is complete (then None: the
        export or TensorFlow's teardown may die after the last commit and lose nothing)."""
        if self.ledger.completed(self.spec.epochs):
            self._journal_ended(outcome, outcome.error, None, None, None)
            return None
        error = outcome.error
        if outcome.exit_code == 0:
            error = error or {"type": "IncompleteRun",
                              "message": "the worker exited 0 before the last epoch"}
        d = classify(outcome.exit_code, error, read_tail(outcome.log), outcome.hang_age_s,
                     outcome.oom, job=JobContext.from_spec(self.spec))
        self._journal_ended(outcome, error, d.kind, d.signature, d.layer)
        return Failure(outcome.attempt, d.kind, d.signature, self._position(outcome, error),
                       self.clock.time(), d.evidence, d.escalate)

    def _apply(self, outcome: Outcome, decision: Decision) -> None:
        """Carry out the action (none for give_up) and journal it with the policy's reason."""
        if decision.action != GIVE_UP:  # before the action: a reinstall must not run beside it
            self.standby.check(decision.action, self._attempt_env())
        if decision.action == GIVE_UP:
            detail, fields = decision.reason, {}
        else:
            detail, fields = self.remedies.apply(decision, self._attempt_env())
        self.journal.append(Event.RECOVERY, attempt=outcome.attempt, kind=decision.kind,
                            action=decision.action, detail=detail, **fields)

    def _restart(self, outcome: Outcome, decision: Decision) -> None:
        self.restarts += 1
        counters = self._counters()
        self.journal.append(Event.RESTART, after_attempt=outcome.attempt,
                            delay_s=round(decision.delay_s, 3), restart=self.restarts,
                            budget=self.spec.restarts.max, kind=decision.kind, **counters)
        self.progress.restarted(self.restarts, outcome.attempt, decision.kind,
                                outcome.describe(),
                                f"restarting in {decision.delay_s:.1f} s "
                                f"({_budget_line(decision.kind, counters)})")
        self._sleep(decision.delay_s)

    # ------------------------------------------------------------------ the lock's lease
    @property
    def lock_lost(self) -> LockLost | None:
        return self.keeper.lost

    def _on_lock_lost(self, lost: LockLost) -> None:
        self.mirror.stop(timeout=0)  # no more uploads; a flush waiting on it returns
        self._stop.set()
        self.q.put(Stop())

    def _signal_worker(self, sig: int) -> int | None:
        a = self.attempt
        if a is not None:
            a.signal(sig)
        return self._worker_pgid()

    def _stand_down(self) -> int:
        """Another supervisor owns the run now: kill our worker at once (it is paused, and must
        not commit anything) and leave the run directory to it."""
        if self.attempt is not None:
            self.attempt.stop(grace=0.0)
            self.attempt = None
        self.say(f"{self.lock_lost}; this supervisor stops. What it held back stays in "
                 f"{self.rd.control}.")
        return EXIT_LOCK_LOST

    def _group_engine(self):
        """Who places the workers of a group; None for one local worker (the plain Attempt)."""
        if self.spec.workers <= 1 and self.spec.engine == "local":
            return None
        if self.spec.engine == "ray":
            from orchestrator.supervise.rayengine import RayEngine

            return RayEngine(self.spec.address, dict(self.spec.worker_resources), self.say,
                             journal=self.journal)
        return LocalEngine()

    def _group_restore_step(self) -> str:
        """The step every rank restores ("": start afresh). With Ray, ranks on other nodes
        read the run directory: the newest checkpoint is made durable first."""
        latest = self.ledger.latest()
        if latest is None:
            return ""
        if self.spec.engine == "ray" and self.mirror.running:
            pending = self.mirror.flush(self.spec.checkpoint.flush_timeout)
            if latest.step in pending:
                self.say(f"checkpoint step {latest.step} is not durable yet: ranks on other "
                         f"nodes may not see it")
        return str(latest.step)

    def _counters(self) -> dict:
        return dict(self.policy.counters(), restarts=self.restarts)

    # ------------------------------------------------------------------ run lifecycle
    def _open_run(self, stale: dict | None, merged: dict) -> None:
        admitted = admission.admit(self.spec, self.rd, self.force, self.say)
        events = self.journal.events()
        self.ledger.recall(events)
        self.policy.preemptions = sum(1 for e in events if e["event"] == Event.RECOVERY
                                      and is_preemption(e.get("kind")))
        self._attempts_before = max((e["attempt"] for e in events
                                     if e["event"] == Event.ATTEMPT_STARTED), default=0)
        if merged.get("set_aside"):
            self.say(f"a new run: the control state of an earlier run here is kept aside in "
                     f"{merged['set_aside']}")
        if merged.get("to_run_dir") or merged.get("from_run_dir"):
            self.say(f"merged the journals: {merged['to_run_dir']} event(s) this machine held "
                     f"back, {merged['from_run_dir']} from the run directory")
        if stale:
            self.say(f"took over the run directory from a dead supervisor ({stale['reason']})")
            self.journal.append(Event.LOCK_TAKEN_OVER, previous=stale)
            kill_orphans(events, self.journal)
        if self.cell is None:
            shutil.copyfile(self.spec.job_path, self.rd.job_copy)
        else:
            path = self.cell.freeze(self.rd.job_copy)
            self.say(f"the job's functions ({', '.join(self.cell.code.names)}) are carried in "
                     f"{path} ({len(self.cell.code.blob) / 1024:.0f} KiB)")
        admission.record(self.spec, self.rd, self.journal, admitted, self.store,
                         had_events=bool(events), say=self.say)
        self.remedies.recall(events)
        resumed = bool(events)
        self.journal.append(Event.RUN_RESUMED if resumed else Event.RUN_STARTED,
                            job=self.spec.job_path, epochs=self.spec.epochs, pid=os.getpid(),
                            host=socket.gethostname())
        self.ledger.scan()
        self.say(f"{'resuming' if resumed else 'starting'} run '{self.spec.name}' in "
                 f"{self.rd.root} at epoch {self.ledger.latest_epoch()}/{self.spec.epochs}")

    def _watch(self, observer: Observer) -> None:
        os.makedirs(self.store.local.root, exist_ok=True)
        observer.schedule(_CheckpointEvents(self.q), self.store.local.root, recursive=True)
        if os.path.isdir(self.rd.checkpoints):  # commits a worker made there directly
            observer.schedule(_CheckpointEvents(self.q), self.rd.checkpoints)
        observer.schedule(HeartbeatEvents(self.q), self.rd.control, recursive=False)
        observer.start()

    def _journal_ended(self, outcome: Outcome, error: dict | None, kind: str,
                       signature: str | None, layer: str | None) -> None:
        """``layer``: the evidence layer that named the kind (None: exit status, signal)."""
        rc = outcome.exit_code
        self.journal.append(Event.ATTEMPT_ENDED, attempt=outcome.attempt, exit_code=rc,
                            signal=signal_name(-rc) if rc < 0 else None,
                            duration_s=round(outcome.duration_s, 3), error=summary(error),
                            epoch=self.ledger.latest_epoch(), kind=kind, signature=signature,
                            layer=layer)

    def _ready_strategy(self, n: int) -> str | None:
        return next((e.get("strategy_kind") for e in self.journal.iter(Event.WORKER_READY)
                     if e.get("attempt") == n), None)

    def _position(self, outcome: Outcome, error: dict | None) -> str:
        where = error if error and "epoch" in error else heartbeat.read(self.rd.control) or {}
        if where.get("attempt", outcome.attempt) != outcome.attempt:
            where = {}
        return (f"epoch {where.get('epoch', self.ledger.latest_epoch())} "
                f"batch {where.get('batch', 0)}")

    def _attempt_env(self, consume: bool = False) -> dict:
        env = self.remedies.worker_env(_worker_env(self._base_env()), consume=consume)
        env.pop(faults_mod.ENV, None)
        if self.faults:
            env[faults_mod.ENV] = json.dumps(self.faults)
        return env

    def _base_env(self) -> dict:
        """The environment of every process the supervisor starts; the run's backend in it, so
        that the worker, the standby and the exporter train and build on the one frozen with
        the run (``KERAS_BACKEND`` for the job's own imports of Keras too)."""
        env = dict(self.env if self.env is not None else os.environ)
        env[ENV_BACKEND] = env[KERAS_BACKEND_ENV] = self.spec.backend
        return env

    def _sleep(self, seconds: float) -> None:
        if self.clock.wait(self._stop, seconds):
            raise Stopped()

    # ------------------------------------------------------------------ accelerator watch
    def _probe_accelerator(self, attempt: int, running: bool = False) -> None:
        res = self.remedies.probe()()
        self.remedies.probed(res)
        changed = res.ok != self._accel_ok
        if not running or changed:
            self.journal.append(Event.ACCELERATOR_PROBE, attempt=attempt, running=running,
                                **res.as_dict())
        if running and changed and not res.ok:
            self.journal.append(Event.ACCELERATOR_LOST, attempt=attempt, **res.as_dict())
            self.say(f"accelerator lost during attempt {attempt}: {res.detail}")
        self._accel_ok = res.ok

    # ------------------------------------------------------------------ process control
    def _worker_pgid(self) -> int | None:
        a = self.attempt
        return a.proc.pid if a is not None and a.proc is not None else None

    def _stop_for_preemption(self) -> None:
        """Our own SIGTERM/SIGINT is a preemption notice too: the worker gets SIGTERM and
        ``preempt_grace`` to commit its state; what it saved is journaled and, in what is left
        of the grace, copied to the durable tier (a preempted VM's local disk goes with it)."""
        deadline = self.clock.monotonic() + self.spec.preempt_grace
        if self.attempt is not None:
            self.attempt.stop(grace=self.spec.preempt_grace)
            self.attempt = None
        self.ledger.scan()
        if not self.mirror.running:
            return
        pending = self.mirror.flush(max(0.0, deadline - self.clock.monotonic()))
        if pending:
            self.say(f"{len(pending)} checkpoint(s) not durable yet (steps {pending}); they "
                     f"are in {self.store.local.root}")

    def _stop_worker(self) -> None:
        if self.attempt is not None:
            self.attempt.stop()

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            self.stop_signal = signum
            self._stop.set()
            self.q.put(Stop())

        return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def _restore_signal_handlers(self, old) -> None:
        for s, h in (old or {}).items():
            signal.signal(s, h)


def _budget_line(kind: str, c: dict) -> str:
    if is_preemption(kind):
        cap = c["preemptions_max"]
        return f"preemption {c['preemptions']}" + (f" of {cap}" if cap is not None else "")
    return f"restart {c['errors']} of {c['errors_max']} since the last checkpoint"


def _worker_env(base) -> dict:
    """The worker must run this very orchestrator package, wherever the job's cwd is."""
    paths = [REPO_ROOT] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(base, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(paths))

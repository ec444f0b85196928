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
all feed one queue, so nothing is polled; the durable mirror is a thread of this process.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import sys
import threading
import time

from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from orchestrator.checkpoint import tiers
from orchestrator.checkpoint.mirror import DurableMirror, remount_hook
from orchestrator.checkpoint.store import COMMIT_MARKER
from orchestrator.core import heartbeat
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.lock import RunLock
from orchestrator.core.rundir import EXIT_STOPPED, RunDir
from orchestrator.core.spec import JobSpec
from orchestrator.recovery import faults as faults_mod
from orchestrator.recovery.actions import Remedies
from orchestrator.recovery.evidence import JobContext
from orchestrator.recovery.failures import classify, read_tail, signal_name
from orchestrator.recovery.policy import GIVE_UP, Decision, Failure, RecoveryPolicy, is_preemption
from orchestrator.supervise import admission
from orchestrator.supervise.attempt import Attempt, Every, Outcome, Stopped, kill_orphans
from orchestrator.supervise.console import Progress
from orchestrator.supervise.finish import RunEnd, summary
from orchestrator.supervise.hangs import HangClock, HeartbeatEvents
from orchestrator.supervise.ledger import CheckpointLedger

LOCK_REFRESH_S = 5.0
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
            self.q.put(("checkpoint", path))


def worker_command(spec: JobSpec, attempt: int) -> list[str]:
    return [sys.executable, "-m", "orchestrator.train.worker", spec.job_path,
            "--run-dir", spec.run_dir, "--attempt", str(attempt)]


def export_command(spec: JobSpec) -> list[str]:
    return [sys.executable, "-m", "orchestrator.train.export", spec.run_dir]


class Supervisor:
    def __init__(self, spec: JobSpec, worker_cmd=worker_command, out=None, env=None,
                 faults=(), force: bool = False, remount=None, export_cmd="auto"):
        """``force`` resumes under a changed training hash. ``remount(durable_dir)`` replaces
        the job's ``checkpoint.remount`` hook (a notebook may pass its own). ``export_cmd(spec)``
        is the exporter; "auto" means the real one with the real worker and none with a custom
        worker command (tests' fake workers)."""
        self.spec, self.force, self.worker_cmd, self.env = spec, force, worker_cmd, env
        if export_cmd == "auto":
            export_cmd = export_command if worker_cmd is worker_command else None
        self.faults = [faults_mod.parse(f).text for f in faults]
        self.rd = RunDir(spec.run_dir)
        self.out = out or sys.stdout
        self.journal = Journal(self.rd.journal)
        self.store = tiers.for_spec(spec)
        c = spec.checkpoint
        self.mirror = DurableMirror(self.store, self.journal, c.retention,
                                    c.upload_backoff_initial, c.upload_backoff_max,
                                    remount=remount or remount_hook(spec), say=self.say)
        self.lock = RunLock(self.rd.root)
        self.q: queue.Queue = queue.Queue()
        self.attempt: Attempt | None = None
        self._stop = threading.Event()
        self.stop_signal: int | None = None  # what stopped us: SIGINT is a cell interrupt
        self.restarts = 0
        self.progress = Progress(self.out, self.rd.root, spec.epochs)
        self.hang = HangClock(self.rd.root, spec.hang_timeout, spec.startup_timeout)
        self.remedies = Remedies(spec, self._base_env, own_pgid=self._worker_pgid,
                                 sleep=self._sleep, say=self.say)
        self.policy = RecoveryPolicy(spec.recovery, spec.restarts,
                                     applicable=self.remedies.applicable)
        self.ledger = CheckpointLedger(self.store, self.journal, self.progress,
                                       on_progress=self.policy.progress,
                                       on_scanned=self.mirror.notify)
        self.end = RunEnd(spec, self.rd, self.journal, self.mirror, self.progress, export_cmd,
                          export_env=lambda: _worker_env(self._base_env()))
        self._accel_ok: bool | None = None
        self._attempts_before = 0
        self._run_dir_down: float | None = None  # since when the run dir cannot be written

    # ------------------------------------------------------------------ public
    def run(self) -> int:
        """Run (or resume) the job to completion. Returns the process exit code."""
        self.rd.make()
        stale = self.lock.acquire()  # LockedError propagates to the caller
        old_handlers = self._install_signal_handlers()
        observer = Observer()
        try:
            self.progress.start()
            self._open_run(stale)
            self._watch(observer)
            self.mirror.start()
            return self._supervise()
        except (Stopped, KeyboardInterrupt) as exc:
            if isinstance(exc, KeyboardInterrupt):
                self.stop_signal = signal.SIGINT
            self._stop_for_preemption()
            self.journal.append(Event.SUPERVISOR_STOPPED, reason="signal")
            self.say("stopped; the run resumes when `orchestrator run` is started again")
            return EXIT_STOPPED
        finally:
            self._stop_worker()
            if observer.is_alive():
                observer.stop()
                observer.join(timeout=5)
            self.mirror.stop()
            self.progress.stop()
            self._restore_signal_handlers(old_handlers)
            self.lock.release()

    def say(self, msg: str) -> None:
        self.progress.say(msg)

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
                return self.end.failed(outcome, decision, failure.evidence,
                                       self.ledger.latest_epoch(), self._counters())
            self._restart(outcome, decision)
        return self.end.completed(self.ledger.latest(), self._counters())

    def _run_attempt(self) -> Outcome:
        """Probe, spawn, wait until it exits or hangs, journal how it ended."""
        n = self._attempts_before = self._attempts_before + 1
        self._probe_accelerator(attempt=n)
        self.attempt = Attempt(n, self.worker_cmd(self.spec, n), self._attempt_env(consume=True),
                               self.spec.job_dir, self.rd.attempt_log(n), self.q, self.hang,
                               self.journal, self.say, self.rd.error_record(n),
                               self.spec.stop_grace)
        self.attempt.start(self.ledger.latest_epoch())
        self.progress.attempt_started(n, self.ledger.latest_epoch())
        outcome = self.attempt.wait(on_checkpoint=self.ledger.scan, duties=[
            Every(LOCK_REFRESH_S, self._refresh_lock),
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
                       time.time(), d.evidence, d.escalate)

    def _apply(self, outcome: Outcome, decision: Decision) -> None:
        """Carry out the action (none for give_up) and journal it with the policy's reason."""
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

    def _refresh_lock(self) -> None:
        """Renew the lock; a run directory that cannot be written is reported once, and its
        return once (the journal holds the events meanwhile, the mirror the checkpoints)."""
        exc = self.lock.refresh()
        if exc is not None and self._run_dir_down is None:
            self._run_dir_down = time.time()
            self.journal.append(Event.RUN_DIR_UNREACHABLE, error=str(exc))
            self.say(f"the run directory {self.rd.root} cannot be written ({exc}); training "
                     f"goes on, events are held until it is back")
        elif exc is None and self._run_dir_down is not None:
            self.journal.append(Event.RUN_DIR_RESTORED,
                                outage_s=round(time.time() - self._run_dir_down, 3))
            self.say(f"the run directory is back after {time.time() - self._run_dir_down:.0f} s")
            self._run_dir_down = None

    def _counters(self) -> dict:
        return dict(self.policy.counters(), restarts=self.restarts)

    # ------------------------------------------------------------------ run lifecycle
    def _open_run(self, stale: dict | None) -> None:
        admitted = admission.admit(self.spec, self.rd, self.force, self.say)
        events = self.journal.events()
        self.ledger.recall(events)
        self.policy.preemptions = sum(1 for e in events if e["event"] == Event.RECOVERY
                                      and is_preemption(e.get("kind")))
        self._attempts_before = max((e["attempt"] for e in events
                                     if e["event"] == Event.ATTEMPT_STARTED), default=0)
        if stale:
            self.say(f"took over the run directory from a dead supervisor ({stale['reason']})")
            self.journal.append(Event.LOCK_TAKEN_OVER, previous=stale)
            kill_orphans(events, self.journal)
        shutil.copyfile(self.spec.job_path, self.rd.job_copy)
        admission.record(self.spec, self.rd, self.journal, admitted, self.store,
                         had_events=bool(events), say=self.say)
        self.remedies.recall(events)
        resumed = bool(events)
        self.journal.append(Event.RUN_RESUMED if resumed else Event.RUN_STARTED,
                            job=self.spec.job_path, epochs=self.spec.epochs, pid=os.getpid())
        self.ledger.scan()
        self.say(f"{'resuming' if resumed else 'starting'} run '{self.spec.name}' in "
                 f"{self.rd.root} at epoch {self.ledger.latest_epoch()}/{self.spec.epochs}")

    def _watch(self, observer: Observer) -> None:
        os.makedirs(self.store.local.root, exist_ok=True)
        observer.schedule(_CheckpointEvents(self.q), self.store.local.root, recursive=True)
        if os.path.isdir(self.rd.checkpoints):  # commits a worker made there directly
            observer.schedule(_CheckpointEvents(self.q), self.rd.checkpoints)
        observer.schedule(HeartbeatEvents(self.q), self.rd.root, recursive=False)
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
        where = error if error and "epoch" in error else heartbeat.read(self.rd.root) or {}
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
        return dict(self.env if self.env is not None else os.environ)

    def _sleep(self, seconds: float) -> None:
        if self._stop.wait(seconds):
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
        deadline = time.monotonic() + self.spec.preempt_grace
        if self.attempt is not None:
            self.attempt.stop(grace=self.spec.preempt_grace)
            self.attempt = None
        self.ledger.scan()
        if not self.mirror.running:
            return
        pending = self.mirror.flush(max(0.0, deadline - time.monotonic()))
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
            self.q.put(("stop",))

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

"""The supervisor: run attempts until the job completes or the policy gives up.

It never imports TensorFlow (a broken TensorFlow must be fixable from here, and a TPU must never
be held by this process). The loop (``_supervise``) is the policy, read top to bottom as torch
elastic's agent loop: run an attempt, judge its outcome (classify it into a ``Failure``), ask
``policy.decide`` for the action, the delay and the reason, carry it out, wait, go on. The
pieces live beside it, one reason to change each:

- ``compose.py``: the groups the constructor builds (run directory, recovery, checkpoints)
  and the commands it starts; ``slot.py``: the worker slot (the queue, the stop);
- ``admission.py``: may this job resume this run directory (training hash, ``--force``);
- ``attempt.py``: one attempt over its workers (one, or a group): spawn, wait on events,
  stop a hung worker, kill the process groups; ``procs.py``: how a process is started here;
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

import logging
import os
import shutil
import signal
import socket

from watchdog.observers import Observer

from orchestrator.checkpoint.lost import durable_lost
from orchestrator.checkpoint.settle import history
from orchestrator.core import heartbeat, hosts, logs
from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.lock import LockLost
from orchestrator.core.rundir import ENV_RESTORE_STEP, EXIT_LOCK_LOST, EXIT_STOPPED, RunDir
from orchestrator.core.spec import JobSpec
from orchestrator.recovery.evidence import JobContext
from orchestrator.recovery.failures import classify, read_tail, signal_name
from orchestrator.recovery.policy import GIVE_UP, Decision, Failure, is_preemption
from orchestrator.supervise import admission
from orchestrator.supervise.attempt import Attempt, Every, Outcome, Stopped
from orchestrator.supervise.compose import Checkpoints, Commands, Recovery, RunDirectory
from orchestrator.supervise.finish import RunEnd, summary
from orchestrator.supervise.group import Engine, LocalEngine
from orchestrator.supervise.procs import kill_orphans
from orchestrator.supervise.slot import WorkerSlot, watch
from orchestrator.supervise.standby import StandbyKeeper

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, spec: JobSpec, commands: Commands = Commands(), out=None, env=None,
                 faults=(), force: bool = False, remount=None, cell=None, clock: Clock = SYSTEM,
                 engine: Engine | None = None):
        """``commands``: the worker, standby and exporter it starts (compose.Commands).
        ``env``: the environment they start in (default: ours). ``force`` resumes under a
        changed training hash. ``remount(durable_dir)`` replaces the job's
        ``checkpoint.remount`` hook (a notebook may pass its own). ``cell``: a job given to
        ``orchestrator.run`` as keywords (core/cellcode.CellJob), frozen with its code once the
        run is admitted. ``clock``: what the lease, the hang clock, the mirrors and the waits
        between attempts read. ``engine``: who runs the workers (group.Engine; None: the
        spec's, local processes or Ray, chosen at the start; the tests give a fake one). Each
        group is built from those before it (compose.py)."""
        self.spec, self.commands, self.force, self.cell, self.clock = \
            spec, commands, force, cell, clock
        self.rd = RunDir.for_spec(spec)
        self.slot = WorkerSlot(spec, self.rd, clock)  # the queue, the stop, the attempt
        self.run_dir = RunDirectory(spec, self.rd, out, self.slot, clock)  # journal, lease
        self.recovery = Recovery(spec, env, faults, self.slot, self.run_dir, clock)
        self.checkpoints = Checkpoints(spec, self.run_dir, self.recovery, remount, clock)
        self.run_dir.lease.when_lost(lambda lost: self.checkpoints.mirror.stop(timeout=0))
        self.engine: Engine | None = engine
        self.group = spec.workers > 1 or spec.engine != "local"  # ranks placed by the engine
        self.standby = StandbyKeeper(spec, commands.standby, self.rd, self.run_dir.journal,
                                     self.slot, self.recovery, engine=engine)
        self.end = RunEnd(spec, self.rd, self.run_dir.journal, self.checkpoints.mirror,
                          self.run_dir.console, commands.export, self.recovery.export_env,
                          run_dir_back=self.run_dir.control.flush)
        # the loop's words for what it reads most
        self.journal, self.console = self.run_dir.journal, self.run_dir.console
        self.ledger, self.policy = self.checkpoints.ledger, self.recovery.policy
        self.restarts = 0
        self.last_attempt = 0  # the number of the latest attempt, of any session

    # ------------------------------------------------------------------ public
    def run(self) -> int:
        """Run (or resume) the job to completion. Returns the process exit code. The
        orchestrator's log lines go to the console meanwhile (core/logs.routed)."""
        with logs.routed(self.console.line):
            return self._run()

    def _run(self) -> int:
        stale = self.run_dir.outage.retry_start(self.run_dir.take)  # LockedError propagates
        old_handlers = self.slot.install_signal_handlers()
        observer = Observer()
        try:
            self.console.start()
            self.run_dir.outage.retry_start(
                lambda: self._open_run(stale, self.run_dir.control.merge_on_start()))
            self.engine = self.engine or self._spec_engine()
            watch(observer, self.slot, self.checkpoints.store, self.rd)
            self.checkpoints.mirror.start()
            self.run_dir.control.start()
            return self._supervise()
        except (Stopped, KeyboardInterrupt) as exc:
            return self._stopped(exc)
        finally:
            self._close(observer)
            self.slot.restore_signal_handlers(old_handlers)
            self.run_dir.lock.release()

    def run_loop(self) -> int:
        """The loop alone, in this thread: no watcher, mirror, console thread or signal
        handler, so every item on the queue is the engine's. What a test drives with a fake
        engine (tests/fakes/engine.py) and a fake clock, in milliseconds."""
        stale = self.run_dir.take()
        try:
            self._open_run(stale, self.run_dir.control.merge_on_start())
            self.engine = self.engine or self._spec_engine()
            return self._supervise()
        except Stopped as exc:
            return self._stopped(exc)
        finally:
            self._close(None)
            self.run_dir.lock.release()

    def _stopped(self, exc: BaseException) -> int:
        """A stop (signal, interrupt, lost lock): the worker saves what it can, the run stays
        resumable; or, the lock lost, another supervisor has it."""
        if self.lock_lost is not None:
            return self._stand_down()
        if isinstance(exc, KeyboardInterrupt):
            self.slot.stop_signal = signal.SIGINT
        self._stop_for_preemption()
        self.journal.append(Event.SUPERVISOR_STOPPED, reason="signal")
        log.info("stopped; the run resumes when `orchestrator run` is started again")
        return EXIT_STOPPED

    def _close(self, observer: Observer | None) -> None:
        """Whatever the end: the worker and the standby gone, the threads stopped, what is
        held back flushed to the run directory (not when the lock is lost)."""
        self.slot.end()
        self.standby.discard("the supervisor stopped")
        if observer is not None and observer.is_alive():
            observer.stop()
            observer.join(timeout=5)
        if self.engine is not None:
            self.engine.close()
        self.checkpoints.mirror.stop()
        self.run_dir.control.stop(self.spec.checkpoint.flush_timeout
                                  if self.lock_lost is None else None)
        self.console.stop()

    @property
    def stop_signal(self) -> int | None:
        """The signal that stopped the run, if one did (SIGINT: a notebook's interrupt)."""
        return self.slot.stop_signal

    @property
    def lock_lost(self) -> LockLost | None:
        return self.run_dir.lease.lost

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
        n = self.last_attempt = self.last_attempt + 1
        if not self.run_dir.lease.wait_held(self.slot.stopped):  # paused: start nothing
            raise Stopped()
        self.recovery.probe(attempt=n)
        env = self.recovery.attempt_env(consume=True)
        if self.group:  # every rank restores the same step
            env[ENV_RESTORE_STEP] = self._group_restore_step()
        attempt = self.slot.attempt = Attempt(
            n, self.commands.worker(self.spec, n), env, spec=self.spec, rd=self.rd,
            slot=self.slot, journal=self.journal, standby=self.standby,
            engine=self.engine, group=self.group)
        attempt.start(self.ledger.resumable_epoch)  # the standby's process, or a cold start
        self.console.attempt_started(n, self.ledger.latest_epoch())
        outcome = attempt.wait(on_checkpoint=self.ledger.scan, on_commits=self.ledger.heard,
                               duties=[Every(self.spec.probe_interval,
                                             lambda: self.recovery.probe(n, running=True))])
        self.slot.attempt = None
        self.ledger.attempt_ended()
        self.recovery.remedies.ran_on(self._ready_strategy(n))
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
                       self.clock.time(), d.evidence, d.escalate, ran_s=outcome.duration_s)

    def _apply(self, outcome: Outcome, decision: Decision) -> None:
        """Carry out the action (none for give_up) and journal it with the policy's reason."""
        if decision.action != GIVE_UP:  # before the action: a reinstall must not run beside it
            self.standby.check(decision.action, self.recovery.attempt_env())
        if decision.action == GIVE_UP:
            detail, fields = decision.reason, {}
        else:
            detail, fields = self.recovery.remedies.apply(decision, self.recovery.attempt_env())
        self.journal.append(Event.RECOVERY, attempt=outcome.attempt, kind=decision.kind,
                            action=decision.action, detail=detail, **fields)

    def _restart(self, outcome: Outcome, decision: Decision) -> None:
        self.restarts += 1
        counters = self._counters()
        self.journal.append(Event.RESTART, after_attempt=outcome.attempt,
                            delay_s=round(decision.delay_s, 3), restart=self.restarts,
                            budget=self.spec.restarts.max, kind=decision.kind, **counters)
        self.console.restarted(self.restarts, outcome.attempt, decision.kind,
                               outcome.describe(),
                               f"restarting in {decision.delay_s:.1f} s "
                               f"({_budget_line(decision.kind, counters)})")
        self.slot.sleep(decision.delay_s)

    # ------------------------------------------------------------------ stopping
    def _stand_down(self) -> int:
        """Another supervisor owns the run now: kill our worker at once (it is paused, and must
        not commit anything) and leave the run directory to it."""
        self.slot.end(grace=0.0)
        log.info(f"{self.lock_lost}; this supervisor stops. What it held back stays in "
                 f"{self.rd.control}.")
        return EXIT_LOCK_LOST

    def _stop_for_preemption(self) -> None:
        """Our own SIGTERM/SIGINT is a preemption notice too: the worker gets SIGTERM and
        ``preempt_grace`` to commit its state; what it saved is journaled and, in what is left
        of the grace, copied to the durable tier (a preempted VM's local disk goes with it)."""
        deadline = self.clock.monotonic() + self.spec.preempt_grace
        self.slot.end(grace=self.spec.preempt_grace)
        self.ledger.scan()
        pending = self.checkpoints.flush(max(0.0, deadline - self.clock.monotonic()))
        if pending:
            log.info(f"{len(pending)} checkpoint(s) not durable yet (steps {pending}); they "
                     f"are in {self.checkpoints.store.local.root}")

    # ------------------------------------------------------------------ groups
    def _spec_engine(self) -> Engine:
        """Who runs the workers, as the spec says: Ray places them, or processes here."""
        if self.spec.engine == "ray":
            from orchestrator.supervise.rayengine import RayEngine

            store = self.checkpoints.store  # ranks on other nodes make their durable copies
            return RayEngine(self.spec.address, dict(self.spec.worker_resources),
                             journal=self.journal, tiers=(store.local.root, store.durable.root,
                                                          self.spec.checkpoint.retention))
        return LocalEngine()

    def _group_restore_step(self) -> str:
        """The step every rank restores ("": start afresh). With Ray, ranks on other nodes
        read the run directory: the last chief's node first copies what only it holds there
        (``engine.gather``), and the newest checkpoint is made durable."""
        if self.engine.gather(self.spec.checkpoint.flush_timeout):
            self.ledger.scan()  # what it copied is journaled as committed, and counts
        latest = self.ledger.latest()
        if latest is None:
            return ""
        if self.spec.engine == "ray":
            if latest.step in self.checkpoints.flush(self.spec.checkpoint.flush_timeout):
                log.info(f"checkpoint step {latest.step} is not durable yet: ranks on other "
                         f"nodes may not see it")
        return str(latest.step)

    def _counters(self) -> dict:
        return dict(self.policy.counters(), restarts=self.restarts)

    # ------------------------------------------------------------------ run lifecycle
    def _open_run(self, stale: dict | None, merged: dict) -> None:
        admitted = admission.admit(self.spec, self.rd, self.force)
        events = self.journal.events()
        self.ledger.recall(events)
        self.policy.preemptions = sum(1 for e in events if e["event"] == Event.RECOVERY
                                      and is_preemption(e.get("kind")))
        self.last_attempt = max((e["attempt"] for e in events
                                 if e["event"] == Event.ATTEMPT_STARTED), default=0)
        if merged.get("set_aside"):
            log.info(f"a new run: the control state of an earlier run here is kept aside in "
                     f"{merged['set_aside']}")
        if merged.get("to_run_dir") or merged.get("from_run_dir"):
            log.info(f"merged the journals: {merged['to_run_dir']} event(s) this machine held "
                     f"back, {merged['from_run_dir']} from the run directory")
        if stale:
            log.info(f"took over the run directory from a dead supervisor ({stale['reason']})")
            self.journal.append(Event.LOCK_TAKEN_OVER, previous=stale)
            kill_orphans(events, self.journal)
        if self.cell is None:
            shutil.copyfile(self.spec.job_path, self.rd.job_copy)
        else:
            path = self.cell.freeze(self.rd.job_copy)
            log.info(f"the job's functions ({', '.join(self.cell.code.names)}) are carried in "
                     f"{path} ({len(self.cell.code.blob) / 1024:.0f} KiB)")
        admission.record(self.spec, self.rd, self.journal, admitted, self.checkpoints.store,
                         had_events=bool(events))
        self.recovery.remedies.recall(events)
        resumed = bool(events)
        self.journal.append(Event.RUN_RESUMED if resumed else Event.RUN_STARTED,
                            job=self.spec.job_path, epochs=self.spec.epochs, pid=os.getpid(),
                            host=socket.gethostname())
        self.ledger.scan()
        self._durable_lost(events)
        log.info(f"{'resuming' if resumed else 'starting'} run '{self.spec.name}' in "
                 f"{self.rd.root} at epoch {self.ledger.latest_epoch()}/{self.spec.epochs}")

    def _durable_lost(self, events: list[dict]) -> None:
        """Say what a recycled runtime's cache took with it (checkpoint/lost.py)."""
        if not self.checkpoints.settling.policy.writeback:
            return  # a tier settled at fsync loses nothing to a cache
        outer = Journal(os.path.join(self.rd.root, hosts.FILE)).events()
        lost = durable_lost(events, outer, self.ledger.latest(),
                            history(self.checkpoints.store.durable.root))
        if lost:
            self.journal.append(Event.DURABLE_LOST, **lost)
            a, b = lost["steps"]
            log.warning(f"steps {a}..{b} never reached {self.rd.checkpoints} (known from the "
                        f"{lost['known_from']}): they are trained again from step {a - 1}")

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


def _budget_line(kind: str, c: dict) -> str:
    if is_preemption(kind):
        cap = c["preemptions_max"]
        return f"preemption {c['preemptions']}" + (f" of {cap}" if cap is not None else "")
    return f"restart {c['errors']} of {c['errors_max']} since the last checkpoint"

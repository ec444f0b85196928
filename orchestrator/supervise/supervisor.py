"""The supervisor: start a worker, watch it, journal what happens, recover as the policy says.

It never imports TensorFlow (a broken TensorFlow must be fixable from here, and a TPU must never
be held by this process). One loop, one attempt at a time: probe the accelerator, spawn the
worker in its own process group, then wait on one queue fed by the worker's exit (a waiting
thread: noticed at once), the checkpoint directory and the heartbeat file (watchdog events) and
a tick (lock refresh, accelerator probe); a silent worker is a hang. A failed attempt is
classified (failures.py) and the recovery policy (recovery.py) picks the next action, which is
carried out before the next attempt. The journal's epoch and checkpoint events are derived from
committed checkpoints of either tier (the worker commits to the local tier; the durable mirror,
a thread of this process, copies them to the run directory), so each completed epoch is
journaled exactly once whichever process dies. A run resumes only under the training hash it
was created with, unless forced. At the end the durable backlog is flushed and, unless the
last worker exported the final weights itself, the model is exported for inference by a
separate process (TensorFlow).
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from tenacity import (RetryCallState, Retrying, retry_if_exception, stop_after_attempt,
                      wait_exponential)
from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from orchestrator.recovery import faults as faults_mod
from orchestrator.core import heartbeat
from orchestrator.checkpoint import tiers
from orchestrator.checkpoint.store import COMMIT_MARKER
from orchestrator.recovery.failures import Diagnosis, classify, kind_of, read_tail
from orchestrator.supervise.hangs import HangClock, HeartbeatEvents, dump_stacks
from orchestrator.core.journal import Journal
from orchestrator.core.lock import RunLock
from orchestrator.checkpoint.mirror import DurableMirror, remount_hook
from orchestrator.core.osutil import is_missing, pid_alive, read_json, write_json_atomic
from orchestrator.supervise.console import Progress
from orchestrator.recovery.policy import GIVE_UP, Decision, Failure, RecoveryPolicy
from orchestrator.recovery.actions import Remedies
from orchestrator.core.rundir import EXIT_STOPPED, RunDir
from orchestrator.core.spec import JobSpec
from orchestrator.core.events import Event
from orchestrator.core.kinds import Kind

LOCK_REFRESH_S = 5.0


@dataclass
class AttemptFailed(Exception):
    attempt: int
    exit_code: int
    error: dict | None
    duration: float
    diagnosis: Diagnosis | None = None
    decision: Decision | None = None

    @property
    def kind(self) -> str:
        if self.decision:
            return self.decision.kind  # after escalation
        return self.diagnosis.kind if self.diagnosis else (
            kind_of({"exit_code": self.exit_code}) or Kind.UNKNOWN)

    @property
    def recoverable(self) -> bool:
        return self.decision is not None and self.decision.action != GIVE_UP

    def describe(self) -> str:
        if self.exit_code < 0:
            how = f"killed by {_signal_name(-self.exit_code)}"
        else:
            how = f"exit code {self.exit_code}"
        if self.error:
            msg = self.error.get("message", "").strip().splitlines()
            how += f": {self.error.get('type')}: {msg[0] if msg else ''}"
        return f"attempt {self.attempt} failed after {self.duration:.1f} s ({how})"


class Stopped(Exception):
    """The supervisor was asked to stop (SIGTERM, SIGINT or KeyboardInterrupt)."""


class IncompatibleResume(Exception):
    """The job's model, data or optimizer changed since the run was created."""


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


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
        self.spec = spec
        self.force = force
        if export_cmd == "auto":
            export_cmd = export_command if worker_cmd is worker_command else None
        self.export_cmd = export_cmd
        self.faults = [faults_mod.parse(f).text for f in faults]
        self.rd = RunDir(spec.run_dir)
        self.worker_cmd = worker_cmd
        self.out = out or sys.stdout
        self.env = env
        self.journal = Journal(self.rd.journal)
        self.store = tiers.for_spec(spec)
        c = spec.checkpoint
        self.mirror = DurableMirror(self.store, self.journal, c.retention,
                                    c.upload_backoff_initial, c.upload_backoff_max,
                                    remount=remount or remount_hook(spec), say=self.say)
        self.lock = RunLock(self.rd.root)
        self.q: queue.Queue = queue.Queue()
        self.proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self.stop_signal: int | None = None  # what stopped us: SIGINT is a cell interrupt
        self._journaled_epochs: set[int] = set()
        self._journaled_ckpts: set[int] = set()
        self.restarts = 0
        self.progress = Progress(self.out, self.rd.root, spec.epochs, spec.restarts.max)
        self.hang = HangClock(self.rd.root, spec.hang_timeout, spec.startup_timeout)
        self.remedies = Remedies(spec, self._base_env,
                                 own_pgid=lambda: self.proc.pid if self.proc else None,
                                 sleep=self._sleep, say=self.say)
        self.policy = RecoveryPolicy(spec.recovery, spec.restarts.max,
                                     applicable=self.remedies.applicable)
        self._accel_ok: bool | None = None

    # ------------------------------------------------------------------ public
    def run(self) -> int:
        """Run (or resume) the job to completion. Returns the process exit code."""
        self.rd.make()
        stale = self.lock.acquire()  # LockedError propagates to the caller
        old_handlers = self._install_signal_handlers()
        try:
            self.progress.start()
            self._open_run(stale)
            os.makedirs(self.store.local.root, exist_ok=True)
            observer = Observer()
            observer.schedule(_CheckpointEvents(self.q), self.store.local.root, recursive=True)
            if os.path.isdir(self.rd.checkpoints):  # commits a worker made there directly
                observer.schedule(_CheckpointEvents(self.q), self.rd.checkpoints)
            observer.schedule(HeartbeatEvents(self.q), self.rd.root, recursive=False)
            observer.start()
            self.mirror.start()
            try:
                if not self._completed():
                    self._attempt_loop()
            finally:  # stop watching before the last journal writes (a quiet stop)
                self._stop_worker()
                observer.stop()
                observer.join(timeout=5)
            return self._finish()
        except AttemptFailed as failure:
            return self._give_up(failure)
        except (Stopped, KeyboardInterrupt) as exc:
            if isinstance(exc, KeyboardInterrupt):
                self.stop_signal = signal.SIGINT
            self._stop_worker()
            self.journal.append(Event.SUPERVISOR_STOPPED, reason="signal")
            self.say("stopped; the run resumes when `orchestrator run` is started again")
            return EXIT_STOPPED
        finally:
            self._stop_worker()
            self.mirror.stop()
            self.progress.stop()
            self._restore_signal_handlers(old_handlers)
            self.lock.release()

    def say(self, msg: str) -> None:
        self.progress.say(msg)

    # ------------------------------------------------------------------ run lifecycle
    def _open_run(self, stale: dict | None) -> None:
        self._check_resume()
        events = self.journal.events()
        self._journaled_epochs = {e["epoch"] for e in events if e["event"] == Event.EPOCH_COMPLETED}
        self._journaled_ckpts = {e["step"] for e in events if e["event"] == Event.CHECKPOINT_COMMITTED}
        self._attempts_before = max((e["attempt"] for e in events
                                     if e["event"] == Event.ATTEMPT_STARTED), default=0)
        if stale:
            self.say(f"took over the run directory from a dead supervisor ({stale['reason']})")
            self.journal.append(Event.LOCK_TAKEN_OVER, previous=stale)
            self._kill_orphan(events)
        shutil.copyfile(self.spec.job_path, self.rd.job_copy)
        info = read_json(self.rd.run_info)
        if info is None and not events and is_missing(self.rd.run_info):
            self._set_aside_earlier_checkpoints()
        if info is None:
            write_json_atomic(self.rd.run_info, {"name": self.spec.name, "created": time.time(),
                                                 "job_path": self.spec.job_path,
                                                 "training_hash": self.spec.training_hash(),
                                                 "training": self.spec.training_relevant()})
        elif self._forced is not None:
            self.journal.append(Event.RESUME_FORCED, **self._forced)
            write_json_atomic(self.rd.run_info, dict(
                info, job_path=self.spec.job_path, training_hash=self.spec.training_hash(),
                training=self.spec.training_relevant(),
                previous_training_hashes=info.get("previous_training_hashes", [])
                + [info.get("training_hash")]))
        self.remedies.recall(events)
        resumed = bool(events)
        self.journal.append(Event.RUN_RESUMED if resumed else Event.RUN_STARTED, job=self.spec.job_path,
                            epochs=self.spec.epochs, pid=os.getpid())
        self._reconcile()
        done = self._latest_epoch()
        self.say(f"{'resuming' if resumed else 'starting'} run '{self.spec.name}' in "
                 f"{self.rd.root} at epoch {done}/{self.spec.epochs}")

    def _set_aside_earlier_checkpoints(self) -> None:
        """A new run (no run.json, no journal) finds local checkpoints: an earlier run at this
        run directory, since deleted, left them. Never resume from them; keep them aside."""
        moved = tiers.set_aside_local(self.store)
        if moved:
            dest, n = moved
            self.journal.append(Event.LOCAL_CHECKPOINTS_SET_ASIDE, path=self.store.local.root,
                                moved_to=dest, entries=n)
            self.say(f"the local checkpoint folder {self.store.local.root} held {n} entr"
                     f"{'y' if n == 1 else 'ies'} of an earlier run in this run directory (its "
                     f"run.json is gone): moved to {dest}; this run starts from scratch")

    def _check_resume(self) -> None:
        """Refuse to resume under a changed model, data, compile, batch size or seed: the
        checkpoints would be continued by a different training. ``force`` overrides."""
        self._forced = None
        info = read_json(self.rd.run_info)
        if not info or not info.get("training_hash"):
            return
        old, new = info["training_hash"], self.spec.training_hash()
        if old == new:
            return
        before, now = info.get("training") or {}, self.spec.training_relevant()
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        what = ", ".join(changed) if before else "model, data, compile, batch_size or seed"
        if not self.force:
            raise IncompatibleResume(
                f"{self.spec.job_path}: cannot resume the run in {self.rd.root}: {what} changed "
                f"since it was created (training hash {old[:12]} in run.json, {new[:12]} now). "
                f"Resuming would continue its checkpoints with a different training. Use another "
                f"run_dir for a new run, or `orchestrator run --force` to resume anyway.")
        self._forced = {"changed": changed, "old_hash": old, "new_hash": new}
        self.say(f"resuming despite changed {what} (--force)")

    def _kill_orphan(self, events: list[dict]) -> None:
        """A worker of a dead supervisor may still run (same host): stop it before we start."""
        started = {e["attempt"]: e for e in events if e["event"] == Event.ATTEMPT_STARTED}
        ended = {e["attempt"] for e in events if e["event"] == Event.ATTEMPT_ENDED}
        for n, e in started.items():
            pid = e.get("pid")
            if n not in ended and pid and e.get("host") == os.uname().nodename and pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                    self.journal.append(Event.ORPHAN_WORKER_KILLED, attempt=n, pid=pid)
                except (ProcessLookupError, PermissionError) as exc:
                    self.journal.append(Event.ORPHAN_WORKER_NOT_KILLED, attempt=n, pid=pid,
                                        reason=str(exc))

    def _attempt_loop(self) -> None:
        r = self.spec.restarts
        retrying = Retrying(
            stop=stop_after_attempt(r.max + 1),
            wait=wait_exponential(multiplier=r.backoff_initial, exp_base=r.backoff_multiplier,
                                  max=r.backoff_max),
            retry=retry_if_exception(lambda e: isinstance(e, AttemptFailed) and e.recoverable),
            before_sleep=self._before_restart,
            sleep=self._sleep,
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                self._run_attempt()

    def _before_restart(self, rs: RetryCallState) -> None:
        failure = rs.outcome.exception()
        delay = rs.next_action.sleep if rs.next_action else 0.0
        self.restarts += 1
        self.journal.append(Event.RESTART, after_attempt=failure.attempt, delay_s=round(delay, 3),
                            restart=self.restarts, budget=self.spec.restarts.max)
        self.progress.restarted(self.restarts, failure.attempt, failure.kind, failure.describe(),
                                f"restarting in {delay:.1f} s "
                                f"(restart {self.restarts} of {self.spec.restarts.max})")

    def _sleep(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise Stopped()

    def _run_attempt(self) -> None:
        n = self._attempts_before + 1
        self._attempts_before = n
        self._probe_accelerator(attempt=n)
        cmd = self.worker_cmd(self.spec, n)
        env = self._attempt_env()
        self.remedies.reinit_next = False  # asked of this attempt only
        t0 = time.time()
        with open(self.rd.attempt_log(n), "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env=env, cwd=self.spec.job_dir)
        proc = self.proc
        self.hang.start(n)
        self.journal.append(Event.ATTEMPT_STARTED, attempt=n, pid=proc.pid, host=os.uname().nodename,
                            from_epoch=self._latest_epoch(), log=self.rd.attempt_log(n))
        self.progress.attempt_started(n, self._latest_epoch())
        threading.Thread(target=lambda: self.q.put(("exit", proc, proc.wait())),
                         name=f"wait-attempt-{n}", daemon=True).start()
        rc, hang_s = self._wait(proc, n)
        duration = time.time() - t0
        self._reconcile()
        error = read_json(self.rd.error_record(n))
        if error is not None and error.get("attempt") != n:
            error = None
        # the last checkpoint is committed: a death after it (in the export, or a crash in
        # TensorFlow's teardown) loses nothing and needs no restart
        completed = self._completed()
        diagnosis = None
        if not completed:
            if rc == 0:
                error = error or {"type": "IncompleteRun",
                                  "message": "the worker exited 0 before the last epoch"}
            diagnosis = classify(rc, error, read_tail(self.rd.attempt_log(n)), hang_s)
        self.journal.append(Event.ATTEMPT_ENDED, attempt=n, exit_code=rc,
                            signal=_signal_name(-rc) if rc < 0 else None,
                            duration_s=round(duration, 3), error=_summary(error),
                            epoch=self._latest_epoch(),
                            kind=diagnosis.kind if diagnosis else None,
                            signature=diagnosis.signature if diagnosis else None)
        self.proc = None
        if completed:
            return
        self.remedies.ran_on = self._ready_strategy(n) or self.remedies.ran_on
        failure = Failure(n, diagnosis.kind, diagnosis.signature, self._position(n, error),
                          time.time(), diagnosis.evidence, diagnosis.escalate)
        decision = self.policy.decide(failure, self.restarts)
        detail, fields = (decision.reason, {}) if decision.action == GIVE_UP else \
            self.remedies.apply(decision, self._attempt_env())
        self.journal.append(Event.RECOVERY, attempt=n, kind=decision.kind, action=decision.action,
                            detail=detail, **fields)
        raise AttemptFailed(n, rc if rc != 0 else 1, error, duration, diagnosis, decision)

    def _wait(self, proc: subprocess.Popen, n: int) -> tuple[int, float | None]:
        """The worker's exit status, and the heartbeat age if it was stopped as hung."""
        next_refresh = time.monotonic() + LOCK_REFRESH_S
        next_probe = time.monotonic() + self.spec.probe_interval
        while True:
            timeout = min(next_refresh, next_probe) - time.monotonic()
            try:
                item = self.q.get(timeout=max(0.0, min(timeout, self.hang.remaining())))
            except queue.Empty:
                item = ("tick",)
            if item[0] == "exit" and item[1] is proc:
                return item[2], None
            if item[0] == "checkpoint":
                self._reconcile()
            elif item[0] == "heartbeat":
                self.hang.beat()
            elif item[0] == "stop":
                raise Stopped()
            if self.hang.remaining() <= 0:
                return self._stop_hung(proc, n)
            now = time.monotonic()
            if now >= next_refresh:
                self.lock.refresh()
                next_refresh = now + LOCK_REFRESH_S
            if now >= next_probe:
                self._probe_accelerator(attempt=n, running=True)
                next_probe = time.monotonic() + self.spec.probe_interval

    def _stop_hung(self, proc: subprocess.Popen, n: int) -> tuple[int, float]:
        """Stack dump of every thread into the attempt log, SIGTERM, grace, SIGKILL the group."""
        age = self.hang.age()
        self.journal.append(Event.HANG_DETECTED, attempt=n, last_heartbeat_age_s=round(age, 3),
                            timeout_s=self.hang.timeout, pid=proc.pid)
        self.say(f"attempt {n}: no heartbeat for {age:.1f} s (limit {self.hang.timeout:g} s): "
                 f"dumping its stacks into {self.rd.attempt_log(n)} and stopping it")
        dump_stacks(proc.pid, self.rd.attempt_log(n))
        self._stop_worker(proc, self.spec.stop_grace)
        while True:
            item = self.q.get()
            if item[0] == "exit" and item[1] is proc:
                return item[2], age

    def _ready_strategy(self, n: int) -> str | None:
        return next((e.get("strategy_kind") for e in self.journal.iter(Event.WORKER_READY)
                     if e.get("attempt") == n), None)

    def _position(self, n: int, error: dict | None) -> str:
        where = error if error and "epoch" in error else heartbeat.read(self.rd.root) or {}
        if where.get("attempt", n) != n:
            where = {}
        return f"epoch {where.get('epoch', self._latest_epoch())} batch {where.get('batch', 0)}"

    def _attempt_env(self) -> dict:
        env = self.remedies.worker_env(_worker_env(self._base_env()))
        env.pop(faults_mod.ENV, None)
        if self.faults:
            env[faults_mod.ENV] = json.dumps(self.faults)
        return env

    def _base_env(self) -> dict:
        return dict(self.env if self.env is not None else os.environ)

    # ------------------------------------------------------------------ accelerator watch
    def _probe_accelerator(self, attempt: int, running: bool = False) -> None:
        res = self.remedies.probe()()
        changed = res.ok != self._accel_ok
        if not running or changed:
            self.journal.append(Event.ACCELERATOR_PROBE, attempt=attempt, running=running,
                                **res.as_dict())
        if running and changed and not res.ok:
            self.journal.append(Event.ACCELERATOR_LOST, attempt=attempt, **res.as_dict())
            self.say(f"accelerator lost during attempt {attempt}: {res.detail}")
        self._accel_ok = res.ok

    # ------------------------------------------------------------------ journal from checkpoints
    def _reconcile(self) -> None:
        """Journal every committed checkpoint (either tier) and the epochs it covers, each
        exactly once, then wake the durable mirror."""
        for step, copies in sorted(self.store.copies().items()):
            if step in self._journaled_ckpts:
                continue
            c = next((c for c in copies if self.store.local.verify(c.path, cached=True) is None),
                     None)
            if c is None:
                continue  # not (yet) intact; a later scan or the restore will judge it
            for h in c.manifest.get("history", []):
                e = h.get("epoch")
                if e is None or e in self._journaled_epochs or e > c.epoch:
                    continue
                metrics = {k: v for k, v in h.items() if k != "epoch"}
                self.journal.append(Event.EPOCH_COMPLETED, epoch=e, metrics=metrics,
                                    attempt=c.manifest.get("attempt"))
                self._journaled_epochs.add(e)
                self.progress.epoch_completed(e, metrics, c.manifest.get("attempt"),
                                              c.step if e == c.epoch else None,
                                              c.manifest.get("committed_at"))
            self.journal.append(Event.CHECKPOINT_COMMITTED, epoch=c.epoch,
                                batch=c.manifest.get("batch", 0), step=c.step, path=c.path,
                                weights_sha256=c.manifest.get("weights_sha256"),
                                state_sha256=c.manifest.get("state_sha256"))
            self._journaled_ckpts.add(c.step)
            self.policy.progress()  # the run moves: failures before this are not a loop
        self.mirror.notify()

    def _latest_epoch(self) -> int:
        c = self.store.latest_valid()
        return c.epoch if c else 0

    def _completed(self) -> bool:
        """The last epoch is done, or the job's callbacks ended training (EarlyStopping)."""
        c = self.store.latest_valid()
        return c is not None and c.ends_run(self.spec.epochs)

    def _finish(self) -> int:
        final = self.store.latest_valid()
        fp = final.manifest.get("weights_sha256") if final else None
        pending = self._flush_durable()
        already = any(True for _ in self.journal.iter(Event.RUN_COMPLETED))
        if not already:
            self.journal.append(Event.RUN_COMPLETED, epochs=final.epoch, weights_sha256=fp,
                                state_sha256=final.manifest.get("state_sha256"),
                                checkpoint=final.path, restarts=self.restarts,
                                durable_pending=pending)
        self.say(f"run '{self.spec.name}' completed: {final.epoch} epochs, "
                 f"{self.restarts} restart(s) this session; weights sha256 {fp}")
        self._export(final)
        return 0

    def _flush_durable(self) -> list[int]:
        """Wait (up to checkpoint.flush_timeout) until every checkpoint due is durable."""
        timeout = self.spec.checkpoint.flush_timeout
        pending = self.mirror.flush(timeout)
        if pending:
            self.journal.append(Event.DURABLE_BACKLOG, steps=pending, at="run_end",
                                local_dir=self.store.local.root)
            self.say(f"WARNING: {len(pending)} checkpoint(s) are not durable after {timeout:.0f} s "
                     f"(steps {pending}); they are only in {self.store.local.root}. Run the same "
                     f"command again on this machine to flush them.")
        return pending

    def _export(self, final) -> None:
        """Export the final model for inference in a separate process (it imports TF), unless
        the last worker exported these weights already."""
        if self.export_cmd is None or final is None:
            return
        done = read_json(os.path.join(self.rd.export, "export.json")) or {}
        if done.get("weights_sha256") == final.manifest.get("weights_sha256"):
            self.say(f"the model for inference is in {self.rd.export}")
            return
        log = os.path.join(self.rd.attempts, "export.log")
        t0 = time.time()
        with open(log, "ab") as f:
            rc = subprocess.call(self.export_cmd(self.spec), stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=self.spec.job_dir,
                                 env=_worker_env(self._base_env()))
        if rc == 0:
            self.journal.append(Event.EXPORTED, path=self.rd.export, step=final.step,
                                seconds=round(time.time() - t0, 3))
            self.say(f"exported the model for inference to {self.rd.export}")
        else:
            self.journal.append(Event.EXPORT_FAILED, exit_code=rc, log=log)
            self.say(f"export failed (exit code {rc}); see {log}; retry with "
                     f"`orchestrator export {self.rd.root}`")

    def _give_up(self, failure: AttemptFailed) -> int:
        d, diag = failure.decision, failure.diagnosis
        reason = d.reason if d else "gave up"
        tried = [e["action"] for e in self.journal.iter(Event.RECOVERY) if e["action"] != GIVE_UP]
        self.journal.append(Event.RUN_FAILED, reason=reason, last_attempt=failure.attempt,
                            exit_code=failure.exit_code, error=_summary(failure.error),
                            epoch=self._latest_epoch(), restarts=self.restarts,
                            kind=d.kind if d else None,
                            evidence=diag.evidence if diag else None, tried=tried)
        self.progress.fault(f"FAULT {failure.kind}: {failure.describe()} -> giving up")
        self.say(f"run '{self.spec.name}' FAILED at epoch {self._latest_epoch()}/"
                 f"{self.spec.epochs}: {reason}")
        self.say(f"  kind: {d.kind if d else '?'}; evidence: {diag.evidence if diag else '?'}")
        self.say(f"  tried: {', '.join(tried) or 'nothing (not retryable)'}; "
                 f"log: {self.rd.attempt_log(failure.attempt)}")
        return 1

    # ------------------------------------------------------------------ process control
    def _stop_worker(self, proc: subprocess.Popen | None = None, grace: float | None = None
                     ) -> None:
        """SIGTERM the worker's process group, wait ``grace``, then SIGKILL what is left of it
        (data-loader processes that ignore SIGTERM too)."""
        proc = proc or self.proc
        if proc is None:
            return
        grace = self.spec.stop_grace if grace is None else grace
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=grace)
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # the whole group is gone

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


def _worker_env(base) -> dict:
    """The worker must run this very orchestrator package, wherever the job's cwd is."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [here] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(base, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(paths))


def _summary(error: dict | None) -> dict | None:
    if not error:
        return None
    return {k: error.get(k) for k in ("type", "message", "epoch", "batch") if k in error}


"""The supervisor: start a worker, watch it, journal what happens, restart it within budget.

It never imports TensorFlow (a broken TensorFlow must be fixable from here, and a TPU must never
be held by this process). One loop, one attempt at a time: spawn the worker in its own process
group, then wait on one queue fed by the worker's exit (a waiting thread: noticed at once), the
checkpoint directory (watchdog file events) and a tick (lock refresh). The journal's epoch and
checkpoint events are derived from committed checkpoints, so each completed epoch is journaled
exactly once whichever process dies when.
"""
from __future__ import annotations

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

from .checkpoints import CheckpointStore
from .journal import Journal
from .lock import RunLock
from .osutil import pid_alive, read_json, write_json_atomic
from .progress import Progress
from .rundir import EXIT_CONFIG, EXIT_STOPPED, RunDir
from .spec import JobSpec
from .timeline import kind_of

LOCK_REFRESH_S = 5.0
STOP_GRACE_S = 10.0


@dataclass
class AttemptFailed(Exception):
    attempt: int
    exit_code: int
    error: dict | None
    duration: float

    @property
    def kind(self) -> str:
        return kind_of({"exit_code": self.exit_code}) or "unknown"

    @property
    def fatal(self) -> bool:
        return self.exit_code == EXIT_CONFIG

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


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


class _CheckpointEvents(FileSystemEventHandler):
    def __init__(self, q: queue.Queue):
        self.q = q

    def on_moved(self, event):  # the commit of a checkpoint is a rename
        self.q.put(("checkpoint", event.dest_path))

    def on_created(self, event):
        self.q.put(("checkpoint", event.src_path))


def worker_command(spec: JobSpec, attempt: int) -> list[str]:
    return [sys.executable, "-m", "orchestrator.worker", spec.job_path,
            "--run-dir", spec.run_dir, "--attempt", str(attempt)]


class Supervisor:
    def __init__(self, spec: JobSpec, worker_cmd=worker_command, out=None, env=None):
        self.spec = spec
        self.rd = RunDir(spec.run_dir)
        self.worker_cmd = worker_cmd
        self.out = out or sys.stdout
        self.env = env
        self.journal = Journal(self.rd.journal)
        self.store = CheckpointStore(self.rd.checkpoints)
        self.lock = RunLock(self.rd.root)
        self.q: queue.Queue = queue.Queue()
        self.proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self.stop_signal: int | None = None  # what stopped us: SIGINT is a cell interrupt
        self._journaled_epochs: set[int] = set()
        self._journaled_ckpts: set[int] = set()
        self.restarts = 0
        self.progress = Progress(self.out, self.rd.root, spec.epochs, spec.restarts.max)

    # ------------------------------------------------------------------ public
    def run(self) -> int:
        """Run (or resume) the job to completion. Returns the process exit code."""
        self.rd.make()
        stale = self.lock.acquire()  # LockedError propagates to the caller
        observer = None
        old_handlers = self._install_signal_handlers()
        try:
            self.progress.start()
            self._open_run(stale)
            observer = Observer()
            observer.schedule(_CheckpointEvents(self.q), self.rd.checkpoints, recursive=False)
            observer.start()
            if not self._completed():
                self._attempt_loop()
            return self._finish()
        except AttemptFailed as failure:
            return self._give_up(failure)
        except (Stopped, KeyboardInterrupt) as exc:
            if isinstance(exc, KeyboardInterrupt):
                self.stop_signal = signal.SIGINT
            self._stop_worker()
            self.journal.append("supervisor_stopped", reason="signal")
            self.say("stopped; the run resumes when `orchestrator run` is started again")
            return EXIT_STOPPED
        finally:
            self._stop_worker()
            self.progress.stop()
            if observer is not None:
                observer.stop()
                observer.join(timeout=5)
            self._restore_signal_handlers(old_handlers)
            self.lock.release()

    def say(self, msg: str) -> None:
        self.progress.say(msg)

    # ------------------------------------------------------------------ run lifecycle
    def _open_run(self, stale: dict | None) -> None:
        events = self.journal.events()
        self._journaled_epochs = {e["epoch"] for e in events if e["event"] == "epoch_completed"}
        self._journaled_ckpts = {e["step"] for e in events if e["event"] == "checkpoint_committed"}
        self._attempts_before = max((e["attempt"] for e in events
                                     if e["event"] == "attempt_started"), default=0)
        if stale:
            self.say(f"took over the run directory from a dead supervisor ({stale['reason']})")
            self.journal.append("lock_taken_over", previous=stale)
            self._kill_orphan(events)
        shutil.copyfile(self.spec.job_path, self.rd.job_copy)
        info = read_json(self.rd.run_info)
        if info is None:
            write_json_atomic(self.rd.run_info, {"name": self.spec.name, "created": time.time(),
                                                 "job_path": self.spec.job_path,
                                                 "training_hash": self.spec.training_hash()})
        resumed = bool(events)
        self.journal.append("run_resumed" if resumed else "run_started", job=self.spec.job_path,
                            epochs=self.spec.epochs, pid=os.getpid())
        self._reconcile()
        done = self._latest_epoch()
        self.say(f"{'resuming' if resumed else 'starting'} run '{self.spec.name}' in "
                 f"{self.rd.root} at epoch {done}/{self.spec.epochs}")

    def _kill_orphan(self, events: list[dict]) -> None:
        """A worker of a dead supervisor may still run (same host): stop it before we start."""
        started = {e["attempt"]: e for e in events if e["event"] == "attempt_started"}
        ended = {e["attempt"] for e in events if e["event"] == "attempt_ended"}
        for n, e in started.items():
            pid = e.get("pid")
            if n not in ended and pid and e.get("host") == os.uname().nodename and pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                    self.journal.append("orphan_worker_killed", attempt=n, pid=pid)
                except (ProcessLookupError, PermissionError) as exc:
                    self.journal.append("orphan_worker_not_killed", attempt=n, pid=pid,
                                        reason=str(exc))

    def _attempt_loop(self) -> None:
        r = self.spec.restarts
        retrying = Retrying(
            stop=stop_after_attempt(r.max + 1),
            wait=wait_exponential(multiplier=r.backoff_initial, exp_base=r.backoff_multiplier,
                                  max=r.backoff_max),
            retry=retry_if_exception(lambda e: isinstance(e, AttemptFailed) and not e.fatal),
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
        self.journal.append("restart", after_attempt=failure.attempt, delay_s=round(delay, 3),
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
        cmd = self.worker_cmd(self.spec, n)
        env = _worker_env(self.env if self.env is not None else os.environ)
        t0 = time.time()
        with open(self.rd.attempt_log(n), "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env=env, cwd=self.spec.job_dir)
        proc = self.proc
        self.journal.append("attempt_started", attempt=n, pid=proc.pid, host=os.uname().nodename,
                            from_epoch=self._latest_epoch(), log=self.rd.attempt_log(n))
        self.progress.attempt_started(n, self._latest_epoch())
        threading.Thread(target=lambda: self.q.put(("exit", proc, proc.wait())),
                         name=f"wait-attempt-{n}", daemon=True).start()
        rc = self._wait(proc)
        duration = time.time() - t0
        self._reconcile()
        error = read_json(self.rd.error_record(n))
        if error is not None and error.get("attempt") != n:
            error = None
        self.journal.append("attempt_ended", attempt=n, exit_code=rc,
                            signal=_signal_name(-rc) if rc < 0 else None,
                            duration_s=round(duration, 3),
                            error=_summary(error), epoch=self._latest_epoch())
        self.proc = None
        if rc == 0 and self._completed():
            return
        if rc == 0:
            error = error or {"type": "IncompleteRun",
                              "message": "the worker exited 0 before the last epoch"}
        raise AttemptFailed(n, rc if rc != 0 else 1, error, duration)

    def _wait(self, proc: subprocess.Popen) -> int:
        while True:
            try:
                item = self.q.get(timeout=LOCK_REFRESH_S)
            except queue.Empty:
                self.lock.refresh()
                continue
            if item[0] == "exit" and item[1] is proc:
                return item[2]
            if item[0] == "checkpoint":
                self._reconcile()
            elif item[0] == "stop":
                raise Stopped()

    # ------------------------------------------------------------------ journal from checkpoints
    def _reconcile(self) -> None:
        """Journal every committed checkpoint and the epochs it covers, each exactly once."""
        for c in self.store.list():
            if c.step in self._journaled_ckpts:
                continue
            reason = self.store.verify(c.path)
            if reason is not None:
                continue  # not (yet) intact; a later scan or the restore will judge it
            for h in c.manifest.get("history", []):
                e = h.get("epoch")
                if e is None or e in self._journaled_epochs or e > c.epoch:
                    continue
                metrics = {k: v for k, v in h.items() if k != "epoch"}
                self.journal.append("epoch_completed", epoch=e, metrics=metrics,
                                    attempt=c.manifest.get("attempt"))
                self._journaled_epochs.add(e)
                self.progress.epoch_completed(e, metrics, c.manifest.get("attempt"),
                                              c.step if e == c.epoch else None,
                                              c.manifest.get("committed_at"))
            self.journal.append("checkpoint_committed", epoch=c.epoch,
                                batch=c.manifest.get("batch", 0), step=c.step, path=c.path,
                                weights_sha256=c.manifest.get("weights_sha256"),
                                state_sha256=c.manifest.get("state_sha256"))
            self._journaled_ckpts.add(c.step)

    def _latest_epoch(self) -> int:
        c = self.store.latest_valid()
        return c.epoch if c else 0

    def _completed(self) -> bool:
        """The last epoch is done, or the job's callbacks ended training (EarlyStopping)."""
        c = self.store.latest_valid()
        return c is not None and (c.epoch >= self.spec.epochs or c.manifest.get("stopped_early"))

    def _finish(self) -> int:
        final = self.store.latest_valid()
        fp = final.manifest.get("weights_sha256") if final else None
        already = any(True for _ in self.journal.iter("run_completed"))
        if not already:
            self.journal.append("run_completed", epochs=final.epoch, weights_sha256=fp,
                                state_sha256=final.manifest.get("state_sha256"),
                                checkpoint=final.path, restarts=self.restarts)
        self.say(f"run '{self.spec.name}' completed: {final.epoch} epochs, "
                 f"{self.restarts} restart(s) this session; weights sha256 {fp}")
        return 0

    def _give_up(self, failure: AttemptFailed) -> int:
        reason = ("the job's code or configuration is wrong; a restart cannot fix it"
                  if failure.fatal else
                  f"restart budget of {self.spec.restarts.max} spent")
        self.journal.append("run_failed", reason=reason, last_attempt=failure.attempt,
                            exit_code=failure.exit_code, error=_summary(failure.error),
                            epoch=self._latest_epoch(), restarts=self.restarts)
        self.progress.fault(f"FAULT {failure.kind}: {failure.describe()} -> giving up")
        self.say(f"run '{self.spec.name}' FAILED at epoch {self._latest_epoch()}/"
                 f"{self.spec.epochs}: {reason}. Log: {self.rd.attempt_log(failure.attempt)}")
        return 1

    # ------------------------------------------------------------------ process control
    def _stop_worker(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue

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


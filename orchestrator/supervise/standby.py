"""The warm standby: one worker process kept ready behind the training one.

A recovery after a kill was a cold start (a new process importing TensorFlow, building the
model, tracing the first step: 7.6 s on digits, 12 s on ResNet-20, measured in bench/). The
standby does that while the active worker trains, at the lowest priority, and then waits on
its stdin (train/standby.py). When the active worker fails and the policy's action is a plain
restart, the supervisor promotes it: one line on that pipe makes it the next attempt, which
restores the newest verified checkpoint through the very code a cold attempt runs. A pipe,
not a file, so that a standby cannot outlive the supervisor (its read ends) and no stale
promotion can be found by a later one.

What keeps it from doing harm, decided here: it starts only once the active worker trains
(it must not steal its start-up); a recovery that needs a fresh process (a reinstalled or
reinitialised TensorFlow, another batch size or strategy: any change to the worker's
environment) discards it; one that died or failed to warm up is journaled and the recovery is
cold. One still warming up is *adopted*: promoted all the same, it finishes its start-up at
full priority as the attempt (path ``adopted``), which is never slower than a cold start (the
same code, part of it done). It used to be discarded, and the recovery went cold: a kill 1-2 s
into an attempt then cost a cold start beside a standby's half-done warm-up. Supervisor side:
never imports TensorFlow.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import time
from typing import Callable

from orchestrator.core import heartbeat
from orchestrator.core.backends import JAX, TENSORFLOW
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.kinds import Action
from orchestrator.core.rundir import ENV_PREFIX, RunDir
from orchestrator.core.spec import JobSpec
from orchestrator.core.standbymode import StandbyMode
from orchestrator.recovery import oom
from orchestrator.recovery.failures import read_tail
from orchestrator.recovery.policy import is_preemption
from orchestrator.supervise import standby_policy
from orchestrator.supervise.procs import identity_record, spawn, watch_exit

ON = StandbyMode.ON            # the job's setting: a standby wherever the device allows one
WARM, IMPORT_ONLY = StandbyMode.WARM, StandbyMode.IMPORT_ONLY
# attempt_started's path for a standby promoted before it was ready
ADOPTED = StandbyMode.ADOPTED


def mode_for(setting: str, strategy: str, accelerator: str | None,
             backend: str = TENSORFLOW) -> tuple[str | None, str]:
    """The standby mode for the job's ``standby`` setting on this strategy (tpu|gpu|cpu), the
    accelerator the last probe saw and the run's backend, with why; None: no standby.

    ``auto``: CPU and GPU get a full warm standby (on a GPU both workers use memory growth).
    A TPU node (reached over gRPC) admits one client session that initialises it, so its standby
    only imports TensorFlow. On a TPU VM only one process may hold libtpu: TensorFlow loads it
    when it is imported, so a TensorFlow standby beside the training worker would have no TPU
    when promoted, and there is none, even when asked for. JAX loads libtpu only at its first
    device query (``jax.devices()``, the first array), so a JAX standby imports JAX and Keras
    and nothing more (train/standby.py's import-only path; tests/test_tpuvm.py proves that no
    JAX backend is initialised there), and the rest of its start-up is the compile cache's."""
    on_tpu_vm = strategy == "tpu" and accelerator != "tpu_node"
    if setting == StandbyMode.OFF:
        return None, "standby: off"
    if on_tpu_vm and backend != JAX:
        return None, f"{setting} on a TPU VM with TensorFlow: importing it takes libtpu, " \
                     f"which admits one process"
    if setting == IMPORT_ONLY:
        return IMPORT_ONLY, "standby: import_only"
    if strategy == "tpu":
        if accelerator == "tpu_node":
            return IMPORT_ONLY, "auto on a TPU node: TensorFlow imported only"
        return IMPORT_ONLY, "auto on a TPU VM with JAX: JAX and Keras imported only (libtpu " \
                            "is loaded at the first device query, by the promoted worker)"
    return WARM, f"auto on {strategy}"


def _overrides(env: dict) -> dict:
    """What a recovery action changes for the next worker: its ORCHESTRATOR_* variables."""
    return {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}


# While an attempt trains with no standby behind it, auto is asked again at a checkpoint's
# commit at most this often (its pace is known only from commits; each asking reads the journal)
RETRY_S = 15.0

# How long a discarded standby's exit is waited for after its SIGKILL (it frees its memory
# first: usually milliseconds, longer on a loaded machine)
DISCARD_WAIT_S = 10.0


class Standby:
    """One standby process, meant to become attempt ``for_attempt``."""

    def __init__(self, for_attempt: int, mode: str, cmd: list[str], env: dict, cwd: str,
                 log: str, events: queue.Queue, journal: Journal):
        self.for_attempt, self.mode, self.cmd, self.env = for_attempt, mode, cmd, env
        self.cwd, self.log, self.events, self.journal = cwd, log, events, journal
        self.proc: subprocess.Popen | None = None
        self.t0 = 0.0

    def start(self) -> "Standby":
        self.t0 = time.time()
        self.proc = proc = spawn(self.cmd, self.env, self.cwd, self.log, stdin=subprocess.PIPE)
        self.journal.append(Event.STANDBY_STARTED, for_attempt=self.for_attempt, pid=proc.pid,
                            host=os.uname().nodename, identity=identity_record(proc),
                            mode=self.mode, log=self.log)
        # the same queue and item as an attempt's: once promoted, Attempt.wait sees its exit
        watch_exit(proc, self.events, proc, f"wait-standby-{self.for_attempt}")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        """It journaled ``standby_ready``: warmed up and waiting."""
        pid = self.proc.pid if self.proc else None
        return any(e.get("pid") == pid and e.get("for_attempt") == self.for_attempt
                   for e in self.journal.iter(Event.STANDBY_READY))

    def unfit(self, action: str, env: dict) -> str | None:
        """Why this standby cannot become the next attempt (None: it can)."""
        if action != Action.RESTART:
            return f"the recovery action {action} needs a fresh process"
        if not self.alive():
            return f"it exited ({self.exit_line()})"
        changed = sorted(k for k in set(_overrides(env)) | set(_overrides(self.env))
                         if _overrides(env).get(k) != _overrides(self.env).get(k))
        if changed:
            return f"the next attempt's settings changed ({', '.join(changed)})"
        return None

    def exit_line(self) -> str:
        rc = self.proc.poll() if self.proc else None
        lines = [ln for ln in read_tail(self.log, 4096).splitlines() if ln.strip()]
        return f"exit code {rc}" + (f": {lines[-1].strip()[:200]}" if lines else "")

    def promote(self, attempt: int, log: str) -> subprocess.Popen:
        """Make it attempt ``attempt``: its log becomes the attempt's, then the promotion line.
        Raises ``OSError`` (a broken pipe) when it died just now: the caller goes cold."""
        if self.log != log:
            os.replace(self.log, log)  # its open descriptor follows the file
            self.log = log
        self.proc.stdin.write(json.dumps({"attempt": attempt}).encode() + b"\n")
        self.proc.stdin.close()
        return self.proc

    def discard(self, reason: str) -> None:
        """Kill its whole process group (nothing in it is worth saving), wait until it is gone
        (bounded), and journal why. Without the wait a run could end with its standby still
        exiting: beside two busy loops a JAX standby SIGKILLed at the run's end was still there
        (not yet a zombie) when the supervisor had exited."""
        if self.proc is None:
            return
        alive = self.alive()
        with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # journaled as it is, all the same
            self.proc.wait(timeout=DISCARD_WAIT_S)
        if self.proc.stdin and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # its reader is gone: nothing to flush
                self.proc.stdin.close()
        self.journal.append(Event.STANDBY_DISCARDED, for_attempt=self.for_attempt,
                            pid=self.proc.pid, reason=reason, was_alive=alive,
                            was_ready=self.ready(), age_s=round(time.time() - self.t0, 3))


class StandbyKeeper:
    """The supervisor's one standby slot: when to start one, whether the next attempt may be
    it, and what is journaled either way (``attempt_started``'s ``path``: the mode of the
    promoted standby, or ``cold`` with a ``cold_reason``). ``slot``: the worker slot (its
    queue gets the standby's exit, its stop keeps a standby from starting); ``recovery``: the
    next attempt's environment and what the remedies know of the device."""

    def __init__(self, spec: JobSpec, cmd: Callable | None, rd: RunDir, journal: Journal,
                 slot, recovery, cores: Callable[[], int] | None = None):
        self.spec, self.cmd, self.rd, self.journal = spec, cmd, rd, journal
        self.slot, self.recovery = slot, recovery
        self.cores = cores or (lambda: standby_policy.cores())  # looked up late: tests set it
        self._decided: tuple | None = None
        self._asked = 0.0  # monotonic time of the last decision
        self._started_for: set[int] = set()  # attempts a standby was started for
        self.current: Standby | None = None
        self._replaced: set[int] = set()  # attempts whose lost standby was replaced once

    def mode(self) -> tuple[str | None, str]:
        """The mode the next standby would have, or None, with why: what the device allows
        (``mode_for``), then for ``auto`` whether it is worth it for this run
        (standby_policy.py: the run's own kills, cold starts and warm-ups)."""
        if self.cmd is None:
            return None, "no standby with this worker command"
        if self.spec.workers > 1 or self.spec.engine != "local":
            return None, "several workers (a group) have no standby"
        setting, strategy = self.spec.standby, self.recovery.remedies.current_strategy()
        mode, why = mode_for("auto" if setting == ON else setting, strategy,
                             self.recovery.remedies.seen, self.spec.backend)
        if setting == ON and mode is not None:
            return mode, f"standby: on ({why})"
        if setting == "auto" and mode == WARM:
            evidence = standby_policy.Evidence.from_journal(self.journal.events(),
                                                           is_preemption, self.spec.epochs)
            fits, why = standby_policy.memory_allows(
                (heartbeat.read(self.rd.for_rank(0)) or {}).get("rss"), oom.headroom(),
                evidence.state_bytes)
            if not fits:
                return None, f"auto: {why}"
            ok, figures = standby_policy.worth_it(strategy, self.cores(), evidence,
                                                  now=time.time())
            return (WARM if ok else None), f"auto: {figures}"
        return mode, why

    def decide(self, for_attempt: int) -> str | None:
        """The mode for ``for_attempt``'s standby, journaled when the decision changes: for
        another attempt, when its mode or reason does; asked again for the same one (at its
        commits), only when its mode does (the reasons' figures change with every asking: the
        goodput bench's long run journaled the same "none" twice in 16 s)."""
        self._asked = time.monotonic()
        mode, why = self.mode()
        last = self._decided
        if last is None or mode != last[1] or (for_attempt != last[0] and why != last[2]):
            self._decided = (for_attempt, mode, why)
            self.journal.append(Event.STANDBY_DECIDED, for_attempt=for_attempt, mode=mode,
                                reason=why)
        return mode

    def start(self, for_attempt: int) -> None:
        """Behind a worker that trains (its start-up done), when the job and strategy allow."""
        if self.current is not None or self.slot.stopped.is_set():
            return
        mode = self.decide(for_attempt)
        if mode is None:
            return
        self._started_for.add(for_attempt)
        self.current = Standby(for_attempt, mode, self.cmd(self.spec, for_attempt, mode),
                               self.recovery.attempt_env(), self.spec.job_dir,
                               self.rd.standby_log(for_attempt), self.slot.events,
                               self.journal).start()

    def retry(self, for_attempt: int) -> None:
        """A checkpoint was committed while the attempt trains: if it has no standby, ask again
        (at most every ``RETRY_S``): a long run's pace is known only from its commits."""
        if self.current is None and for_attempt not in self._started_for \
                and time.monotonic() - self._asked >= RETRY_S:
            self.start(for_attempt)

    def exited(self, proc, rc: int, for_attempt: int) -> None:
        """A process on the queue that is not the attempt's exited: if it is the standby, it
        is lost; it is replaced once per attempt (one that keeps failing is not a loop)."""
        sb = self.current
        if sb is None or proc is not sb.proc:
            return
        self.current = None
        self.journal.append(Event.STANDBY_LOST, for_attempt=sb.for_attempt, pid=proc.pid,
                            exit_code=rc, detail=sb.exit_line())
        if for_attempt not in self._replaced:
            self._replaced.add(for_attempt)
            self.start(for_attempt)

    def check(self, action: str, env: dict) -> None:
        """Before a recovery action: discard the standby if the next attempt cannot be it
        (a reinstall or a reinitialised TPU must not have it beside them)."""
        if self.current is not None:
            why = self.current.unfit(action, env)
            if why:
                self.discard(why)

    def promote(self, n: int, env: dict):
        """(the standby's process, how attempt ``n`` started) or (None, why it starts cold)."""
        sb, self.current = self.current, None
        if sb is None:
            mode, why = self.mode()
            return None, {"path": "cold", "cold_reason": why if mode is None else (
                "no standby was up" if n > 1 else "the first attempt")}
        reason = sb.unfit(Action.RESTART, env)
        if reason is None:
            # one still warming up is adopted (train/standby.py's Promotion): it gets its
            # priority back and finishes its start-up as the attempt, from where it is
            ready = sb.ready()
            try:
                proc = sb.promote(n, self.rd.attempt_log(n))
            except OSError as exc:  # it died between the check and the line
                reason = f"its pipe failed ({exc})"
            else:
                age = round(time.time() - sb.t0, 3)
                self.journal.append(Event.STANDBY_PROMOTED, attempt=n, pid=proc.pid,
                                    mode=sb.mode, adopted=not ready, age_s=age)
                return proc, {"path": sb.mode if ready else ADOPTED, "standby_age_s": age}
        sb.discard(reason)
        return None, {"path": "cold", "cold_reason": f"the standby was unfit: {reason}"}

    def discard(self, reason: str) -> None:
        sb, self.current = self.current, None
        if sb is not None:
            sb.discard(reason)

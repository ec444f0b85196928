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
import enum
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
from orchestrator.supervise.group import Engine, LocalEngine, Member

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


class StandbyState(str, enum.Enum):
    """The life of one standby process (as TorchElastic's ``WorkerState``); each line: the
    state, then what moves it on.

    STARTED: spawned, warming up at the lowest priority -> READY, ADOPTED, DISCARDED, LOST.
    READY: it journaled ``standby_ready``, waiting on its stdin -> PROMOTED, DISCARDED, LOST.
    PROMOTED: the promotion line reached it ready; it is the attempt now (final).
    ADOPTED: the line reached it still warming up; it finishes as the attempt (final).
    DISCARDED: killed unused: unfit for the recovery, or the run ended (final).
    LOST: it exited on its own before any promotion (final).
    """

    STARTED = "started"
    READY = "ready"
    PROMOTED = "promoted"
    ADOPTED = "adopted"
    DISCARDED = "discarded"
    LOST = "lost"

    @property
    def live(self) -> bool:
        """Its process is the keeper's still (may yet be promoted or discarded)."""
        return self in (StandbyState.STARTED, StandbyState.READY)


TRANSITIONS = {
    StandbyState.STARTED: {StandbyState.READY, StandbyState.ADOPTED, StandbyState.DISCARDED,
                           StandbyState.LOST},
    StandbyState.READY: {StandbyState.PROMOTED, StandbyState.DISCARDED, StandbyState.LOST},
}


class Standby:
    """One standby process, meant to become attempt ``for_attempt``; ``state`` says where it
    is in its life (``StandbyState``), and every move is checked against ``TRANSITIONS``."""

    def __init__(self, for_attempt: int, mode: str, cmd: list[str], env: dict, cwd: str,
                 log: str, events: queue.Queue, journal: Journal, engine: Engine | None = None):
        self.for_attempt, self.mode, self.cmd, self.env = for_attempt, mode, cmd, env
        self.cwd, self.log, self.events, self.journal = cwd, log, events, journal
        self.engine = engine or LocalEngine()
        self.member = Member(0, os.uname().nodename, log, "", pipe=True)
        self.state: StandbyState | None = None
        self.t0 = 0.0

    @property
    def proc(self):
        """Its process (a Popen where the local engine spawned it), once started."""
        return self.member.handle

    def move(self, state: StandbyState) -> None:
        """To ``state``, if ``TRANSITIONS`` allows it from where it is (ValueError if not)."""
        if self.state is not None and state not in TRANSITIONS.get(self.state, ()):
            raise ValueError(f"standby for attempt {self.for_attempt}: {self.state.value} "
                             f"cannot become {state.value}")
        self.state = state

    def start(self) -> "Standby":
        self.t0 = time.time()
        # the same queue and item as an attempt's: once promoted, Attempt.wait sees its exit
        self.engine.spawn(self.member, self.cmd, self.env, self.cwd, self.events)
        self.move(StandbyState.STARTED)
        self.journal.append(Event.STANDBY_STARTED, for_attempt=self.for_attempt,
                            pid=self.member.pid, host=self.member.host,
                            identity=self.member.identity, mode=self.mode, log=self.log)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        """Warmed up and waiting: READY once it journaled ``standby_ready`` (the one journal
        scan of its life: the worker says so in its own journal, not on the queue)."""
        if self.state is StandbyState.STARTED and any(
                e.get("pid") == self.member.pid and e.get("for_attempt") == self.for_attempt
                for e in self.journal.iter(Event.STANDBY_READY)):
            self.move(StandbyState.READY)
        return self.state is StandbyState.READY

    def lost(self) -> None:
        """It exited on its own before a promotion."""
        self.move(StandbyState.LOST)

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

    def promote(self, attempt: int, log: str) -> Member:
        """Make it attempt ``attempt``: its log becomes the attempt's, then the promotion line
        (PROMOTED when it was ready, else ADOPTED). Raises ``OSError`` (a broken pipe) when it
        died just now: the caller goes cold."""
        ready = self.ready()
        if self.log != log:
            os.replace(self.log, log)  # its open descriptor follows the file
            self.log = self.member.log = log
        self.proc.stdin.write(json.dumps({"attempt": attempt}).encode() + b"\n")
        self.proc.stdin.close()
        self.move(StandbyState.PROMOTED if ready else StandbyState.ADOPTED)
        return self.member

    def discard(self, reason: str) -> None:
        """Kill its whole process group (nothing in it is worth saving), wait until it is gone
        (bounded), and journal why. Without the wait a run could end with its standby still
        exiting: beside two busy loops a JAX standby SIGKILLed at the run's end was still there
        (not yet a zombie) when the supervisor had exited."""
        if self.proc is None:
            return
        alive, ready = self.alive(), self.ready()
        self.engine.signal(self.member, signal.SIGKILL)  # the whole group gone already: fine
        with contextlib.suppress(subprocess.TimeoutExpired):  # journaled as it is, all the same
            self.proc.wait(timeout=DISCARD_WAIT_S)
        if self.proc.stdin and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # its reader is gone: nothing to flush
                self.proc.stdin.close()
        if self.state is not None and self.state.live:
            self.move(StandbyState.DISCARDED)
        self.journal.append(Event.STANDBY_DISCARDED, for_attempt=self.for_attempt,
                            pid=self.proc.pid, reason=reason, was_alive=alive,
                            was_ready=ready, age_s=round(time.time() - self.t0, 3))


class StandbyKeeper:
    """The supervisor's one standby slot: when to start one, whether the next attempt may be
    it, and what is journaled either way (``attempt_started``'s ``path``: the mode of the
    promoted standby, or ``cold`` with a ``cold_reason``). ``slot``: the worker slot (its
    queue gets the standby's exit, its stop keeps a standby from starting); ``recovery``: the
    next attempt's environment and what the remedies know of the device."""

    def __init__(self, spec: JobSpec, cmd: Callable | None, rd: RunDir, journal: Journal,
                 slot, recovery, cores: Callable[[], int] | None = None,
                 engine: Engine | None = None):
        self.spec, self.cmd, self.rd, self.journal = spec, cmd, rd, journal
        self.slot, self.recovery = slot, recovery
        self.engine = engine or LocalEngine()  # who spawns it: the attempt's engine
        self.cores = cores or (lambda: standby_policy.cores())  # looked up late: tests set it
        self._decided: tuple | None = None
        self._asked = 0.0  # monotonic time of the last decision
        self.standbys: list[Standby] = []  # every one started this session, in order

    @property
    def current(self) -> Standby | None:
        """The standby still ours (started or ready), if any."""
        sb = self.standbys[-1] if self.standbys else None
        return sb if sb is not None and sb.state is not None and sb.state.live else None

    def started_for(self, for_attempt: int) -> int:
        """How many standbys were started for ``for_attempt`` (a lost one is replaced once)."""
        return sum(1 for sb in self.standbys if sb.for_attempt == for_attempt)

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

    # ------------------------------------------------------------------ the attempt's listener
    def on_training(self, n: int) -> None:
        """Attempt ``n`` trains (its start-up is over): a standby for ``n + 1`` may start."""
        self.start(n + 1)

    def on_commit(self, n: int) -> None:
        """A checkpoint was committed while attempt ``n`` trains: if none was started for
        ``n + 1``, ask again (at most every ``RETRY_S``): a long run's pace is known only from
        its commits."""
        if self.current is None and not self.started_for(n + 1) \
                and time.monotonic() - self._asked >= RETRY_S:
            self.start(n + 1)

    def on_exit(self, key, rc: int, n: int) -> None:
        """A process on the queue that is not attempt ``n``'s exited: if it is the standby, it
        is LOST; it is replaced once per attempt (one that keeps failing is not a loop)."""
        sb = self.current
        if sb is None or key is not sb.member:
            return
        sb.lost()
        self.journal.append(Event.STANDBY_LOST, for_attempt=sb.for_attempt, pid=sb.member.pid,
                            exit_code=rc, detail=sb.exit_line())
        if self.started_for(n + 1) < 2:
            self.start(n + 1)

    def start(self, for_attempt: int) -> None:
        """Behind a worker that trains (its start-up done), when the job and strategy allow."""
        if self.current is not None or self.slot.stopped.is_set():
            return
        mode = self.decide(for_attempt)
        if mode is None:
            return
        sb = Standby(for_attempt, mode, self.cmd(self.spec, for_attempt, mode),
                     self.recovery.attempt_env(), self.spec.job_dir,
                     self.rd.standby_log(for_attempt), self.slot.events, self.journal,
                     self.engine)
        self.standbys.append(sb)
        sb.start()

    def check(self, action: str, env: dict) -> None:
        """Before a recovery action: discard the standby if the next attempt cannot be it
        (a reinstall or a reinitialised TPU must not have it beside them)."""
        if self.current is not None:
            why = self.current.unfit(action, env)
            if why:
                self.discard(why)

    def promote(self, n: int, env: dict):
        """(the standby's member, how attempt ``n`` started) or (None, why it starts cold)."""
        sb = self.current
        if sb is None:
            mode, why = self.mode()
            return None, {"path": "cold", "cold_reason": why if mode is None else (
                "no standby was up" if n > 1 else "the first attempt")}
        reason = sb.unfit(Action.RESTART, env)
        if reason is None:
            # one still warming up is adopted (train/standby.py's Promotion): it gets its
            # priority back and finishes its start-up as the attempt, from where it is
            try:
                member = sb.promote(n, self.rd.attempt_log(n))
            except OSError as exc:  # it died between the check and the line
                reason = f"its pipe failed ({exc})"
            else:
                age = round(time.time() - sb.t0, 3)
                adopted = sb.state is StandbyState.ADOPTED
                self.journal.append(Event.STANDBY_PROMOTED, attempt=n, pid=member.pid,
                                    mode=sb.mode, adopted=adopted, age_s=age)
                return member, {"path": ADOPTED if adopted else sb.mode, "standby_age_s": age}
        sb.discard(reason)
        return None, {"path": "cold", "cold_reason": f"the standby was unfit: {reason}"}

    def discard(self, reason: str) -> None:
        sb = self.current
        if sb is not None:
            sb.discard(reason)

"""An engine (supervise/group.Engine) with no process: what its workers do is a script, played
onto the slot's queue under a FakeClock, so that the supervisor's loop runs in this thread in
milliseconds.

A worker "runs" when it is spawned (a group: when its last rank is): for each epoch from the
newest verified checkpoint on, every rank beats (``Beat`` with its record) and rank 0 commits
a real checkpoint through the run's store (``Committed``); then every rank exits 0
(``Exited``). The plan says otherwise, per attempt number as fake_worker.py's does:
  "exit": {"1": 1}                    attempt 1 exits 1 at its start, with an error record
  "error": {"1": {"type": ..}}        attempt 1 records this error and exits 1
  "startup_s": {"2": 5.0}             attempt 2's start-up takes 5 s on the clock
  "exit_at_epoch": {"2": [3, -9]}     attempt 2 exits -9 when epoch 3 would begin
                   {"2": [3, -9, 1]}  only its rank 1 (the others run on until stopped)
  "standby_exit": {"3": 1}            the standby for attempt 3 exits 1 while warming up
  "standby_cold": true                a standby never reports ready (it is adopted)
  "mid_epoch": true                   also commit in the middle of each epoch (batch 5)
  "stop_early": {"1": 2}              attempt 1 ends training after epoch 2 (EarlyStopping)
A standby (its member has ``pipe``) journals ``standby_ready`` at once, unless told not to;
the promotion line on its stdin plays the attempt it names. A stop (``kill``, a ``SIGKILL``)
puts the member's exit on the queue, as the thread that waits on a real process does.
"""
import json
import os
import queue
import signal

from orchestrator.checkpoint import tiers
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import write_json_atomic
from orchestrator.core.rundir import RunDir
from orchestrator.supervise.messages import Beat, Committed, Exited

STEPS = 10  # steps per epoch: a checkpoint's step is 10 x its epoch, as fake_worker.py's


class FakeProcess:
    """What the standby keeper reads of a standby's process: its pid, whether it runs, its
    stdin (the promotion line)."""

    def __init__(self, engine: "FakeEngine", m, pid: int):
        self.engine, self.member, self.pid = engine, m, pid
        self.returncode: int | None = None
        self.stdin = _Stdin(self)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


class _Stdin:
    def __init__(self, proc: FakeProcess):
        self.proc, self.lines, self.closed = proc, [], False

    def write(self, data: bytes) -> None:
        if self.proc.returncode is not None:
            raise BrokenPipeError("the standby exited")
        self.lines.append(data)

    def close(self) -> None:
        if not self.closed and self.lines:
            self.closed = True
            order = json.loads(self.lines[-1])
            self.proc.engine.play(order["attempt"], [self.proc.member])
        self.closed = True


class ScriptedQueue(queue.Queue):
    """The slot's queue over a fake engine: what was put on it comes first (a stop's exit, a
    standby's); when it is empty, the running workers' scripts say what happens next. Nothing
    waits: a wait with nothing left to happen is a test's mistake, said at once."""

    def __init__(self, engine: "FakeEngine"):
        super().__init__()
        self.engine = engine

    def get(self, block=True, timeout=None):
        while self.empty():
            if not self.engine.step(self):
                raise AssertionError("the supervisor waits and no fake worker runs")
        return super().get(block=False)


class FakeEngine:
    name = "fake"

    def __init__(self, spec, clock, plan: dict | None = None, epoch_s: float = 1.0):
        self.spec, self.clock, self.plan, self.epoch_s = spec, clock, plan or {}, epoch_s
        self.rd = RunDir.for_spec(spec)
        self.store = tiers.for_spec(spec)
        self.journal = Journal(self.rd.journal)
        self.events = None
        self.pending: list = []   # the ranks of a group spawned so far
        self.spawned: list = []   # (attempt, rank) of every worker it started, in order
        self.killed: list = []    # (attempt or "standby", rank, signal) of every stop
        self.opened: list[int] = []
        self.envs: list[dict] = []  # the environment of each worker in ``spawned``
        self.closed = 0
        self._pids = iter(range(100_000, 200_000))  # never signalled: nothing here is a pid
        self.scripts: list = []   # what the running workers will do, drawn in turn

    # ------------------------------------------------------------------ the Engine protocol
    @staticmethod
    def placement_timeout():
        return None

    def open(self, size: int) -> list[tuple[str, str]]:
        self.opened.append(size)
        return [(f"host-{r}", f"127.0.0.1:{20000 + r}") for r in range(size)]

    def spawn(self, m, cmd, env, cwd, events) -> None:
        self.events = events
        with open(m.log, "ab"):  # as a process's output would be (a standby's log is moved)
            pass
        m.pid = next(self._pids)
        m.handle = FakeProcess(self, m, m.pid)
        attempt = int(cmd[cmd.index("--attempt") + 1])
        m.attempt = attempt
        if m.pipe:  # a standby, for ``attempt``
            self._stand_by(m, attempt)
            return
        self.spawned.append((attempt, m.rank))
        self.envs.append(env)
        size = len(json.loads(env["TF_CONFIG"])["cluster"]["worker"]) \
            if "TF_CONFIG" in env else 1
        self.pending.append(m)
        if len(self.pending) == size:
            group, self.pending = self.pending, []
            self.play(attempt, group)

    def signal(self, m, sig: int) -> None:
        if sig == signal.SIGKILL:
            self._exit(m, -signal.SIGKILL, why="killed")

    def kill(self, m, grace: float) -> None:
        self._exit(m, -signal.SIGTERM, why="stopped")

    @staticmethod
    def gather(timeout: float) -> None:
        return None

    def close(self) -> None:
        self.closed += 1

    # ------------------------------------------------------------------ the script
    def play(self, n: int, ranks: list) -> None:
        """Attempt ``n`` over ``ranks`` runs: its script is drawn from as the loop waits."""
        for m in ranks:
            m.attempt = n
        self.scripts.append(self._script(n, ranks))

    def step(self, events) -> bool:
        """The next thing a running worker does, put on ``events``; False: none runs."""
        while self.scripts:
            item = next(self.scripts[0], None)
            if item is None:
                self.scripts.pop(0)
                continue
            events.put(item)
            return True
        return False

    def _script(self, n: int, ranks: list):
        """What attempt ``n``'s ranks do, in order, while they live (a stop ends a rank's)."""
        key = str(n)
        self.clock.advance(self.plan.get("startup_s", {}).get(key, 0.0))
        if key in self.plan.get("exit", {}) or key in self.plan.get("error", {}):
            error = self.plan.get("error", {}).get(key) or {
                "type": "RuntimeError", "message": f"planned exit {self.plan['exit'][key]}"}
            write_json_atomic(ranks[0].error_record or self.rd.error_record(n),
                              dict({"attempt": n, "epoch": 0, "batch": 0}, **error))
            for m in ranks:
                yield from self._exited(m, self.plan.get("exit", {}).get(key, 1))
            return
        latest = self.store.latest_valid()
        start, history = (latest.epoch, list(latest.manifest.get("history", []))) \
            if latest else (0, [])
        stop = self.plan.get("exit_at_epoch", {}).get(key)
        for epoch in range(start + 1, self.spec.epochs + 1):
            if stop and epoch == stop[0]:
                for m in ranks:
                    if len(stop) < 3 or m.rank == stop[2]:
                        yield from self._exited(m, stop[1])
                return
            self.clock.advance(self.epoch_s)
            for m in self._live(ranks):
                yield Beat(m.rank, {"attempt": n, "phase": "training", "epoch": epoch - 1,
                                    "batch": 1, "time": self.clock.time()})
            if not self._live(ranks[:1]):
                return
            if self.plan.get("mid_epoch"):
                yield self._commit(n, epoch * STEPS - 5, {"epoch": epoch - 1, "batch": 5,
                                                          "history": list(history)})
            history.append({"epoch": epoch, "loss": 1.0 / epoch})
            early = self.plan.get("stop_early", {}).get(key) == epoch
            yield self._commit(n, epoch * STEPS, {"epoch": epoch, "history": list(history),
                                                  "stopped_early": early,
                                                  "weights_sha256": f"fake-{epoch}"})
            if early:
                break
        for m in ranks:
            yield from self._exited(m, 0)

    @staticmethod
    def _live(ranks: list) -> list:
        return [m for m in ranks if m.handle.returncode is None]

    def _exited(self, m, code: int):
        if m.handle.returncode is None:
            m.handle.returncode = code
            yield Exited(m, code, self.clock.time())

    def _commit(self, n: int, step: int, manifest: dict) -> Committed:
        """Rank 0 commits ``step`` through the run's store, as fake_worker.py does."""
        def payload(d):
            with open(os.path.join(d, "state.npz"), "wb") as f:
                f.write(f"weights at step {step}".encode())

        c = self.store.commit(step, payload, dict(manifest, attempt=n),
                              keep=self.spec.checkpoint.keep)
        return Committed(c.path)

    def _stand_by(self, m, for_attempt: int) -> None:
        code = self.plan.get("standby_exit", {}).get(str(for_attempt))
        if code is not None:
            self._exit(m, code)
        elif not self.plan.get("standby_cold"):
            self.journal.append(Event.STANDBY_READY, source="worker", for_attempt=for_attempt,
                                pid=m.pid, mode="warm")

    def _exit(self, m, code: int, why: str | None = None) -> None:
        """``m`` exits with ``code`` (once): its exit on the queue, at the fake clock's time."""
        if m.handle.returncode is not None:
            return
        if why is not None:
            self.killed.append(("standby" if m.pipe and m.handle.stdin.lines == [] else
                                getattr(m, "attempt", None), m.rank, code))
        m.handle.returncode = code
        self.events.put(Exited(m, code, self.clock.time()))

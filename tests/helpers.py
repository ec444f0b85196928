"""What the tests share that is not a fixture: the fake worker's command and environment, the
real supervisor run in this process or in its own, the live control folder, a polling wait.

A module of its own, not ``conftest``: pytest imports conftest by its own rules (and a
subprocess that must find ``fake_worker_cmd`` by import has to name a plain module); the
fixtures stay in conftest.
"""
import logging
import os
import subprocess
import sys
from collections.abc import Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_WORKER = os.path.join(ROOT, "tests", "fakes", "fake_worker.py")

# The Keras backends a guarantee is proven on: an end-to-end test marked ``@BOTH_BACKENDS``
# runs once per backend, its job saying ``backend: <backend>`` (the ``backend`` fixture).
BACKENDS = ("tensorflow", "jax")
BOTH_BACKENDS = pytest.mark.parametrize("backend", BACKENDS)
# A guarantee whose code path does not pass through the backend (the supervisor, the background
# writer's thread, the run directory's mirrors) is proven once, on JAX (Colab's TPU runtimes
# and the cheaper start here): both backends doubled its cost for no path of its own.
ONE_BACKEND = pytest.mark.parametrize("backend", ("jax",))
# The soak tier (``ORCHESTRATOR_SOAK=1 scripts/test -m soak``): a guarantee the default suite
# already proves on the path the test takes, proven again on the other backend, on another
# object store or on a larger topology. The suite must stay under 10 minutes on 2 cores, and
# each of these costs minutes of framework starts; they run before a release and after a change
# to the path they cover.
SOAK = pytest.mark.soak
# Both backends, TensorFlow's run in the soak tier: the path is the backend's only through Keras.
JAX_THEN_TF_IN_SOAK = pytest.mark.parametrize(
    "backend", ("jax", pytest.param("tensorflow", marks=SOAK)))


# A run whose test is not about the export leaves the SavedModel out: on JAX it imports
# TensorFlow at the end of every run (2.7 of a digits worker's 7.7 s on this machine, and half
# its peak memory), on TensorFlow it traces the model once more. The export's own tests, and the
# reference runs whose export they read, keep it. A group's run, which a separate exporter
# process would export (a framework start of its own), exports nothing.
NO_SAVED_MODEL = "export: {saved_model: false}\n"
NO_EXPORT = "export: false\n"


def once_per_session(tmp_path_factory, name: str, make):
    """``make(folder)``'s JSON result, computed once for the whole test session even when
    pytest-xdist runs it in several processes (the first to ask computes it under a file lock;
    the others wait for it, then read it). For the reference runs several tests compare with:
    each costs a framework start and a whole training, on a suite bound by its 2 cores."""
    import fcntl
    import json

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-USER/pytest-N, shared by the session's workers
    result = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            where = root / name
            where.mkdir()
            result.write_text(json.dumps(make(where)))
    return json.loads(result.read_text())


def fake_worker_cmd(spec, attempt):
    return [sys.executable, FAKE_WORKER, spec.job_path, "--run-dir", spec.run_dir,
            "--attempt", str(attempt)]


def fake_standby_cmd(spec, attempt, mode):
    return fake_worker_cmd(spec, attempt) + ["--standby", mode]


def fake_commands(standby: bool = False):
    """What the supervisor starts in the tests (supervise/compose.Commands): the fake worker,
    with ``standby`` the fake standby (else none), and no exporter."""
    from orchestrator.supervise.compose import Commands

    return Commands(fake_worker_cmd, fake_standby_cmd if standby else None, None)


def fake_env(plan: dict) -> dict:
    import json

    env = dict(os.environ, FAKE_PLAN=json.dumps(plan))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def supervise(job, plan, out=None, standby=False):
    """Run the real supervisor with the fake worker; return (rc, its output, journal events).
    ``standby``: with the fake standby (else none, as with any custom worker command)."""
    import io

    from orchestrator.core.journal import Journal
    from orchestrator.core.specload import load
    from orchestrator.supervise.supervisor import Supervisor

    out = out if out is not None else io.StringIO()
    sup = Supervisor(load(job), commands=fake_commands(standby), out=out, env=fake_env(plan))
    rc = sup.run()
    return rc, out.getvalue(), Journal(sup.rd.journal).events()


def supervisor_process(job, plan):
    """The real supervisor with the fake worker, in its own process (to signal or kill it)."""
    code = ("import sys; sys.path.insert(0, %r); sys.path.insert(0, %r)\n"
            "from helpers import fake_commands\n"
            "from orchestrator.core.specload import load\n"
            "from orchestrator.supervise.supervisor import Supervisor\n"
            "sys.exit(Supervisor(load(%r), commands=fake_commands()).run())\n"
            % (os.path.join(ROOT, "tests"), ROOT, job))
    return subprocess.Popen([sys.executable, "-c", code], env=fake_env(plan),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def live(job, run_dir) -> "RunDir":
    """Where a running job's journal and heartbeat are written first (its local control folder,
    mirrored to the run directory every 0.5 s): tests that act at a precise moment read here."""
    from orchestrator.core.rundir import RunDir
    from orchestrator.core.specload import load

    return RunDir.for_spec(load(str(job), run_dir=str(run_dir)))


def start_run(job, run_dir, faults=(), env=None):
    """``orchestrator run JOB --run-dir RUN_DIR`` with ``--fault`` plans, its output piped."""
    args = [a for f in faults for a in ("--fault", f)]
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(job),
                             "--run-dir", str(run_dir), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished_run(proc, run_dir, timeout=400) -> list[dict]:
    """The journal of a run started by ``start_run`` once it has exited 0."""
    from orchestrator.core.journal import Journal

    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return Journal(str(run_dir / "events.jsonl")).events()


def only_event(events, name) -> dict:
    """The one event called ``name`` (a second one, or none, fails the test)."""
    found = [e for e in events if e["event"] == name]
    assert len(found) == 1, (name, found)
    return found[0]


def wait_until(cond, timeout=120, what="condition"):
    """Poll ``cond`` until it gives something true (returned); an AssertionError naming
    ``what`` after ``timeout`` s. For tests that act when a run reaches a moment."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{what} not met within {timeout} s")


class TwoNodeEngine:
    """A group's engine without Ray or processes: rank r "runs" on node 127.0.0.(r + 2), and
    ``started(m)`` (a subclass's) puts what its ranks do on the attempt's queue; a stop is
    only counted (``killed``)."""

    name = "ray"

    def __init__(self):
        self.events, self.members, self.killed = None, [], []

    @staticmethod
    def placement_timeout():
        return 120.0

    def open(self, size):
        return [(f"host-{r}", f"127.0.0.{r + 2}:1234") for r in range(size)]

    def spawn(self, m, cmd, env, cwd, events):
        m.pid, m.node, self.events = 100 + m.rank, f"127.0.0.{m.rank + 2}", events
        self.members.append(m)
        self.started(m)

    def started(self, m):
        pass

    def kill(self, m, grace):
        self.killed.append(m.rank)

    def signal(self, m, sig):
        pass


def group_attempt(rd, engine, n: int = 3):
    """Attempt ``n`` of a 2-worker group placed by ``engine``, over the run directory ``rd``,
    with the rest of the supervisor faked (a hang clock that never runs out, no standby):
    ``(attempt, journal)``, the attempt started."""
    import queue
    from types import SimpleNamespace

    from orchestrator.core.journal import Journal
    from orchestrator.supervise.attempt import Attempt

    journal = Journal(rd.journal)
    hang = SimpleNamespace(start=lambda n, size: None, remaining=lambda: 60.0, stepped=False,
                           run_dir=rd.control, beat=lambda rank, record=None: None)
    slot = SimpleNamespace(events=queue.Queue(), hang=hang, clock=FakeClock())
    standby = SimpleNamespace(promote=lambda n, env: (None, None), on_exit=lambda *a: None,
                              on_training=lambda n: None, on_commit=lambda n: None)
    spec = SimpleNamespace(job_dir=os.path.dirname(rd.root), stop_grace=0.0, workers=2)
    attempt = Attempt(n, ["worker"], {}, spec=spec, rd=rd, slot=slot, journal=journal,
                      standby=standby, engine=engine, group=True)
    attempt.start(from_epoch=lambda: 1)
    return attempt, journal


class FakeClock:
    """A clock (core/clock.Clock's four methods) that moves only when told to: ``sleep`` and
    ``wait`` move it at once, so a 5 s lease or a minute of backoff takes no real time. For
    code driven from the test's own thread (a background thread waiting on it would spin)."""

    def __init__(self, start: float = 1_000_000.0):
        self.now = start
        self.slept: list[float] = []  # every sleep and wait, in order

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def wait(self, event, seconds) -> bool:
        if event.is_set():
            return True
        self.sleep(seconds or 0.0)
        return event.is_set()


def wait_while_running(proc, cond, what="condition", cap=900):
    """Poll ``cond`` until it gives something true (returned), for as long as the supervisor
    ``proc`` runs: an AssertionError with its output as soon as it exits first. No timing of
    an idle machine here: every wait of a supervisor before and between steps is bounded by the
    supervisor itself and journaled with its bound (Ray's connection and placement, the
    start-up and hang timeouts), so one that cannot go on exits. ``cap`` only keeps a test
    machine that stopped altogether from holding the suite forever."""
    import time

    deadline = time.time() + cap
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"{what}: the supervisor exited {proc.returncode} first:\n{out}")
        time.sleep(0.05)
    raise AssertionError(f"{what} not met in {cap} s while the supervisor ran")


class Said(Sequence):
    """The messages the ``orchestrator`` loggers logged at INFO and above during a test, in
    order (pytest's ``caplog`` underneath): what a ``say`` list collected before the modules
    logged (the ``said`` fixture)."""

    def __init__(self, caplog):
        self.caplog = caplog
        caplog.set_level(logging.INFO, logger="orchestrator")

    def _messages(self) -> list[str]:
        return [r.getMessage() for r in self.caplog.records
                if r.name.startswith("orchestrator") and r.levelno >= logging.INFO]

    def __getitem__(self, i):
        return self._messages()[i]

    def __len__(self) -> int:
        return len(self._messages())

    def __eq__(self, other) -> bool:
        return self._messages() == list(other)

    def __repr__(self) -> str:
        return repr(self._messages())


def readme_run_dir_names() -> list[str]:
    """The README's list of what a run directory holds: the backticked names of its "Run
    directory:" paragraph up to "Nothing else", and the export's files its Export item names
    (``export/...``). ``<n>``, ``<r>``: numbers; a name ending in / is a folder."""
    import re

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    start = text.index("Run directory: ")
    listed = text[start:text.index("Nothing else", start)]
    export_item = text[text.index("- **Export.**"):]
    export_item = export_item[:export_item.index("\n\n")]
    return (re.findall(r"`([^`\s]+)`", listed)
            + [n for n in re.findall(r"`([^`\s]+)`", export_item) if n.startswith("export/")])


def unlisted_in_run_dir(run_dir, names: Sequence[str] | None = None) -> list[str]:
    """What ``run_dir`` holds that ``names`` (default: the README's list) does not name: a
    file or folder none of them matches, inside a listed folder whose contents are itemised
    (a listed folder that no other name extends holds anything)."""
    import re

    names = readme_run_dir_names() if names is None else names
    parts = [[re.compile(re.escape(seg).replace("<n>", r"\d+").replace("<r>", r"\d+"))
              for seg in n.rstrip("/").split("/")] + ([None] if n.endswith("/") else [])
             for n in names]
    texts = [n.rstrip("/").split("/") for n in names]

    def matches(pattern, segs):
        return len(pattern) >= len(segs) and all(
            p is not None and p.fullmatch(s) for p, s in zip(pattern, segs))

    def listed(segs, is_dir):
        for i, pattern in enumerate(parts):
            words = [p for p in pattern if p is not None]
            folder = pattern[-1] is None
            if len(words) == len(segs) and matches(words, segs) and folder == is_dir:
                return True  # named itself
            if is_dir and len(words) > len(segs) and matches(words[:len(segs)], segs):
                return True  # a folder some name goes into
            leaf = folder and not any(len(t) > len(texts[i]) and t[:len(texts[i])] == texts[i]
                                      for t in texts)
            if leaf and len(words) < len(segs) and matches(words, segs[:len(words)]):
                return True  # inside a folder whose contents are not itemised
        return False

    out = []
    for dirpath, dirs, files in os.walk(run_dir):
        rel = os.path.relpath(dirpath, run_dir)
        base = [] if rel == "." else rel.split(os.sep)
        stray = [d for d in dirs if not listed(base + [d], True)]
        out += [f"{'/'.join(base + [d])}/" for d in stray]
        dirs[:] = [d for d in dirs if d not in stray]  # a stray folder is named once, not walked
        out += ['/'.join(base + [f]) for f in files if not listed(base + [f], False)]
    return sorted(out)


def run_with_a_checkpoint(job: str, text: str = "state at step 30"):
    """``job``'s spec, its run directory made, and one checkpoint (step 30, epoch 3) committed
    to its tiers; with the arrays it holds."""
    from ckarrays import arrays_of, commit
    from orchestrator.checkpoint import tiers
    from orchestrator.core.rundir import RunDir
    from orchestrator.core.specload import load

    spec = load(job)
    layout = RunDir.for_spec(spec).make()
    commit(tiers.for_spec(spec), 30, text, {"epoch": 3, "batch": 0, "step": 30})
    return spec, layout, arrays_of(text)


def watch_reads(monkeypatch):
    """``attempt.read`` recorded: (``seen``, ``done``). Each read puts the thread it ran in and
    the step it found in ``seen``, then sets ``done``."""
    import threading

    from orchestrator.train import attempt

    read, seen, done = attempt.read, {}, threading.Event()

    def reading(*args, **kw):
        found = read(*args, **kw)
        seen.update(thread=threading.current_thread().name, step=found.latest.step)
        done.set()
        return found

    monkeypatch.setattr(attempt, "read", reading)
    return seen, done

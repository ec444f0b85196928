"""Fault injection inside the worker, so every recovery path can be exercised for real.

``orchestrator run JOB --fault SPEC`` (repeatable) hands these to each worker attempt
(``$ORCHESTRATOR_FAULTS``). Specs::

    kill@step=N            SIGKILL itself when the global step reaches N
    hang@step=N            stop making progress (the main thread blocks) at step N
    raise=KIND@step=N      raise the real exception class of KIND with a real catalogue message
    exit=CODE@step=N       exit with CODE at step N, no error record
    corrupt-checkpoint@epoch=N   flip bytes in the payload of epoch N's checkpoint once committed
    storage-down@step=N,for=S    from step N, the checkpoint store fails (ENOTCONN) for S s
    kill@checkpoint=N      SIGKILL in the middle of the run's Nth checkpoint commit: payload
                           written, not yet renamed into place
    delay-checkpoint@checkpoint=N,for=S   the Nth commit takes S s more (after the payload):
                           training goes on meanwhile when checkpoints are written in the
                           background; with kill@checkpoint=N, a kill during that write
    disk-full@checkpoint=N the Nth commit fails with ENOSPC after writing its payload
    kill@export=1          SIGKILL as the worker starts writing the export at the end of the
                           run (after the last checkpoint)
    slow-steps@step=N,for=S  from step N on, every step takes S s more, in every attempt: a
                           slow input pipeline or a shared accelerator. The run lasts longer
                           in wall time and computes exactly what it would have (the tests
                           stretch a run past standby warm-ups without burning the CPU)

Any of them may add ``,rank=R`` (``hang@step=70,rank=0``): in a group of several workers only
rank R fires it (the others do not count it); without it, the first rank to reach it fires it.

Each fault fires once per run, not once per attempt: before firing, it is claimed durably in
``<run>/faults/`` (O_EXCL) and journaled as ``fault_injected`` (with the ``rank``). One worker
claims in its control folder, which the supervisor mirrors there; the ranks of a group claim in
the run directory itself, the one folder every rank on every node sees (a node's control folder
is its own: a claim there would let the fault fire again on a rank placed on another node). ``slow-steps`` is the one
condition rather than an event: it is journaled once, at its first step, and holds from then
on. Parsing never imports TensorFlow; only ``raise=`` for a TensorFlow kind imports it, in the
worker.
"""
from __future__ import annotations

import errno
import importlib
import json
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

from orchestrator.recovery import failures
from orchestrator.checkpoint.blobs import blob_key
from orchestrator.checkpoint.store import COMMIT_MARKER
from orchestrator.checkpoint.tiers import DURABLE_MARKER
from orchestrator.core.osutil import read_json, write_json_atomic
from orchestrator.core.events import Event
from orchestrator.core.rundir import ENV_FAULTS, FAULTS_DIR

log = logging.getLogger(__name__)

ENV = ENV_FAULTS
_SPEC = re.compile(r"^(?P<what>kill|hang|raise|exit|corrupt-checkpoint|storage-down|"
                   r"delay-checkpoint|disk-full|slow-steps)"
                   r"(?:=(?P<arg>[\w-]+))?@(?P<at>step|epoch|checkpoint|export)=(?P<n>\d+)"
                   r"(?P<options>(?:,[^,=]*=[^,]*)*)$")
_OPTIONS = ("for", "rank")  # after the moment: ,for=SECONDS ,rank=R (in any order)
_ALLOWED_AT = {"kill": ("step", "checkpoint", "export"), "hang": ("step",), "raise": ("step",),
               "exit": ("step",), "corrupt-checkpoint": ("epoch",), "storage-down": ("step",),
               "delay-checkpoint": ("checkpoint",), "disk-full": ("checkpoint",),
               "slow-steps": ("step",)}
_TIMED = ("storage-down", "delay-checkpoint", "slow-steps")  # the faults that take ',for=SECONDS'


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class FaultSpec:
    text: str
    what: str
    arg: str | None
    at: str
    n: int
    duration: float | None = None
    rank: int | None = None  # only this rank of a group fires it (None: whichever is first)

    def fires_on(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    @property
    def id(self) -> str:
        return re.sub(r"[^\w.-]+", "_", self.text)


def parse(text: str) -> FaultSpec:
    m = _SPEC.match(text.strip())
    usage = ("expected kill@step=N, hang@step=N, raise=KIND@step=N, exit=CODE@step=N, "
             "corrupt-checkpoint@epoch=N, storage-down@step=N,for=SECONDS, kill@checkpoint=N, "
             "delay-checkpoint@checkpoint=N,for=SECONDS, disk-full@checkpoint=N, "
             "slow-steps@step=N,for=SECONDS or kill@export=1, each optionally with ,rank=R")
    if not m:
        raise FaultSpecError(f"--fault {text!r}: {usage}")
    what, arg, at = m["what"], m["arg"], m["at"]
    options = _options(text, m["options"])
    if at not in _ALLOWED_AT[what]:
        raise FaultSpecError(f"--fault {text!r}: {what} fires @{'/'.join(_ALLOWED_AT[what])}=N")
    if what == "raise":
        kinds = sorted({s.kind for s in failures.catalogue() if s.raise_})
        if arg not in kinds:
            raise FaultSpecError(f"--fault {text!r}: raise=KIND with KIND one of "
                                 f"{', '.join(kinds)} (kill@ and hang@ cover killed and hang)")
    if what == "exit" and not (arg or "").isdigit():
        raise FaultSpecError(f"--fault {text!r}: exit=CODE needs an integer exit code")
    if (what in _TIMED) != ("for" in options):
        raise FaultSpecError(f"--fault {text!r}: ',for=SECONDS' goes with "
                             f"{', '.join(_TIMED[:-1])} and {_TIMED[-1]} only "
                             f"(and they need it)")
    if what not in ("raise", "exit") and arg:
        raise FaultSpecError(f"--fault {text!r}: {what} takes no '=' argument")
    return FaultSpec(text.strip(), what, arg, at, int(m["n"]), options.get("for"),
                     options.get("rank"))


def _options(text: str, raw: str) -> dict:
    """``,for=SECONDS`` and ``,rank=R`` after the moment, each at most once."""
    out: dict = {}
    for item in filter(None, raw.split(",")):
        key, _, value = item.partition("=")
        if key not in _OPTIONS:
            raise FaultSpecError(f"--fault {text!r}: unknown option {item!r} after the moment; "
                                 f"expected ,for=SECONDS or ,rank=R")
        if key in out:
            raise FaultSpecError(f"--fault {text!r}: ',{key}=' given twice")
        if key == "for":
            if not re.fullmatch(r"\d+(?:\.\d+)?", value):
                raise FaultSpecError(f"--fault {text!r}: ',for=SECONDS' needs a number of "
                                     f"seconds, got {value!r}")
            out[key] = float(value)
        else:
            if not value.isdigit():
                raise FaultSpecError(f"--fault {text!r}: ',rank=R' needs a worker's rank "
                                     f"(0 for the chief, up to workers - 1), got {value!r}")
            out[key] = int(value)
    return out


def check_ranks(faults, workers: int) -> None:
    """A fault for a rank the run does not have would never fire: say so before it starts."""
    for f in faults:
        f = parse(f) if isinstance(f, str) else f
        if f.rank is not None and f.rank >= workers:
            raise FaultSpecError(f"--fault {f.text!r}: ',rank={f.rank}' names no worker of "
                                 f"this run: it has {workers} worker(s), ranks 0 to "
                                 f"{workers - 1}")


def build_exception(kind: str) -> BaseException:
    """The real exception of ``kind`` with its real catalogue message (imports its module)."""
    sig = failures.injectable(kind)
    if sig is None:
        raise FaultSpecError(f"no catalogue signature of kind {kind} says what to raise")
    module, *attrs = sig.raise_["type"].split(".")
    obj = importlib.import_module(module)
    for a in attrs:
        obj = getattr(obj, a)
    return obj(*sig.raise_.get("args", []))


class Injector:
    """Fires the run's faults at their moments; a no-op when there are none."""

    def __init__(self, faults, run_dir: str, attempt: int, journal=None, rank: int = 0):
        """``run_dir``: where the marks live (a RunDir's ``control``, or a run directory: a
        group's, which every rank sees); ``rank``: this worker's in its group (0 alone), which
        keeps the faults meant for it."""
        self.faults = [f for f in (parse(f) if isinstance(f, str) else f for f in faults)
                       if f.fires_on(rank)]
        self.dir = os.path.join(run_dir, FAULTS_DIR)
        self.attempt, self.journal, self.rank = attempt, journal, rank
        self._slowed: set[str] = set()
        self.sleep = time.sleep  # slow-steps' wait (the unit tests count it instead)

    @classmethod
    def from_env(cls, run_dir: str, attempt: int, journal=None, env=None,
                 rank: int = 0) -> "Injector":
        raw = (os.environ if env is None else env).get(ENV)
        return cls(json.loads(raw) if raw else [], run_dir, attempt, journal, rank)

    def __bool__(self) -> bool:
        return bool(self.faults)

    # ---------------------------------------------------------------- moments
    def at_step(self, step: int) -> None:
        """Call after each training step with the global step reached."""
        for f in self.faults:
            if f.what == "slow-steps":
                if step >= f.n:
                    if f.id not in self._slowed:  # journaled once a run; the slowness stays
                        self._slowed.add(f.id)
                        self._claim(f, step=step, per_step_s=f.duration)
                    self.sleep(f.duration)
            elif f.at == "step" and step >= f.n and self._claim(f, step=step):
                self._fire(f)

    def at_export(self) -> None:
        """Call as the worker starts the export at the end of the run."""
        for f in self.faults:
            if f.at == "export" and self._claim(f):
                self._fire(f)

    def after_commit(self, checkpoint) -> None:
        for f in self.faults:
            if f.what == "corrupt-checkpoint" and checkpoint.epoch == f.n \
                    and self._claim(f, path=checkpoint.path):
                corrupt_payload(checkpoint.path)

    def wrap_store(self, store):
        return _FaultyStore(store, self) if self.faults else store

    # ---------------------------------------------------------------- firing
    def _fire(self, f: FaultSpec) -> None:
        if f.what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.what == "hang":
            log.info(f"{f.text}: hanging the main thread")
            while True:  # a deadlock as far as anyone can tell; faulthandler can still dump
                threading.Event().wait(3600)
        elif f.what == "raise":
            raise build_exception(f.arg)
        elif f.what == "exit":
            os._exit(int(f.arg))
        elif f.what == "delay-checkpoint":
            time.sleep(f.duration)
        elif f.what == "disk-full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        # storage-down: the claim records until when; _FaultyStore consults it

    def _claim(self, f: FaultSpec, **extra) -> bool:
        """Record durably that ``f`` fired (exactly one claimant per run); journal it."""
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"{f.id}.json")
        record = {"fault": f.text, "attempt": self.attempt, "rank": self.rank,
                  "time": round(time.time(), 3), **extra}
        if f.duration is not None and f.what != "slow-steps":
            record["until"] = round(time.time() + f.duration, 3)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if self.journal is not None:
            self.journal.append(Event.FAULT_INJECTED, source="worker", **record)
        log.info(f"injecting {f.text} (attempt {self.attempt})")
        return True

    def storage_down_until(self) -> float:
        until = 0.0
        for f in self.faults:
            if f.what == "storage-down":
                rec = read_json(os.path.join(self.dir, f"{f.id}.json")) or {}
                until = max(until, float(rec.get("until", 0)))
        return until

    def count_commit(self) -> int:
        """The run-wide ordinal of the commit about to start (kept only when a fault needs it)."""
        path = os.path.join(self.dir, "checkpoint-commits.json")
        n = int((read_json(path) or {}).get("commits", 0)) + 1
        os.makedirs(self.dir, exist_ok=True)
        write_json_atomic(path, {"commits": n})
        return n


class _FaultyStore:
    """A CheckpointStore whose storage can go down and whose commit can be killed midway."""

    def __init__(self, store, injector: Injector):
        self._store, self._inj = store, injector
        # in firing order: a delay first, so that a kill or an error lands after it
        order = ("delay-checkpoint", "disk-full", "kill")
        self._at_commit = sorted((f for f in injector.faults if f.at == "checkpoint"),
                                 key=lambda f: order.index(f.what))

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if callable(attr):
            def guarded(*a, **kw):
                self._check_storage()
                return attr(*a, **kw)
            return guarded
        return attr

    def _check_storage(self) -> None:
        if time.time() < self._inj.storage_down_until():
            e = build_exception("storage")
            raise type(e)(*e.args, self._store.root)

    def commit(self, step, write_payload, manifest, keep=None, **arrays):
        self._check_storage()
        if self._at_commit:
            n = self._inj.count_commit()
            due = [f for f in self._at_commit if f.n == n]
            if due:
                inner = write_payload

                def write_payload(d, inner=inner):  # noqa: F811 - the wrapped writer
                    if inner is not None:
                        inner(d)
                    for f in due:  # the blobs are written, the manifest not yet
                        if self._inj._claim(f, step=step, tmp=d):
                            self._inj._fire(f)
        c = self._store.commit(step, write_payload, manifest, keep=keep, **arrays)
        self._inj.after_commit(c)
        return c


def corrupt_payload(path: str) -> str | None:
    """Flip bytes in the middle of the first blob a checkpoint names (format 1: of its first
    payload file)."""
    arrays = (read_json(os.path.join(path, "manifest.json")) or {}).get("arrays") or {}
    first = next((r["chunks"][0][0] for _k, r in sorted(arrays.items()) if r["chunks"]), None)
    names = [os.path.join(os.path.dirname(path), blob_key(first))] if first else [
        os.path.join(path, n) for n in sorted(os.listdir(path))
        if n not in ("manifest.json", COMMIT_MARKER, DURABLE_MARKER, "refs")]
    for p in names:
        size = os.path.getsize(p)
        with open(p, "r+b") as f:
            f.seek(size // 2)
            chunk = f.read(16)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk) or b"\xff")
            f.flush()
            os.fsync(f.fileno())
        return p
    return None


"""The bench's arms: one run of the orchestrator, of the plain Keras script, or of the plain
script in a shell restart loop, each watched (footprint, progress) and optionally killed.

Kills are SIGKILLs sent from here, as a preemption would: either on a fixed schedule of seconds
after launch (goodput), or each time an attempt has committed a checkpoint after its first step
(recovery: there is then always a checkpoint to restore).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field

import yaml

from orchestrator.core import heartbeat
from orchestrator.ops import timeline
from orchestrator.core.journal import JournalTail
from orchestrator.core.osutil import read_json
from orchestrator.core.rundir import RunDir
from orchestrator.core.specload import load
from orchestrator.train.compile_cache import JAX_CACHE_ENV

from . import breakdown, procs

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASELINE = os.path.join(HERE, "baseline_fit.py")
RESTART_LOOP = os.path.join(HERE, "restart_loop.sh")
RESTART_DELAY_S = 1.0  # the shell loop's sleep, and the orchestrator's backoff in bench jobs


def prepare_job(src: str, dest_dir: str, overrides: dict) -> str:
    """Copy a job (YAML + its factory modules) into ``dest_dir``, with top-level overrides."""
    os.makedirs(dest_dir, exist_ok=True)
    with open(src, encoding="utf-8") as f:
        job = yaml.safe_load(f)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict):
            job[key] = _merge(job[key], value)
        else:
            job[key] = value
    for name in os.listdir(os.path.dirname(os.path.abspath(src))):
        if name.endswith(".py"):
            shutil.copy(os.path.join(os.path.dirname(os.path.abspath(src)), name), dest_dir)
    path = os.path.join(dest_dir, "job.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# A kill's trigger (KillPlan.triggers): an anchor in the attempt's journal, optionally "+S"
# seconds after it. "checkpoint": its first checkpoint committed after its first step;
# "first_step": its first step; "standby_ready": the standby for the next attempt journaled
# ``standby_ready`` -- or, where none will be (none started once the attempt has trained for
# STANDBY_WAIT_S, or it was discarded or lost), the attempt's first checkpoint (the kill then
# says ``fallback``: under ``standby: off``, or an ``auto`` that decided none, the kill comes
# after a checkpoint as the issue asks).
ANCHORS = ("checkpoint", "first_step", "standby_ready")
STANDBY_WAIT_S = 3.0  # a standby starts at the first heartbeat after the first step


def parse_trigger(trigger: str) -> tuple[str, float]:
    """"first_step+1.5" -> ("first_step", 1.5); "checkpoint" -> ("checkpoint", 0.0)."""
    name, _, plus = trigger.partition("+")
    name = name.strip()
    if name not in ANCHORS:
        raise ValueError(f"kill trigger {trigger!r}: the anchor is one of {', '.join(ANCHORS)}")
    return name, float(plus) if plus.strip() else 0.0


def kill_anchors(events: list[dict], attempt: int, now: float) -> dict:
    """The times of the kill triggers' anchors for ``attempt`` so far (None: not yet), and
    ``fallback``: why ``standby_ready`` stands at the checkpoint (no standby will be ready)."""
    first = next((e["ts"] for e in events
                  if e["event"] == "first_step" and e.get("attempt") == attempt), None)
    ckpt = None if first is None else next(
        (e["ts"] for e in events if e["event"] == "checkpoint_committed" and e["ts"] > first),
        None)
    nxt = attempt + 1
    mine = [e for e in events if e.get("for_attempt") == nxt and e["event"] in (
        "standby_started", "standby_ready", "standby_discarded", "standby_lost")]
    ready = next((e["ts"] for e in mine if e["event"] == "standby_ready"), None)
    fallback = None
    if ready is None and ckpt is not None:
        gone = next((e for e in mine if e["event"] in ("standby_discarded", "standby_lost")),
                    None)
        if gone is not None:
            fallback = f"the standby for attempt {nxt} was {gone['event'].split('_')[1]}"
        elif not any(e["event"] == "standby_started" for e in mine) and \
                now >= first + STANDBY_WAIT_S:
            fallback = f"no standby for attempt {nxt}"
        if fallback:
            ready = ckpt
    return {"first_step": first, "checkpoint": ckpt, "standby_ready": ready,
            "fallback": fallback}


@dataclass
class KillPlan:
    offsets: tuple = ()        # kill at these seconds after launch (the goodput schedule) ...
    after_checkpoint: int = 0  # ... or this many times, each once the attempt has committed one
    after_standby: bool = False  # ... and a standby is ready behind it (its recovery is warm)
    # ... or one kill per trigger, in order, one per attempt ("checkpoint", "first_step+1.5",
    # "standby_ready": see ANCHORS), each timed from the attempt's own journal
    triggers: tuple = ()

    def __post_init__(self):
        for t in self.triggers:
            parse_trigger(t)  # a typo fails at once, not after minutes of training

    def due(self, now: float, launched: float, kills: int, checkpointed: bool,
            anchors: dict | None = None) -> bool:
        if self.offsets:
            return kills < len(self.offsets) and now >= launched + self.offsets[kills]
        if self.triggers:
            if kills >= len(self.triggers):
                return False
            name, plus = parse_trigger(self.triggers[kills])
            at = (anchors or {}).get(name)
            return at is not None and now >= at + plus
        return kills < self.after_checkpoint and checkpointed


@dataclass
class _Watch:
    plan: KillPlan | None
    launched: float | None = None
    kills: list = field(default_factory=list)
    child_fp: dict = field(default_factory=dict)  # pid -> Footprint of the training process


class OrchestratorWatch(_Watch):
    """Follows the journal and heartbeat of a run; kills its current worker per the plan."""

    def __init__(self, control_dir: str, plan: KillPlan | None):
        """``control_dir``: the run's local control folder (RunDir.control), where the journal
        and heartbeat are written first; the run directory's copies lag up to 0.5 s."""
        super().__init__(plan)
        self.run_dir = control_dir
        self.journal = JournalTail(os.path.join(control_dir, "events.jsonl"))
        self.last_beat: dict[int, float] = {}  # attempt -> time of its last heartbeat seen
        self._killed: set[int] = set()

    def __call__(self, now: float, pid: int) -> None:
        if self.launched is None:
            self.launched = now
        beat = heartbeat.read(self.run_dir)
        if beat and "attempt" in beat:
            self.last_beat[beat["attempt"]] = max(self.last_beat.get(beat["attempt"], 0),
                                                  beat.get("time", 0))
        events = self.journal.events()
        if any(e["event"] == "run_completed" for e in events):
            return  # a kill now would hit a worker that is exiting: no preemption to recover
        ended = {e["attempt"] for e in events if e["event"] == "attempt_ended"}
        live = [e for e in events if e["event"] == "attempt_started" and e["attempt"] not in ended]
        if not live:
            return
        n, wpid = live[-1]["attempt"], live[-1]["pid"]
        self.child_fp.setdefault(wpid, procs.Footprint()).sample(wpid)
        if self.plan is None or n in self._killed:
            return
        first = next((e["ts"] for e in events
                      if e["event"] == "first_step" and e.get("attempt") == n), None)
        checkpointed = first is not None and any(
            e["event"] == "checkpoint_committed" and e["ts"] > first for e in events)
        if self.plan.after_standby and not any(
                e["event"] == "standby_ready" and e.get("for_attempt") == n + 1 for e in events):
            return
        anchors = kill_anchors(events, n, now) if self.plan.triggers else {}
        if not self.plan.due(now, self.launched, len(self.kills), checkpointed, anchors):
            return
        ready = next((e for e in events if e["event"] == "worker_ready"
                      and e.get("attempt") == n), None)
        saved = max((e.get("step", 0) for e in events if e["event"] == "checkpoint_committed"),
                    default=0)
        t = procs.kill(wpid, group=True)
        if t is None:
            return
        self._killed.add(n)
        spe = ready["steps_per_epoch"] if ready else 0
        self.kills.append({"ts": t, "attempt": n, "pid": wpid, "since_launch_s": round(
            t - self.launched, 3), "reached": breakdown.heartbeat_progress(beat, n, spe) or 0,
            "saved": saved})
        if self.plan.triggers:
            trigger = self.plan.triggers[len(self.kills) - 1]
            self.kills[-1].update(trigger=trigger, fallback=anchors["fallback"] if trigger
                                  .startswith("standby_ready") else None, since_first_step_s=(
                                      round(t - anchors["first_step"], 3)
                                      if anchors.get("first_step") else None))


class LoopWatch(_Watch):
    """Follows the shell loop's Python child and its event lines; kills the child per the plan."""

    def __init__(self, events_path: str, plan: KillPlan | None):
        super().__init__(plan)
        self.events_path = events_path

    def __call__(self, now: float, pid: int) -> None:
        if self.launched is None:
            self.launched = now
        kids = [c for c in procs.children(pid) if procs.command_name(c).startswith("python")]
        if not kids:
            return
        child = kids[0]
        self.child_fp.setdefault(child, procs.Footprint()).sample(child)
        if self.plan is None or any(k["pid"] == child for k in self.kills):
            return
        if not self.plan.due(now, self.launched, len(self.kills), checkpointed=False):
            return
        lines = read_lines(self.events_path)
        spe = next((e["steps_per_epoch"] for e in lines if e["event"] == "train_begin"), 0)
        reached, saved = breakdown.baseline_progress(lines, child, spe)
        t = procs.kill(child, group=False)
        if t is not None:
            self.kills.append({"ts": t, "pid": child, "since_launch_s": round(
                t - self.launched, 3), "reached": reached, "saved": saved})


def read_lines(path: str) -> list[dict]:
    """The baseline's event lines (a line torn by a kill is skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return []
    return out


def _peak(fps: dict) -> float | None:
    vals = [fp.peak_rss_mb for fp in fps.values() if fp.peak_rss_mb is not None]
    return max(vals) if vals else None


def backend_env(backend: str, compile_cache: str | None = None, base: dict | None = None) -> dict:
    """The environment of one arm on ``backend``: Keras's choice said outright (a job on
    ``backend: auto`` and the plain script follow it, so a ``KERAS_BACKEND`` of the shell the
    bench runs in must not turn a TensorFlow arm into a JAX one), and JAX's compile cache
    folder only where the bench puts one: a ``JAX_COMPILATION_CACHE_DIR`` left in the shell
    would be shared by every JAX run, and no cold start would start empty."""
    env = dict(os.environ if base is None else base, KERAS_BACKEND=backend)
    env.pop(JAX_CACHE_ENV, None)
    if compile_cache is not None:
        env[JAX_CACHE_ENV] = compile_cache
    return env


def run_orchestrator(job: str, run_dir: str, plan: KillPlan | None = None,
                     extra_args: tuple = (), timeout: float = 300.0,
                     env: dict | None = None) -> dict:
    """``orchestrator run JOB`` to its end; the journal read into timings and a fingerprint."""
    os.makedirs(run_dir, exist_ok=True)
    watch = OrchestratorWatch(RunDir.for_spec(load(job, run_dir=run_dir)).control, plan)
    cmd = [sys.executable, "-m", "orchestrator", "run", job, "--run-dir", run_dir, *extra_args]
    fin = procs.run(cmd, os.path.join(run_dir, "..", os.path.basename(run_dir) + ".out"),
                    cwd=ROOT, env=env, timeout=timeout, on_poll=watch)
    events = watch.journal.events()
    ended = [e for e in events if e["event"] == "attempt_ended"]
    deaths = {k["attempt"]: k["ts"] for k in watch.kills}
    for e in ended:  # a hang dies at its last heartbeat; a raised error when it writes its record
        n = e["attempt"]
        if n in deaths or e.get("exit_code") == 0:
            continue
        record = read_json(os.path.join(watch.run_dir, "attempts", f"{n}.error.json"))
        hang = breakdown.hang_death(events, n)
        killed_itself = breakdown.injected_kill(events, n)
        if hang is not None:
            deaths[n] = hang
        elif killed_itself is not None:
            deaths[n] = killed_itself
        elif record and record.get("attempt") == n and record.get("time"):
            deaths[n] = record["time"]
        elif n in watch.last_beat:
            deaths[n] = watch.last_beat[n]
    useful = timeline.account(timeline.build(events))["useful_s"]
    return {
        "rc": fin.rc, "timed_out": fin.timed_out, "wall_s": fin.wall_s, "useful_s": useful,
        "train_s": useful if len(ended) == 1 else None,  # no faults: first step to last commit
        "fingerprint": breakdown.final_fingerprint(events),
        "export_s": breakdown.export_time(events),
        "startup": breakdown.orchestrator_startup(events, fin.launched),
        "supervisor": {"peak_rss_mb": fin.footprint.peak_rss_mb, "cpu_s": fin.footprint.cpu_s},
        "worker_peak_rss_mb": _peak(watch.child_fp),
        "standby_rss_mb": [round(e["rss"] / 2**20, 1) for e in events
                           if e["event"] == "standby_ready" and e.get("rss")],
        "recovery_paths": [e.get("path") for e in events if e["event"] == "attempt_started"][1:],
        "attempts": len([e for e in events if e["event"] == "attempt_started"]),
        "failures": [{"attempt": e["attempt"], "exit_code": e.get("exit_code"),
                      "signal": e.get("signal"), "error": e.get("error"),
                      "kind": e.get("kind")} for e in ended if e.get("exit_code") != 0],
        "kills": watch.kills,
        "checkpoints": breakdown.checkpoint_writes(events),
        "backend": breakdown.backend_of(events),
        "compile_cache": breakdown.compile_cache_at_start(events),
        "recoveries": [dict(breakdown.orchestrator_recovery(events, n, t), attempt=n,
                            **breakdown.recovery_labels(events, n), **_trigger_of(watch, n))
                       for n, t in sorted(deaths.items())],
        # issue 27: the policy's decisions and each standby's warm-up, from the journal
        "standby_decisions": breakdown.standby_decisions(events),
        "standbys": breakdown.standby_warmups(events),
        # the first attempt's training speed between its checkpoints (the tiers' reference)
        "steps_per_s": breakdown.training_rates(events, 1, 0.0, 0.0)["after"],
    }


def _trigger_of(watch: "OrchestratorWatch", attempt: int) -> dict:
    """What set off the bench's kill of ``attempt`` (KillPlan.triggers), where one did."""
    k = next((k for k in watch.kills if k["attempt"] == attempt and "trigger" in k), None)
    return {} if k is None else {"trigger": k["trigger"], "fallback": k["fallback"],
                                 "since_first_step_s": k["since_first_step_s"]}


def run_keras(job: str, work_dir: str, backup: bool, loop_plan: KillPlan | None = None,
              loop: bool = False, timeout: float = 300.0, max_restarts: int = 10,
              env: dict | None = None, orbax: bool = False) -> dict:
    """The plain script once (``loop=False``) or in the shell restart loop, killed per plan;
    ``orbax``: with Orbax's async CheckpointManager (JAX) instead of BackupAndRestore."""
    os.makedirs(work_dir, exist_ok=True)
    events_path = os.path.join(work_dir, "events.jsonl")
    cmd = [sys.executable, BASELINE, job, "--events", events_path]
    if backup:
        cmd += ["--backup-dir", os.path.join(work_dir, "backup")]
    if orbax:
        cmd += ["--orbax-dir", os.path.join(work_dir, "orbax")]
    if loop:
        cmd = [RESTART_LOOP, *cmd]
    env = dict(os.environ if env is None else env, RESTART_DELAY=str(RESTART_DELAY_S),
               MAX_RESTARTS=str(max_restarts), PYTHONUNBUFFERED="1")
    watch = LoopWatch(events_path, loop_plan if loop else None)
    fin = procs.run(cmd, os.path.join(work_dir, "out.log"), cwd=ROOT, env=env, timeout=timeout,
                    on_poll=watch if loop else None)
    lines = read_lines(events_path)
    peak = _peak(watch.child_fp) if loop else fin.footprint.peak_rss_mb
    useful = breakdown.baseline_useful(lines)
    return {
        "rc": fin.rc, "timed_out": fin.timed_out, "wall_s": fin.wall_s, "useful_s": useful,
        "train_s": useful if not watch.kills else None,
        "fingerprint": breakdown.baseline_fingerprint(lines),
        "backend": next((e.get("backend") for e in lines if e["event"] == "tf_imported"), None),
        "startup": breakdown.baseline_startup(lines, fin.launched),
        "peak_rss_mb": peak,
        "attempts": len({e["pid"] for e in lines}),
        "kills": watch.kills,
        "failed_alone": breakdown.baseline_failed_alone(lines, watch.kills),
        "last_error": last_error(os.path.join(work_dir, "out.log")),
        "recoveries": [dict(breakdown.baseline_recovery(lines, k["pid"], k["ts"]), pid=k["pid"])
                       for k in watch.kills],
        # each save's time on the training thread and its bytes (BackupAndRestore, Orbax)
        "saves": {"ms": [e["ms"] for e in lines if e["event"] == "checkpoint_saved"],
                  "bytes": [e["bytes"] for e in lines if e.get("bytes") is not None and
                            e["event"] in ("checkpoint_saved", "checkpoint_sized")]},
        "fit_s": breakdown.baseline_fit_time(lines),
    }


def last_error(log: str) -> str | None:
    """The last Python exception line of a log (``Type: message``), to say why a plain script
    that nobody killed failed (a BackupAndRestore file left torn by a kill, say)."""
    import re

    pattern = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): .+")
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            hits = [line.strip() for line in f if pattern.match(line)]
    except FileNotFoundError:
        return None
    return hits[-1][:300] if hits else None


def kill_schedule(seed: int, mean_s: float, count: int | None = None,
                  until_s: float | None = None) -> tuple:
    """Kill times (s after launch), gaps drawn uniformly in [0.75, 1.25] x ``mean_s``: ``count``
    of them, or as many as fall before ``until_s`` (a run's timeout: killing goes on until the
    run ends, so the number of kills follows from its length, not from a fixed count)."""
    import random

    if (count is None) == (until_s is None):
        raise ValueError("kill_schedule: give exactly one of count and until_s")
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.uniform(0.75 * mean_s, 1.25 * mean_s)
        if (count is not None and len(out) >= count) or (until_s is not None and t > until_s):
            return tuple(out)
        out.append(round(t, 2))

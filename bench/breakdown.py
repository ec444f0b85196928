"""Where the time goes: recovery and start-up timelines read from the run journal (orchestrator)
or from the baseline script's event lines, and the steps a kill made redo.

A timeline is a list of (point, timestamp) in order; a phase is the time from the previous point
that was measured to this one, so a point that one side cannot see (the shell loop's moment of
detection) folds into the next phase instead of inventing a number.
"""
from __future__ import annotations

POINTS = ("detected", "stopped", "process_started", "python_ready", "tf_imported",
          "model_built", "restored", "first_step")
LABELS = {
    "detected": "death -> detected",
    "stopped": "-> old worker stopped",
    "process_started": "-> worker process started",
    "python_ready": "-> Python + imports",
    "tf_imported": "-> TensorFlow imported",
    "model_built": "-> strategy, data, model built",
    "restored": "-> checkpoint restored",
    "first_step": "-> first step done",
}


def phases(start: float, points: dict[str, float | None]) -> dict[str, float | None]:
    """Seconds spent reaching each point from the previous measured one, plus ``total``."""
    out: dict[str, float | None] = {}
    prev = start
    for name in POINTS:
        t = points.get(name)
        if t is None:
            out[name] = None
            continue
        out[name] = round(t - prev, 3)
        prev = t
    end = points.get("first_step")
    out["total"] = None if end is None else round(end - start, 3)
    return out


def _index(events: list[dict]) -> dict[tuple[str, int], dict]:
    """(event, attempt) -> the first such event."""
    idx: dict[tuple[str, int], dict] = {}
    for e in events:
        if "attempt" in e:
            idx.setdefault((e["event"], e["attempt"]), e)
    return idx


def _worker_points(idx: dict, attempt: int) -> dict[str, float | None]:
    started = idx.get(("attempt_started", attempt))
    ready = idx.get(("worker_ready", attempt)) or {}
    first = idx.get(("first_step", attempt))
    t0, marks = ready.get("started_at"), ready.get("phases_s") or {}
    pts = {"process_started": started["ts"] if started else None, "python_ready": t0,
           "first_step": first["ts"] if first else None}
    for name in ("tf_imported", "model_built", "restored"):
        pts[name] = t0 + marks[name] if t0 is not None and name in marks else None
    return pts


def orchestrator_recovery(events: list[dict], attempt: int, death: float) -> dict:
    """The recovery from the death of ``attempt`` to the first step of the next attempt.

    A dead worker is detected when its attempt ends; a hung one when ``hang_detected`` is
    journaled, and it is stopped (stack dump, SIGTERM, grace, SIGKILL) when its attempt ends.
    """
    idx = _index(events)
    ended = idx.get(("attempt_ended", attempt))
    hang = idx.get(("hang_detected", attempt))
    pts = _worker_points(idx, attempt + 1)
    pts["stopped"] = ended["ts"] if ended else None
    pts["detected"] = hang["ts"] if hang else pts["stopped"]
    return phases(death, pts)


def hang_death(events: list[dict], attempt: int) -> float | None:
    """A hung worker's moment of death: its last heartbeat, as the hang detector saw it."""
    hang = _index(events).get(("hang_detected", attempt))
    if not hang or hang.get("last_heartbeat_age_s") is None:
        return None
    return hang["ts"] - hang["last_heartbeat_age_s"]


def injected_kill(events: list[dict], attempt: int) -> float | None:
    """When ``attempt`` SIGKILLed itself for ``--fault kill@...``: its ``fault_injected`` event,
    journaled just before the signal (the last heartbeat would be up to a beat early)."""
    return next((e["ts"] for e in events if e["event"] == "fault_injected"
                 and e.get("attempt") == attempt and str(e.get("fault", "")).startswith("kill@")),
                None)


def recovery_labels(events: list[dict], attempt: int) -> dict:
    """What ``attempt`` died of (the supervisor's kind) and which path the next attempt took
    (``warm``: a promoted standby, ``cold``: a new process), as the journal says."""
    idx = _index(events)
    ended = idx.get(("attempt_ended", attempt)) or {}
    started = idx.get(("attempt_started", attempt + 1)) or {}
    return {"kind": ended.get("kind"), "path": started.get("path")}


def orchestrator_startup(events: list[dict], launched: float, attempt: int = 1) -> dict:
    """A cold start: from launching ``orchestrator run`` to the first step of ``attempt``."""
    pts = _worker_points(_index(events), attempt)
    return phases(launched, pts)


def _by_pid(lines: list[dict]) -> list[tuple[int, list[dict]]]:
    """The baseline's event lines grouped per process, in the order the processes started."""
    groups: dict[int, list[dict]] = {}
    for e in lines:
        groups.setdefault(e["pid"], []).append(e)
    return list(groups.items())


def _baseline_points(proc_events: list[dict]) -> dict[str, float | None]:
    first = {}
    for e in proc_events:
        first.setdefault(e["event"], e["ts"])
    return {"python_ready": first.get("start"), "tf_imported": first.get("tf_imported"),
            "model_built": first.get("model_built"), "restored": first.get("train_begin"),
            "first_step": first.get("first_step")}


def baseline_startup(lines: list[dict], launched: float) -> dict:
    """The plain script's cold start: from its launch to its first step (the floor)."""
    procs = _by_pid(lines)
    return phases(launched, _baseline_points(procs[0][1]) if procs else {})


def baseline_recovery(lines: list[dict], killed_pid: int, death: float) -> dict:
    """From killing ``killed_pid`` to the first step of the process the shell loop started next.

    The loop's moment of detection and the new process's start are not observable, so the
    time until the new script's first line folds into ``python_ready``.
    """
    procs = _by_pid(lines)
    pids = [pid for pid, _ in procs]
    if killed_pid not in pids or pids.index(killed_pid) + 1 >= len(pids):
        return phases(death, {})
    return phases(death, _baseline_points(procs[pids.index(killed_pid) + 1][1]))


def baseline_progress(lines: list[dict], pid: int, steps_per_epoch: int) -> tuple[int, int]:
    """(steps reached by ``pid``, steps saved by any process so far) from the event lines.

    BackupAndRestore saves at each epoch end (before the instrument's ``epoch_end`` line) and
    restarts an interrupted epoch from its first batch.
    """
    reached, saved = 0, 0
    for e in lines:
        if e["event"] == "epoch_end":
            saved = max(saved, e["epoch"] * steps_per_epoch)
            if e["pid"] == pid:
                reached = max(reached, e["epoch"] * steps_per_epoch)
        elif e["event"] == "progress" and e["pid"] == pid:
            reached = max(reached, e["epoch"] * steps_per_epoch + e["batch"])
    return reached, saved


def heartbeat_progress(beat: dict | None, attempt: int, steps_per_epoch: int) -> int | None:
    """Steps reached by ``attempt`` according to its heartbeat, or None if it is not its beat."""
    if not beat or beat.get("attempt") != attempt:
        return None
    return int(beat.get("epoch", 0)) * steps_per_epoch + int(beat.get("batch", 0))


def baseline_failed_alone(lines: list[dict], kills: list[dict]) -> int:
    """Processes of the plain script that ended without finishing and were not killed by the
    bench: each one a restart of the shell loop caused by the script failing on its own."""
    killed = {k["pid"] for k in kills}
    return sum(pid not in killed and not any(e["event"] == "end" for e in evs)
               for pid, evs in _by_pid(lines))


def steps_redone(kills: list[dict]) -> int:
    """Steps trained after the last saved state by the processes that were killed."""
    return sum(max(0, (k.get("reached") or 0) - (k.get("saved") or 0)) for k in kills)


def baseline_useful(lines: list[dict]) -> float:
    """The plain script's useful time, by the rule of ``orchestrator.ops.timeline.account``: per
    process, from its first step to its last saved epoch (training whose result was kept)."""
    total = 0.0
    for _, evs in _by_pid(lines):
        first = next((e["ts"] for e in evs if e["event"] == "first_step"), None)
        saved = [e["ts"] for e in evs if e["event"] == "epoch_end"]
        if first is not None and saved and saved[-1] > first:
            total += saved[-1] - first
    return round(total, 3)


def baseline_fit_time(lines: list[dict]) -> float | None:
    """The plain script's first process, first step -> ``fit`` returned: with Orbax, the wait
    for its last asynchronous save included (its ``on_train_end``)."""
    procs = _by_pid(lines)
    evs = procs[0][1] if procs else []
    first = next((e["ts"] for e in evs if e["event"] == "first_step"), None)
    end = next((e["ts"] for e in evs if e["event"] == "train_end"), None)
    return None if first is None or end is None else round(end - first, 3)


def export_time(events: list[dict]) -> float | None:
    """Seconds spent writing the model for inference at the end of the run: the ``exported``
    event's own measure (the last worker's export, or the supervisor's exporter process)."""
    exp = next((e for e in events if e["event"] == "exported"), None)
    return None if exp is None or exp.get("seconds") is None else round(exp["seconds"], 3)


def final_fingerprint(events: list[dict]) -> str | None:
    return next((e.get("weights_sha256") for e in reversed(events)
                 if e["event"] == "run_completed"), None)


def baseline_fingerprint(lines: list[dict]) -> str | None:
    return next((e.get("weights_sha256") for e in reversed(lines) if e["event"] == "end"), None)


def median_phases(samples: list[dict]) -> dict[str, float | None]:
    """The median of each phase (and of ``total``) over recovery or start-up samples."""
    from .stats import median

    return {k: median(s.get(k) for s in samples) for k in (*POINTS, "total")}


def checkpoint_writes(events: list[dict]) -> dict:
    """The worker's checkpoint writes: each one's training-thread stall and write time (ms),
    and the writer's decisions when one fell due while the previous was still writing."""
    written = [e for e in events if e["event"] == "checkpoint_written"]
    return {
        "writer": sorted({e.get("writer") for e in written if e.get("writer")}),
        "stall_ms": [e["stall_ms"] for e in written],
        "write_ms": [e.get("write_ms") for e in written],
        "skipped_busy": sum(e["event"] == "checkpoint_skipped_busy" for e in events),
        "waited_ms": [e["wait_ms"] for e in events if e["event"] == "checkpoint_waited"],
    }


def backend_of(events: list[dict]) -> str | None:
    """The backend the run trained on, as its first worker journaled it (``worker_ready``): the
    figures of a JAX arm are only JAX's if the run really trained on JAX."""
    return next((e.get("backend") for e in events if e["event"] == "worker_ready"), None)


def compile_cache_at_start(events: list[dict], attempt: int = 1) -> dict | None:
    """The JAX compile cache ``attempt`` started with (``worker_ready.compile_cache``: its
    folder, entries pulled from the run directory, entries already there), or None on
    TensorFlow: what says an 'empty cache' cold start was empty and a 'warm' one was not."""
    ready = _index(events).get(("worker_ready", attempt)) or {}
    return ready.get("compile_cache")


def standby_decisions(events: list[dict]) -> list[dict]:
    """The supervisor's ``standby_decided`` events, in order: for which attempt, the mode (None:
    no standby) and its reason, verbatim (journaled when the decision changes)."""
    return [{"for_attempt": e.get("for_attempt"), "mode": e.get("mode"),
             "reason": e.get("reason")} for e in events if e["event"] == "standby_decided"]


def _attempt_window(events: list[dict], attempt: int) -> tuple[float | None, float | None]:
    """From ``attempt``'s first step to its end (None: it has not ended)."""
    idx = _index(events)
    first, end = idx.get(("first_step", attempt)), idx.get(("attempt_ended", attempt))
    return (first or {}).get("ts"), (end or {}).get("ts")


def training_rates(events: list[dict], attempt: int, t0: float, t1: float) -> dict:
    """Steps per second of ``attempt`` between its checkpoint commits (first step to its end),
    while ``[t0, t1]`` (a standby warming up beside it: each interval between commits whose
    midpoint falls in it) and after ``t1``; ``slowdown`` = after / during (None: not both
    measured)."""
    first, end = _attempt_window(events, attempt)
    if first is None:
        return {"during": None, "after": None, "slowdown": None}
    commits = [(e["ts"], e.get("step")) for e in events if e["event"] == "checkpoint_committed"
               and e["ts"] >= first and (end is None or e["ts"] <= end)
               and e.get("step") is not None]
    sums = {"during": [0, 0.0], "after": [0, 0.0]}
    for (ta, sa), (tb, sb) in zip(commits, commits[1:]):
        mid = (ta + tb) / 2
        part = "during" if t0 <= mid <= t1 else "after" if mid > t1 else None
        if part and tb > ta and sb > sa:
            sums[part][0] += sb - sa
            sums[part][1] += tb - ta
    rate = {k: round(n / dt, 2) if dt else None for k, (n, dt) in sums.items()}
    slow = (round(rate["after"] / rate["during"], 3)
            if rate["during"] and rate["after"] else None)
    return dict(rate, slowdown=slow)


def standby_warmups(events: list[dict]) -> list[dict]:
    """Each standby of the run: the attempt it was for, its mode, its warm-up (``standby_started``
    -> ``standby_ready``, None: never ready), what became of it (promoted, discarded, lost, or
    None: still there at the end) and the training speed of the worker beside it while it
    warmed up against after (``training_rates``)."""
    out = []
    for s in (e for e in events if e["event"] == "standby_started"):
        pid, n = s.get("pid"), s.get("for_attempt")
        mine = [e for e in events if e.get("pid") == pid and e.get("for_attempt", e.get(
            "attempt")) == n and e["ts"] >= s["ts"]]
        ready = next((e for e in mine if e["event"] == "standby_ready"), None)
        fate = next((e for e in mine if e["event"] in (
            "standby_promoted", "standby_discarded", "standby_lost")), None)
        warm_up = None if ready is None else round(ready["ts"] - s["ts"], 3)
        rates = (training_rates(events, n - 1, s["ts"], ready["ts"]) if ready is not None
                 else {"during": None, "after": None, "slowdown": None})
        out.append({"for_attempt": n, "mode": s.get("mode"), "warm_up_s": warm_up,
                    "outcome": None if fate is None else fate["event"].split("_", 1)[1],
                    "reason": None if fate is None else fate.get("reason"),
                    "steps_per_s_during": rates["during"], "steps_per_s_after": rates["after"],
                    "slowdown": rates["slowdown"],
                    "phases_s": None if ready is None else ready.get("phases_s")})
    return out

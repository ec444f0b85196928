"""Where a run stands, read from its directory alone (journal, checkpoints, lock, heartbeat).

``run_status`` is the machine-readable answer (``orchestrator status --json``), and
``format_status`` the few lines a person reads. Goodput and time lost are defined in
``timeline``.
"""
from __future__ import annotations

import os
import time

from orchestrator.core import heartbeat, hosts

from orchestrator.ops import timeline
from orchestrator.core.formatting import fmt_duration, fmt_metrics
from orchestrator.checkpoint import settle, tiers
from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.core.journal import Journal, segment_paths
from orchestrator.core.lock import FILE as LOCK_FILE, RunLock
from orchestrator.core.osutil import read_json
from orchestrator.core.rundir import RunDir, rank_dir
from orchestrator.core.spec import SpecError
from orchestrator.core.specload import load
from orchestrator.core.events import CHECKPOINTS, OUTAGE_EVENTS, RUN_DIR, Event


def load_run(run_dir: str):
    """``(RunDir, events, running)`` of a run directory; FileNotFoundError if it is none."""
    rd = RunDir(os.path.abspath(run_dir))
    if not os.path.isfile(rd.journal) and not segment_paths(rd.journal):
        raise FileNotFoundError(f"{run_dir}: not a run directory (no events.jsonl)")
    lock = read_json(os.path.join(rd.root, LOCK_FILE))
    # a live owner, or one on another host not yet silent for long (a recycled VM's is)
    running = lock is not None and RunLock(rd.root).stale_reason(lock) is None
    events = Journal(rd.journal).events()
    try:  # on the machine that runs it, the local journal is ahead (supervise/controlmirror)
        local = RunDir.for_spec(load(rd.job_copy, run_dir=rd.root))
        mine = Journal(local.journal).events()
    except (SpecError, OSError):
        mine = []
    if len(mine) > len(events) and mine[:1] == events[:1]:
        return local, mine, running
    return rd, events, running


def run_status(run_dir: str, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    rd, events, running = load_run(run_dir)
    info = read_json(rd.run_info) or {}
    tl = timeline.build(events, running=running, now=now)
    outer = Journal(os.path.join(rd.root, hosts.FILE)).events()  # `orchestrator colab`'s
    acct = timeline.account(tl, hosts.span(outer, now))
    durable_latest, durable_error, local_latest, writeback = _latest_checkpoints(rd)
    latest = max((c for c in (local_latest, durable_latest) if c), key=lambda c: c.step,
                 default=None)
    durable_down = (outages(events, now, CHECKPOINTS) or [{}])[-1]
    last = tl.sessions[-1].how if tl.sessions else "ended"
    state = {"running": "running", "completed": "completed", "failed": "failed"}.get(
        last, "stopped")  # stopped: interrupted or stopped; `run` resumes it
    hb = heartbeat.read(rd.control)
    current = tl.attempts[-1] if tl.attempts else None
    failed = [a for a in tl.attempts if a.failed]
    completed, run_failed = _last(events, Event.RUN_COMPLETED), _last(events, Event.RUN_FAILED)
    return {
        "run_dir": rd.root,
        "name": info.get("name") or os.path.basename(rd.root),
        "state": state,
        "attempt": current.n if current else 0,
        "epoch": latest.epoch if latest else 0,
        "epochs": (_last(events, *timeline.SESSION_START) or {}).get("epochs"),
        "step": latest.step if latest else 0,
        "live": _live(hb, current) if running else None,
        "attempts": len(tl.attempts),
        "failed_attempts": len(failed),
        "restarts": sum(1 for e in events if e["event"] == Event.RESTART),
        "restarts_by_kind": timeline.restarts_by_kind(tl),
        "budgets": _budgets(events),
        "faults_by_kind": _count(a.kind for a in failed),
        "goodput": acct["goodput"],
        "wall_s": acct["wall_s"],
        "useful_s": acct["useful_s"],
        "lost_to_faults_s": acct["lost_to_faults_s"],
        "time_by_cause_s": acct["by_cause_s"],
        "away_s": acct["away_s"],
        "runtimes": [h.record(now) for h in hosts.hosts(outer)],
        "last_checkpoint": _checkpoint(latest),
        "checkpoints_by_tier": _tiers(events, durable_latest, local_latest),
        "durable_settled": settle.standing(events, writeback,
                                           durable_latest.step if durable_latest else None),
        "durable_unreachable_since": (durable_down["since"] if running and
                                      durable_down.get("ongoing") else None),
        "durable_error": durable_error,
        "run_dir_outages": outages(events, now),
        "workers": (_last(events, Event.ATTEMPT_STARTED) or {}).get("workers"),
        "ranks": ranks(rd, events, now),
        "backend": _backend(info, events),
        "last_error": _last_error(failed, run_failed),
        "failure": None if run_failed is None or state != "failed" else {
            k: run_failed.get(k) for k in ("kind", "reason", "evidence", "tried")
            if run_failed.get(k) is not None},
        "heartbeat_age_s": round(now - hb["time"], 1) if hb and running else None,
        "supervisor": read_json(os.path.join(rd.root, LOCK_FILE)),
        "weights_sha256": completed.get("weights_sha256") if completed else None,
        "metrics": (_last(events, Event.EPOCH_COMPLETED) or {}).get("metrics"),
    }


def _last(events: list[dict], *kinds: str) -> dict | None:
    """The last event of one of ``kinds``, or None."""
    return next((e for e in reversed(events) if e["event"] in kinds), None)


def _latest_checkpoints(rd) -> tuple:
    """The latest valid checkpoint of the durable tier (or why it cannot be read), and of the
    local tier, known from the run's job copy (and existing on its machine only); and whether
    the durable tier is a write-back cache (checkpoint/settle.py)."""
    try:  # both tiers are known from the run's job copy (the local one is on its machine only)
        ck = load(rd.job_copy, run_dir=rd.root).checkpoint
    except (SpecError, OSError):
        ck = None
    try:  # the run directory's checkpoints/, or the job's bucket
        durable_latest, durable_error = tiers.durable_store(
            ck.durable or rd.checkpoints if ck else rd.checkpoints).latest_valid(), None
    except (OSError, ValueError) as exc:
        durable_latest, durable_error = None, str(exc)
    if ck is None:
        return durable_latest, durable_error, None, False  # no job copy: nothing more known
    try:
        local_latest = CheckpointStore(ck.local_dir).latest_valid()
    except OSError:
        local_latest = None
    return durable_latest, durable_error, local_latest, settle.policy_for(
        ck, rd.checkpoints).writeback


def _live(hb: dict | None, current) -> dict | None:
    """Where the live attempt is, from its heartbeat (None: the heartbeat is another's)."""
    if not (hb and current and hb.get("attempt") == current.n):
        return None
    return {"epoch": hb.get("epoch"), "batch": hb.get("batch"),
            "steps_per_epoch": current.steps_per_epoch, "phase": hb.get("phase")}


def format_budgets(b: dict) -> str:
    """Preemptions apart from the job's own failures (status and the report)."""
    cap = b["preemptions_max"]
    return (f"errors {b['errors']} of {b['errors_max']} since the last checkpoint; "
            f"preemptions {b['preemptions']} " + (f"of {cap}" if cap is not None else "(no limit)"))


def _budgets(events: list[dict]) -> dict | None:
    """The recovery policy's two counters as last journaled (restart, run_failed); a checkpoint
    committed since then resets the error count, as it does in the policy."""
    budgets = None
    for e in events:
        if e["event"] in (Event.RESTART, Event.RUN_FAILED) and "errors" in e:
            budgets = {k: e.get(k) for k in ("errors", "errors_max", "preemptions",
                                             "preemptions_max")}
        elif e["event"] == Event.CHECKPOINT_COMMITTED and budgets:
            budgets["errors"] = 0
    return budgets


def outages(events: list[dict], now: float, part: str = RUN_DIR) -> list[dict]:
    """Each time ``part`` of the run directory stopped answering (core/outage.py; the run
    directory itself by default, or its checkpoints folder): since when, for how long, what was
    held back on the local disk meanwhile, and whether the worker was paused (the lock's
    lease). Its pair of events is ``OUTAGE_EVENTS[part]``."""
    down, back = OUTAGE_EVENTS[part]
    out: list[dict] = []
    for e in events:
        if e["event"] == down:
            out.append({"since": e["ts"], "outage_s": None, "ongoing": True,
                        "error": e.get("error"), "held_back": None, "paused_s": None})
        elif out and e["event"] == back and out[-1]["ongoing"]:
            out[-1].update(outage_s=e.get("outage_s", e.get("down_s")), ongoing=False,
                           held_back=e.get("held_back"))
        elif out and e["event"] == Event.WORKER_RESUMED and part == RUN_DIR:
            out[-1]["paused_s"] = e.get("paused_s")
    for o in out:
        if o["ongoing"]:
            o["outage_s"] = round(now - o["since"], 3)
    return out


def ranks(rd: RunDir, events: list[dict], now: float) -> list[dict] | None:
    """Each rank of the last attempt's group (None for one worker) with its last heartbeat in
    that attempt: node, pid, phase, epoch, step and the beat's age (None: no beat yet). A rank
    on another node beats there; supervise/relay.py writes its beats into its folder here
    (``rank_dir``), which the control mirror copies to the run directory."""
    started = next((e for e in reversed(events) if e["event"] == Event.ATTEMPT_STARTED), None)
    if not started or not started.get("workers"):
        return None
    out = []
    for w in started["workers"]:
        hb = heartbeat.read(rank_dir(rd.control, w["rank"])) or {}
        if hb.get("attempt") != started["attempt"]:
            hb = {}
        out.append({"rank": w["rank"], "node": w.get("node"), "host": w.get("host"),
                    "pid": hb.get("pid", w.get("pid")), "phase": hb.get("phase"),
                    "epoch": hb.get("epoch"), "step": hb.get("step"),
                    "heartbeat_age_s": round(now - hb["time"], 1) if hb.get("time") else None})
    return out


def format_rank(r: dict) -> str:
    """One rank and its last heartbeat in words (status)."""
    where = f"rank {r['rank']} on {r.get('node') or r.get('host') or '?'} pid {r['pid']}"
    if r["heartbeat_age_s"] is None:
        return f"{where}: no heartbeat in this attempt"
    return (f"{where}: {r['phase'] or '?'}, epoch {r['epoch']} step {r['step']}, "
            f"heartbeat {fmt_duration(r['heartbeat_age_s'])} ago")


def format_workers(workers: list[dict]) -> str:
    """The ranks of the last attempt's group (status and the report)."""
    return ", ".join(f"rank {w['rank']} pid {w['pid']} on {w['host']}" for w in workers)


def format_runtime(r: dict) -> str:
    """One runtime of the outer loop in words (status and the report)."""
    refused = f", after {r['refusals']} refusal(s)" if r.get("refusals") else ""
    lasted = f" for {fmt_duration(r['lasted_s'])}" if r.get("lasted_s") is not None else ""
    step = f" at step {r['step']}" if r.get("step") is not None else ""
    return (f"#{r['n']} {r['session']} ({r['kind']}{refused}) on host {r.get('host') or '?'}"
            f"{lasted}: {r['why']}{step}")


def format_outage(o: dict) -> str:
    """One outage in words (status and the report)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(o["since"]))
    text = f"from {when} for {fmt_duration(o['outage_s'] or 0)}"
    if o["ongoing"]:
        text += " so far"
    held = o.get("held_back") or {}
    if held:
        text += (f"; held back {held.get('events', 0)} event(s), "
                 f"{held.get('log_bytes', 0)} bytes of logs, {held.get('files', 0)} file(s)")
    if o.get("paused_s"):
        text += f"; worker paused {fmt_duration(o['paused_s'])}"
    return text


def format_settled(d: dict) -> str:
    """The newest durable copy: only written (in the cache) or settled (in the cloud)."""
    if d["settled"]:
        return f"step {d['step']} settled ({d['how']})"
    older = (f"; newest settled: step {d['newest_settled']}" if d.get("newest_settled")
             is not None else "; no settled copy yet")
    return f"step {d['step']} written, not settled yet{older}"


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in items:
        out[k] = out.get(k, 0) + 1
    return out


def _checkpoint(c) -> dict | None:
    if c is None:
        return None
    return {"epoch": c.epoch, "step": c.step, "path": c.path,
            "committed_at": c.manifest.get("committed_at"), "verified": True}


def _tiers(events: list[dict], run_dir, local) -> dict:
    """The newest checkpoint in each tier: the run directory's and the local tier's (verified
    now; the local one where this machine holds it), and each tier the journal names
    (``checkpoint_durable`` events, or checkpoint events with a ``tier``)."""
    tiers = {"run_dir": _checkpoint(run_dir)}
    if local is not None:
        tiers["local"] = _checkpoint(local)
    for e in events:
        ev = e.get("event", "")
        tier = "durable" if ev == Event.CHECKPOINT_DURABLE else \
            e.get("tier") if ev.startswith("checkpoint_") else None
        if tier and tier != "run_dir" and "skipped" not in ev:
            tiers[tier] = {"epoch": e.get("epoch"), "step": e.get("step"),
                           "path": e.get("path") or e.get("dest"), "committed_at": e["ts"],
                           "verified": e.get("verified")}
    return tiers


def _last_error(failed: list, run_failed: dict | None) -> str | None:
    if not failed:
        return None
    a = failed[-1]
    line = timeline.error_line(a.error)
    if line is None and run_failed and a.n == run_failed.get("last_attempt"):
        line = timeline.error_line(run_failed.get("error"))
    return f"attempt {a.n} ({a.kind}): {line or a.how}"


def _backend(info: dict, events: list) -> dict:
    """The Keras backend the run trains on (run.json; runs from before the second backend
    trained on TensorFlow), with the last worker's versions and devices."""
    ready = next((e for e in reversed(events) if e["event"] == Event.WORKER_READY), {})
    return {"name": info.get("backend", "tensorflow"), "versions": ready.get("versions"),
            "devices": ready.get("strategy")}


def _checkpoint_lines(s: dict, now: float) -> list[str]:
    """Each tier's last checkpoint, whether the durable copy has settled, the tier's state."""
    lines = []
    for tier, c in s["checkpoints_by_tier"].items():
        if c is None:
            lines.append(f"  last checkpoint ({tier}): none")
            continue
        age = f", {fmt_duration(now - c['committed_at'])} ago" if c.get("committed_at") else ""
        lines.append(f"  last checkpoint ({tier}): epoch {c['epoch']}, step {c['step']}{age}")
    d = s.get("durable_settled") or {}
    if d.get("policy") == settle.WriteBack.kind and d.get("step") is not None:
        lines.append(f"  durable copy (write-back cache): {format_settled(d)}")
    if s.get("durable_unreachable_since"):
        lines.append(f"  durable tier unreachable for "
                     f"{fmt_duration(now - s['durable_unreachable_since'])}; training goes on")
    if s.get("durable_error"):
        lines.append(f"  durable tier: {s['durable_error']}")
    return lines


def format_status(s: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    where = f"epoch {s['epoch']}/{s['epochs']}, step {s['step']}"
    live = s.get("live")
    if live and live.get("batch") is not None:
        spe = live.get("steps_per_epoch")
        where += f" (in epoch {live['epoch'] + 1}: batch {live['batch']}" + \
                 (f"/{spe})" if spe else ")")
    lines = [f"run {s['name']} ({s['run_dir']}): {s['state'].upper()}",
             f"  {where}; attempt {s['attempt']}"]
    kinds = ", ".join(f"{k} {n}" for k, n in s["restarts_by_kind"].items())
    lines.append(f"  restarts: {s['restarts']}" + (f" ({kinds})" if kinds else "") +
                 f"; failed attempts: {s['failed_attempts']}")
    if s["budgets"]:
        lines.append(f"  budgets: {format_budgets(s['budgets'])}")
    if s["goodput"] is not None:
        lost = ", ".join(f"{k} {fmt_duration(v)}" for k, v in s["time_by_cause_s"].items())
        lines.append(f"  goodput: {s['goodput']:.1%} (useful {fmt_duration(s['useful_s'])} of "
                     f"{fmt_duration(s['wall_s'])} supervised); lost to faults: "
                     f"{fmt_duration(s['lost_to_faults_s'])}")
        if lost:
            lines.append(f"  time by cause: {lost}")
    lines += _checkpoint_lines(s, now)
    if s.get("backend"):
        b = s["backend"]
        versions = ", ".join(f"{k} {v}" for k, v in (b.get("versions") or {}).items()
                             if k != "platform")
        lines.append(f"  backend: {b['name']}" + (f" ({versions})" if versions else "")
                     + (f" on {b['devices']}" if b.get("devices") else ""))
    if s.get("workers"):
        lines.append(f"  workers: {format_workers(s['workers'])}")
        lines += [f"    {format_rank(r)}" for r in s.get("ranks") or []]
    if s.get("runtimes"):
        between = s["time_by_cause_s"].get(timeline.BETWEEN_RUNTIMES, 0.0)
        lines.append(f"  runtimes (orchestrator colab): {len(s['runtimes'])}; time outside any "
                     f"supervisor {fmt_duration(between)}")
        lines += [f"    {format_runtime(r)}" for r in s["runtimes"]]
    for o in s.get("run_dir_outages", [])[-3:]:
        lines.append(f"  run directory unreachable {format_outage(o)}")
    if s["metrics"]:
        lines.append("  last metrics: " + fmt_metrics(s["metrics"]))
    if s["last_error"]:
        lines.append(f"  last error: {s['last_error']}")
    if s.get("failure"):
        lines.append(f"  failed: {s['failure'].get('reason')}")
    if s["weights_sha256"]:
        lines.append(f"  weights sha256: {s['weights_sha256']}")
    return "\n".join(lines)

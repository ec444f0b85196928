"""Where a run stands, read from its directory alone (journal, checkpoints, lock, heartbeat)."""
from __future__ import annotations

import os
import time

from . import heartbeat
from .checkpoints import CheckpointStore
from .journal import Journal
from .lock import FILE as LOCK_FILE
from .osutil import pid_alive, read_json
from .rundir import RunDir


def run_status(run_dir: str) -> dict:
    rd = RunDir(os.path.abspath(run_dir))
    if not os.path.isfile(rd.journal):
        raise FileNotFoundError(f"{run_dir}: not a run directory (no events.jsonl)")
    events = Journal(rd.journal).events()
    info = read_json(rd.run_info) or {}
    started = [e for e in events if e["event"] == "attempt_started"]
    ended = [e for e in events if e["event"] == "attempt_ended"]
    failed = [e for e in ended if e.get("exit_code") != 0]
    epochs_total = next((e.get("epochs") for e in reversed(events)
                         if e["event"] in ("run_started", "run_resumed")), None)
    latest = CheckpointStore(rd.checkpoints).latest_valid()
    lock = read_json(os.path.join(rd.root, LOCK_FILE))
    owner_alive = bool(lock and lock.get("host") == os.uname().nodename
                       and pid_alive(int(lock.get("pid", 0) or 0)))
    last = next((e for e in reversed(events)
                 if e["event"] in ("run_completed", "run_failed", "supervisor_stopped",
                                   "run_started", "run_resumed")), {})
    if lock and (owner_alive or lock.get("host") != os.uname().nodename):
        state = "running"
    elif last.get("event") == "run_completed":
        state = "completed"
    elif last.get("event") == "run_failed":
        state = "failed"
    else:
        state = "stopped"  # interrupted (VM recycled, supervisor killed): `run` resumes it
    last_error = next((e.get("error") for e in reversed(ended) if e.get("error")), None)
    hb = heartbeat.read(rd.root)
    completed = next((e for e in reversed(events) if e["event"] == "run_completed"), None)
    return {
        "run_dir": rd.root,
        "name": info.get("name"),
        "state": state,
        "epoch": latest.epoch if latest else 0,
        "epochs": epochs_total,
        "last_checkpoint": None if latest is None else {
            "epoch": latest.epoch, "step": latest.step, "path": latest.path,
            "committed_at": latest.manifest.get("committed_at")},
        "attempts": len(started),
        "failed_attempts": len(failed),
        "restarts": sum(1 for e in events if e["event"] == "restart"),
        "last_error": last_error,
        "heartbeat_age_s": round(time.time() - hb["time"], 1) if hb else None,
        "supervisor": lock if lock else None,
        "weights_sha256": completed.get("weights_sha256") if completed else None,
        "metrics": next((e.get("metrics") for e in reversed(events)
                         if e["event"] == "epoch_completed"), None),
    }


def format_status(s: dict) -> str:
    lines = [f"run {s['name']} ({s['run_dir']}): {s['state']}",
             f"  epoch {s['epoch']}/{s['epochs']}, {s['attempts']} attempt(s), "
             f"{s['restarts']} restart(s), {s['failed_attempts']} failed"]
    if s["last_checkpoint"]:
        c = s["last_checkpoint"]
        age = time.time() - c["committed_at"] if c.get("committed_at") else None
        when = f", {age:.0f} s ago" if age is not None else ""
        lines.append(f"  last checkpoint: epoch {c['epoch']} (step {c['step']}{when})")
    if s["metrics"]:
        lines.append("  last metrics: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float)
                                                   else f"{k}={v}"
                                                   for k, v in s["metrics"].items()))
    if s["last_error"]:
        e = s["last_error"]
        msg = (e.get("message") or "").strip().splitlines()
        lines.append(f"  last error: {e.get('type')}: {msg[0] if msg else ''}")
    if s["weights_sha256"]:
        lines.append(f"  weights sha256: {s['weights_sha256']}")
    return "\n".join(lines)

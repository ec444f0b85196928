"""What a recycled runtime's Drive cache took with it: progress journaled, never in the cloud.

Why: on a write-back tier (checkpoint/settle.py) a checkpoint the old runtime wrote and read
back may never have been uploaded. The new runtime resumes from what the durable tier holds;
the steps between that and the last progress known elsewhere were trained and are gone. Known
elsewhere: the outer loop's journal (``orchestrator colab`` runs outside the runtime and
records each runtime's last step, core/hosts.py), the run's own journal where it reached the
cloud, and the small state files next to the checkpoints (checkpoint/settle.py), which reach it
long before a large checkpoint does. Journaled as ``durable_lost`` (steps N..M never reached Drive, ``lost_s``: the training
time they cost, which goodput charges, ops/timeline.py).
"""
from __future__ import annotations

from orchestrator.core import hosts
from orchestrator.core.events import Event

_PROGRESS = (Event.CHECKPOINT_COMMITTED, Event.CHECKPOINT_WRITTEN, Event.CHECKPOINT_DURABLE)


def durable_lost(events: list[dict], outer: list[dict], have,
                 states: list[dict] = ()) -> dict | None:
    """``{steps: [N, M], lost_s, known_from}`` when the last progress known (``events``: the
    run's journal, ``outer``: the outer loop's, ``states``: the durable tier's state files) is
    past ``have`` (the newest checkpoint that verifies here, or None); None when nothing was
    lost or it was journaled already."""
    have_step = have.step if have is not None else 0
    known, known_ts, source = have_step, None, None
    for e in events:
        if e.get("event") in _PROGRESS and isinstance(e.get("step"), int) \
                and e["step"] > known:
            known, known_ts, source = e["step"], e.get("ts"), "journal"
    for rec in states:
        if isinstance(rec.get("step"), int) and rec["step"] > known:
            known, known_ts, source = rec["step"], rec.get("written_at"), "state file"
    runtime_started = None
    for h in hosts.hosts(outer):
        if h.step is not None and h.step > known and h.ended is not None:
            known, known_ts, source = h.step, h.ended, f"runtime {h.session}"
            runtime_started = h.started or h.allocated
    if known <= have_step:
        return None
    steps = [have_step + 1, known]
    if any(e.get("event") == Event.DURABLE_LOST and e.get("steps") == steps for e in events):
        return None
    since = have.manifest.get("committed_at") if have is not None else None
    if since is None:
        since = next((e.get("ts") for e in events if e.get("event") == Event.CHECKPOINT_COMMITTED
                      and e.get("step") == have_step), runtime_started)
    lost_s = round(max(0.0, known_ts - since), 3) if known_ts and since else None
    return {"steps": steps, "lost_s": lost_s, "known_from": source}


def lost_s(events: list[dict]) -> float:
    """Training time the journal says never reached the durable tier (goodput's charge)."""
    return sum(e.get("lost_s") or 0.0 for e in events if e.get("event") == Event.DURABLE_LOST)

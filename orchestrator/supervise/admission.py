"""Resume admission: may this job continue the run in this run directory, and as what?

``run.json`` records the training hash the run was created with (model, data, compile, batch
size, seed). Resuming under another hash would continue the checkpoints with a different
training, so it is refused with the keys that changed, unless ``--force``; a forced resume is
journaled and the old hash kept. A run directory whose ``run.json`` and journal are gone but
whose local checkpoint folder is not (an earlier run, since deleted) starts from scratch: those
checkpoints are set aside, never resumed from.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from orchestrator.checkpoint import tiers
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import is_missing, read_json, write_json_atomic
from orchestrator.core.rundir import RunDir
from orchestrator.core.spec import JobSpec

log = logging.getLogger(__name__)


class IncompatibleResume(Exception):
    """The job's model, data or optimizer changed since the run was created."""


@dataclass(frozen=True)
class Admission:
    forced: dict | None = None   # what --force let through: changed keys, old and new hash


def admit(spec: JobSpec, rd: RunDir, force: bool) -> Admission:
    """Refuse to resume under a changed training hash unless ``force``."""
    info = read_json(rd.run_info)
    if not info or not info.get("training_hash"):
        return Admission()
    old, new = info["training_hash"], spec.training_hash()
    if old == new:
        return Admission()
    before, now = info.get("training") or {}, spec.training_relevant()
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    what = ", ".join(changed) if before else "model, data, compile, batch_size or seed"
    if "backend" in changed:  # the one change worth naming both sides of
        what += (f" (the run trained on {before.get('backend', 'tensorflow')}, this one would "
                 f"train on {now.get('backend', 'tensorflow')}: numerics, random streams and "
                 f"the data order differ)")
    if not force:
        raise IncompatibleResume(
            f"{spec.job_path}: cannot resume the run in {rd.root}: {what} changed "
            f"since it was created (training hash {old[:12]} in run.json, {new[:12]} now). "
            f"Resuming would continue its checkpoints with a different training. Use another "
            f"run_dir for a new run, or `orchestrator run --force` (orchestrator.run(..., "
            f"force=True)) to resume anyway.")
    log.info(f"resuming despite changed {what} (--force)")
    return Admission({"changed": changed, "old_hash": old, "new_hash": new})


def record(spec: JobSpec, rd: RunDir, journal: Journal, admission: Admission,
           store: tiers.TieredStore, had_events: bool) -> None:
    """Write ``run.json`` for a new run (setting aside an earlier run's local checkpoints), or
    update it for a forced resume."""
    info = read_json(rd.run_info)
    if info is None and not had_events and is_missing(rd.run_info):
        set_aside_earlier_checkpoints(store, journal)
    if info is None:
        write_json_atomic(rd.run_info, {"name": spec.name, "created": time.time(),
                                        "job_path": spec.job_path,
                                        "training_hash": spec.training_hash(),
                                        "training": spec.training_relevant(),
                                        "backend": spec.backend})
    elif admission.forced is not None:
        journal.append(Event.RESUME_FORCED, **admission.forced)
        write_json_atomic(rd.run_info, dict(
            info, job_path=spec.job_path, training_hash=spec.training_hash(),
            training=spec.training_relevant(), backend=spec.backend,
            previous_training_hashes=info.get("previous_training_hashes", [])
            + [info.get("training_hash")]))


def set_aside_earlier_checkpoints(store: tiers.TieredStore, journal: Journal) -> None:
    """A new run (no run.json, no journal) finds local checkpoints: an earlier run at this
    run directory, since deleted, left them. Never resume from them; keep them aside."""
    moved = tiers.set_aside_local(store)
    if moved:
        dest, n = moved
        journal.append(Event.LOCAL_CHECKPOINTS_SET_ASIDE, path=store.local.root,
                       moved_to=dest, entries=n)
        log.info(f"the local checkpoint folder {store.local.root} held {n} entr"
                 f"{'y' if n == 1 else 'ies'} of an earlier run in this run directory (its "
                 f"run.json is gone): moved to {dest}; this run starts from scratch")

"""Issue 37's part: states of a gigabyte and more. Two jobs (bench/bigstate): an MLP of ~105 M
parameters trained whole with Adam (~1.26 GB of state), and the same MLP with its backbone
frozen and a small head trained; for each, side by side in one run: plain ``fit``, ``fit`` +
BackupAndRestore at the same frequency, Orbax's async CheckpointManager (JAX), and us, fault
free; then us killed once after a checkpoint (``standby: on``: its standby's memory is
measured), for kill -> next first step against the cold start and the restore against ``dd``
of the same bytes.

Bytes per checkpoint, ours: the state's size each ``checkpoint_committed`` journals (from its
manifest), and the ``bytes_uploaded`` of ``checkpoint_durable`` where the format writes it
(only the blobs the durable tier lacked); the plain arms': their directory after each save.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time

from orchestrator.checkpoint import blobs
from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.core import backends as core_backends
from orchestrator.core.journal import Journal

from . import arms
from .stats import fmt_ratio, fmt_s, md_table, median, side_by_side, spread

JOB = os.path.join(arms.HERE, "bigstate", "job.yaml")
JOBS = ("trained", "frozen")
ARMS = ("keras_fit", "keras_fit_backup", "orbax", "orchestrator", "orchestrator_killed")
ORBAX_BACKENDS = (core_backends.JAX,)
ARM_LABELS = {"keras_fit": "plain fit", "keras_fit_backup": "fit + BackupAndRestore",
              "orbax": "fit + Orbax CheckpointManager (async)", "orchestrator": "orchestrator",
              "orchestrator_killed": "orchestrator, killed once (standby: on)"}


def model_bytes(args: dict, frozen: bool) -> dict:
    """float32 bytes of the MLP's weights, and of what one step changes: everything and Adam's
    two slots when trained whole; the head and its slots when the backbone is frozen (plus
    the optimizer's iteration count and rate, 16 bytes)."""
    f, w, h, c = args["features"], args["width"], args["hidden"], args.get("classes", 10)
    backbone = f * w + w + (h - 1) * (w * w + w)
    head = w * c + c
    trained = head if frozen else backbone + head
    return {"weights": 4 * (backbone + head), "changed": 4 * 3 * trained + 16,
            "state": 4 * (backbone + head + 2 * trained) + 16}


def prepare(cfg, work: str, backends: tuple) -> dict:
    """{backend: {job: path}}: the two jobs at ``cfg``'s size, ``backend`` said in each."""
    size = {"width": cfg.bigstate_width, "hidden": cfg.bigstate_hidden, "features": 1024}
    out: dict = {}
    for b in backends:
        for name in JOBS:
            for killed in (False, True):
                key = f"{name}_killed" if killed else name
                out.setdefault(b, {})[key] = arms.prepare_job(
                    JOB, os.path.join(work, "jobs-bigstate", b, key),
                    {"name": f"bigstate_{key}", "backend": b,
                     "standby": "on" if killed else "auto",
                     "checkpoint": {"background": True},
                     "model": {"args": dict(size, frozen=name == "frozen")},
                     "data": {"args": {"examples": cfg.bigstate_examples, "features": 1024}}})
    return out


def restore_files(tier: str, c) -> list[str]:
    """Every file a restore of checkpoint ``c`` of ``tier`` reads: its folder's, and each blob
    its manifest names, once (docs/checkpoint-format.md)."""
    own = [os.path.join(c.path, n) for n in sorted(os.listdir(c.path))
           if os.path.isfile(os.path.join(c.path, n))]
    chunks = sorted({h for r in c.array_refs.values() for h, _ in r.chunks})
    return own + [os.path.join(tier, blobs.blob_key(h)) for h in chunks]


def dd_seconds(paths: list[str]) -> tuple[float, int]:
    """(seconds, bytes) for ``dd`` reading each file to /dev/null: the disk's (or the page
    cache's, as for the restore that read it just before) rate."""
    t0, total = time.perf_counter(), 0
    for p in paths:
        total += os.path.getsize(p)
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=8M"], capture_output=True,
                       check=True)
    return round(time.perf_counter() - t0, 3), total


def _ours(run_dir: str) -> dict:
    """Bytes per checkpoint and the restore's ``dd`` twin from the run directory."""
    events = Journal(os.path.join(run_dir, "events.jsonl")).events()
    out = {"state_bytes": [e["state_bytes"] for e in events
                           if e["event"] == "checkpoint_committed" and e.get("state_bytes")],
           "bytes_uploaded": [e["bytes_uploaded"] for e in events
                              if e["event"] == "checkpoint_durable" and "bytes_uploaded" in e]}
    tier = os.path.join(run_dir, "checkpoints")
    kept = sorted(n for n in os.listdir(tier) if n.isdigit()) if os.path.isdir(tier) else []
    out["tier_bytes"] = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in
                            os.walk(tier) for n in names) if kept else None
    out["tier_checkpoints"] = len(kept)
    if kept:
        newest = CheckpointStore(tier).list()[-1]
        out["dd_s"], out["dd_bytes"] = dd_seconds(restore_files(tier, newest))
    return out


def run(cfg, work: str, backends: tuple, say) -> dict:
    """Every arm of both jobs on ``backends``, each backend's run of an arm beside the other's."""
    if not cfg.bigstate_width:
        say("bigstate: not in this mode")
        return {}
    jobs = prepare(cfg, work, backends)
    arms_by = {b: tuple(a for a in ARMS if a != "orbax" or b in ORBAX_BACKENDS)
               for b in backends}
    out: dict = {b: {"jobs": {}} for b in backends}
    for job in JOBS:
        for _, b, arm in side_by_side(arms_by, 1):
            where = os.path.join(work, "bigstate", b, job, arm)
            env = arms.backend_env(b)
            if arm.startswith("orchestrator"):
                killed = arm == "orchestrator_killed"
                r = arms.run_orchestrator(jobs[b][f"{job}_killed" if killed else job], where,
                                          plan=arms.KillPlan(after_checkpoint=1)
                                          if killed else None,
                                          timeout=cfg.bigstate_timeout_s, env=env)
                r.update(_ours(where))
            else:
                r = arms.run_keras(jobs[b][job], where, backup=arm == "keras_fit_backup",
                                   orbax=arm == "orbax", timeout=cfg.bigstate_timeout_s,
                                   env=env)
            out[b]["jobs"].setdefault(job, {})[arm] = r
            _free(where)
            say(f"bigstate {job} {b} {arm}: rc {r['rc']}, {r['wall_s']:.1f} s wall, training "
                f"{r.get('train_s')} s, peak RSS {r.get('worker_peak_rss_mb') or r.get('peak_rss_mb')}"
                f" MiB, stalls {(r.get('checkpoints') or {}).get('stall_ms') or (r.get('saves') or {}).get('ms')}")
    for b in backends:
        out[b]["model"] = {job: model_bytes(dict(cfg_args(cfg)), job == "frozen") for job in JOBS}
    return out


def _free(where: str) -> None:
    """Delete an arm's checkpoints, export and saves once measured (its journal stays), and
    our local tier: the full bench wrote ~77 GB when each arm kept its own (the machine has
    less to spare)."""
    journal = os.path.join(where, "events.jsonl")
    local = {os.path.dirname(os.path.dirname(e["path"]))
             for e in (Journal(journal).events() if os.path.exists(journal) else ())
             if e.get("event") == "checkpoint_committed" and e.get("path")}
    for d in [os.path.join(where, n) for n in os.listdir(where)
              if os.path.isdir(os.path.join(where, n)) and n != "attempts"] + sorted(local):
        shutil.rmtree(d, ignore_errors=True)


def cfg_args(cfg) -> dict:
    return {"features": 1024, "width": cfg.bigstate_width, "hidden": cfg.bigstate_hidden}


def _arm_summary(r: dict) -> dict:
    ours = "checkpoints" in r
    stalls = (r["checkpoints"]["stall_ms"] if ours else (r.get("saves") or {}).get("ms")) or []
    if ours:
        written = r.get("bytes_uploaded") or r.get("state_bytes") or []
    else:
        written = (r.get("saves") or {}).get("bytes") or []
    return {"rc": r["rc"], "train_s": r.get("train_s"), "fit_s": r.get("fit_s"),
            "stall_ms": median(stalls), "stall_spread": spread(stalls), "n": len(stalls),
            "write_ms": median((r.get("checkpoints") or {}).get("write_ms") or []),
            "bytes_per_checkpoint": median(written),
            "bytes_counted": ("uploaded" if r.get("bytes_uploaded") else "state") if ours
            else "directory",
            "peak_rss_mb": r.get("worker_peak_rss_mb") or r.get("peak_rss_mb"),
            "fingerprint": r.get("fingerprint")}


def summary(part: dict) -> dict:
    """Per backend and job: each arm's figures, and the killed run's recovery."""
    out: dict = {}
    for b, res in part.items():
        for job, runs in (res.get("jobs") or {}).items():
            s = {arm: _arm_summary(r) for arm, r in runs.items()}
            k = runs.get("orchestrator_killed") or {}
            rec = (k.get("recoveries") or [{}])[0]
            cold = (k.get("startup") or {}).get("total")
            s["recovery"] = {
                "kill_to_first_step_s": rec.get("total"), "cold_start_s": cold,
                "ratio": None if not cold or rec.get("total") is None
                else round(rec["total"] / cold, 3), "path": rec.get("path"),
                "restore_s": rec.get("restored"), "dd_s": k.get("dd_s"),
                "dd_bytes": k.get("dd_bytes"),
                "standby_rss_mb": median(k.get("standby_rss_mb") or []),
                "exact": None if not k.get("fingerprint") else
                k["fingerprint"] == (runs.get("orchestrator") or {}).get("fingerprint")}
            s["model"] = (res.get("model") or {}).get(job)
            out.setdefault(b, {})[job] = s
    return out


def markdown(s: dict, rows_of) -> list[str]:
    """Section 6: one table of the arms per backend and job, the recoveries, the targets
    (``rows_of(job summary)``: bench/targets.bigstate_rows)."""
    if not s:
        return []
    out = ["### 6. Big states (issue 37)", "",
           "The bench's MLP (`bench/bigstate`), a checkpoint every 8 steps: **trained** whole "
           "with Adam, and **frozen** (the backbone's `trainable` False, the head trained). "
           "Stall: ours, the worker's `checkpoint_written.stall_ms`; BackupAndRestore's, each "
           "save's time (it blocks the training thread); Orbax's, the async `save` call. "
           "Bytes per checkpoint: ours, the state's size from each manifest (or "
           "`checkpoint_durable.bytes_uploaded` where the format writes it); the others', "
           "their directory after each save. Training = first step -> last epoch (ours: last "
           "commit; Orbax's: `fit` returned, its last async save waited for).", ""]
    for b, jobs in s.items():
        for job, x in jobs.items():
            m = x.get("model") or {}
            rows = [[ARM_LABELS[a], fmt_s(x[a]["train_s"], 1), fmt_s(x[a]["fit_s"], 1),
                     "-" if x[a]["stall_ms"] is None else
                     f"{x[a]['stall_ms']:.1f} ({x[a]['stall_spread'][0]:.1f}-"
                     f"{x[a]['stall_spread'][1]:.1f}, n={x[a]['n']})",
                     fmt_s(x[a]["write_ms"], 0),
                     "-" if x[a]["bytes_per_checkpoint"] is None else
                     f"{x[a]['bytes_per_checkpoint'] / 2**20:.1f}",
                     fmt_s(x[a]["peak_rss_mb"], 0), x[a]["rc"]]
                    for a in ARMS if a in x]
            out += [f"#### {job}, {b} (weights {m.get('weights', 0) / 2**20:.0f} MiB, state "
                    f"{m.get('state', 0) / 2**20:.0f} MiB, changed per step "
                    f"{m.get('changed', 0) / 2**20:.1f} MiB)", "",
                    md_table(["arm", "training (s)", "fit returned (s)",
                              "stall per checkpoint (ms): median (min-max, n)",
                              "write (ms, median)", "bytes per checkpoint (MiB)",
                              "peak RSS (MiB)", "rc"], rows), ""]
            r = x["recovery"]
            out += [f"Killed once after a checkpoint: kill -> next first step "
                    f"{fmt_s(r['kill_to_first_step_s'])} s against a cold start of "
                    f"{fmt_s(r['cold_start_s'])} s ({fmt_ratio(r['ratio'])}, path "
                    f"{r['path']}); restore {fmt_s(r['restore_s'])} s against `dd` of the "
                    f"same {0 if r['dd_bytes'] is None else r['dd_bytes'] / 2**20:.0f} MiB "
                    f"{fmt_s(r['dd_s'])} s; the standby held {fmt_s(r['standby_rss_mb'], 0)} "
                    f"MiB when ready; final weights = the fault-free run's: {r['exact']}.", ""]
            out += [md_table(["target", "limit", "measured", "result"],
                             [[w["what"], w["target"], w["measured"],
                               {True: "pass", False: "**FAIL**", None: "-"}[w["passed"]]]
                              for w in rows_of(x)]), ""]
    return out

"""A tiny stand-in for orchestrator.train.worker that never imports TensorFlow.

It runs 10 steps per epoch (global step = 10 x epochs done; a checkpoint is keyed by it),
fires injected faults at those steps through the real orchestrator.recovery.faults, registers the stack
dump, commits one checkpoint per epoch through the real CheckpointStore, and misbehaves as the
plan in $FAKE_PLAN (JSON) says, per attempt number:
  {"epoch_s": 0.05,
   "exit": {"1": 1},            attempt 1 exits with code 1 right after start
   "error": {"1": {"type": ..., "message": ...}}  attempt 1 records this error, exits 1
   "exit_at_epoch": {"2": [3, -9]}, attempt 2 SIGKILLs itself when epoch 3 would begin
                                ([3, -9, 1]: only its rank 1, in a group of workers)
   "sleep_forever": ["3"],      attempt 3 never finishes (and never beats)
   "batches": 5,                heartbeats per epoch (up to 10), as the real worker's batches
   "mid_epoch": true,           also commit a checkpoint in the middle of each epoch
   "stop_early": {"1": 2},      attempt 1 ends training after epoch 2, as EarlyStopping does
   "child": ["1"],              attempt 1 starts a child in its process group (a data loader)
   "ignore_sigterm": ["1"],     attempt 1 ignores SIGTERM (only SIGKILL stops it)
   "allocate_mb": {"1": 300},   attempt 1 allocates 300 MiB (an OOM kill under a cgroup limit)
   "standby_warm_s": 0.3,       a standby (--standby) warms up this long, then waits on stdin
   "standby_exit": {"3": 1},    the standby meant for attempt 3 exits 1 while warming up
   "await_standby": true}       exit_at_epoch waits (up to 60 s) until the next attempt's
                                standby is ready: a warm recovery however slow its start-up
With --standby MODE it is a standby: it journals ``standby_ready``, waits for the promotion
line on stdin as the real one does (train/standby.py) and then trains as the attempt it names.
Like the real worker it journals ``worker_ready`` (with steps_per_epoch) and ``first_step``,
beats ``heartbeat.json`` with epoch/batch, and prints TensorFlow-like log noise to its output.
Each attempt writes fake-N.pid and fake-N.env.json (the recovery overrides it was given).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback

import numpy as np

T_START = time.time()  # the real worker's first_step counts its start-up from here too

from orchestrator.checkpoint import tiers
from orchestrator.recovery.faults import Injector
from orchestrator.core.heartbeat import HeartbeatWriter, Position, register_stack_dump
from orchestrator.core.journal import Journal
from orchestrator.core.osutil import write_atomic, write_json_atomic
from orchestrator.core.rundir import RunDir, export_staging
from orchestrator.core.specload import load
from orchestrator.train.outcome import write_error_record

STEPS = 10
EXIT_PREEMPTED = 143
TERM = {"at": None, "training": False}  # SIGTERM: save at the next step, as the real worker


def _on_sigterm(signum, frame):
    TERM["at"] = TERM["at"] or time.time()
    if not TERM["training"]:
        sys.exit(EXIT_PREEMPTED)



def _await_standby(journal_path: str, attempt: int, bound_s: float = 60.0) -> None:
    """Until the standby meant for ``attempt`` journals standby_ready (or the bound passes)."""
    deadline = time.time() + bound_s
    while time.time() < deadline:
        if any(e.get("for_attempt") == attempt
               for e in Journal(journal_path).iter("standby_ready")):
            return
        time.sleep(0.05)

def main():
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--standby")
    a = p.parse_args()
    register_stack_dump()
    plan = json.loads(os.environ.get("FAKE_PLAN", "{}"))
    if a.standby:
        a.attempt = _stand_by(a, plan)
    n = str(a.attempt)
    spec = load(a.job, run_dir=a.run_dir)
    rd = RunDir.for_spec(spec)
    try:  # for the tests; the run directory may be down (a Drive outage test)
        write_atomic(os.path.join(rd.root, f"fake-{n}.pid"), str(os.getpid()).encode())
        write_json_atomic(os.path.join(rd.root, f"fake-{n}.env.json"),
                          {k: v for k, v in os.environ.items() if k.startswith("ORCHESTRATOR_")})
    except OSError as exc:
        print(f"[fake] run directory unreachable at start: {exc}", flush=True)
    print("2026-01-01 00:00:00.000000: I tensorflow/core/util/port.cc:153] oneDNN custom "
          "operations are on.", file=sys.stderr, flush=True)
    if n in plan.get("allocate_mb", {}):  # grow until the memory cgroup's OOM killer strikes
        held = [b"x" * (1 << 20) for _ in range(int(plan["allocate_mb"][n]))]  # noqa: F841
    if n in plan.get("ignore_sigterm", []):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, _on_sigterm)
    if n in plan.get("child", []):
        child = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                  "time.sleep(3600)"])
        write_atomic(os.path.join(rd.root, f"fake-{n}.child"), str(child.pid).encode())
    if n in plan.get("exit", {}):
        code = plan["exit"][n]
        write_json_atomic(rd.error_record(a.attempt), {
            "attempt": a.attempt, "type": "RuntimeError", "message": f"planned exit {code}",
            "epoch": 0, "batch": 0})
        sys.exit(code)
    if n in plan.get("error", {}):
        write_json_atomic(rd.error_record(a.attempt), dict(
            {"attempt": a.attempt, "epoch": 0, "batch": 0}, **plan["error"][n]))
        sys.exit(1)
    if n in plan.get("sleep_forever", []):
        while True:
            time.sleep(1)
    progress = Position()
    try:
        train(spec, rd, a.attempt, plan, progress)
    except Exception as exc:  # noqa: BLE001 - recorded like the real worker does
        write_error_record(rd, a.attempt, exc, progress, fatal=False)
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def _stand_by(a, plan) -> int:
    """Warm up, journal standby_ready, wait for the promotion line; the attempt it names. A
    line during the warm-up adopts it (the real Promotion): it trains at once, never ready."""
    from orchestrator.train.promotion import Promotion

    spec = load(a.job, run_dir=a.run_dir)
    rd = RunDir.for_spec(spec)
    write_atomic(os.path.join(rd.root, f"fake-standby-{a.attempt}.pid"),
                 str(os.getpid()).encode())
    promotion = Promotion(sys.stdin, os.getpriority(os.PRIO_PROCESS, 0))
    promotion.arrived.wait(plan.get("standby_warm_s", 0.05))
    if promotion.closed():
        sys.exit(0)
    if not promotion.adopted():
        code = plan.get("standby_exit", {}).get(str(a.attempt))
        if code is not None:
            print(f"[fake standby] failed to warm up (planned exit {code})", flush=True)
            sys.exit(code)
        Journal(rd.journal).append("standby_ready", source="worker", for_attempt=a.attempt,
                                   pid=os.getpid(), mode=a.standby)
    order = promotion.wait()
    if order is None:
        sys.exit(0)
    return order["attempt"]


def _rank() -> int:
    """A rank of a group (TF_CONFIG, as the real worker reads it); 0 alone."""
    raw = os.environ.get("TF_CONFIG")
    return int(json.loads(raw)["task"]["index"]) if raw else 0


def train(spec, rd, attempt, plan, progress):
    n = str(attempt)
    rank = _rank()  # ranks > 0 journal and beat in their own folder and commit nothing
    os.makedirs(rd.for_rank(rank), exist_ok=True)
    journal = Journal(os.path.join(rd.for_rank(rank), "events.jsonl"))
    heart = HeartbeatWriter(rd.for_rank(rank), attempt, interval=0.0)
    heart.beat(phase="starting")
    injector = Injector.from_env(rd.control, attempt, journal)
    store = injector.wrap_store(tiers.for_spec(spec))
    skipped = []
    latest = store.latest_valid(on_skip=lambda c, why: skipped.append((c, why)))
    for c, why in skipped:  # as the real worker does
        journal.append("checkpoint_skipped", source="worker", attempt=attempt, step=c.step,
                       path=c.path, reason=why)
    start = latest.epoch if latest else 0
    history = latest.manifest.get("history", []) if latest else []
    stop = plan.get("exit_at_epoch", {}).get(n)
    batches = int(plan.get("batches", 1))
    journal.append("worker_ready", source="worker", attempt=attempt, strategy="fake",
                   steps_per_epoch=batches, resumed_from_epoch=start, pid=os.getpid())
    TERM["training"] = True

    def commit(*args, **kw):
        return store.commit(*args, **kw) if rank == 0 else None

    for epoch in range(start + 1, spec.epochs + 1):
        progress.epoch = epoch - 1
        if stop and epoch == stop[0] and (len(stop) < 3 or stop[2] == rank):
            if plan.get("await_standby"):
                _await_standby(rd.journal, attempt + 1)
            if stop[1] < 0:
                os.kill(os.getpid(), -stop[1])
            sys.exit(stop[1])

        # the state, as a real worker writes it (one array's blobs): its bytes say the epoch
        weights = {"model.0000": np.frombuffer(f"weights after epoch {epoch}".encode(),
                                               dtype=np.uint8)}

        for step in range(1, STEPS + 1):
            time.sleep(plan.get("epoch_s", 0.02) / STEPS)
            if epoch == start + 1 and step == 1:
                journal.append("first_step", source="worker", attempt=attempt,
                               since_start_s=round(time.time() - T_START, 3))
            progress.batch, progress.step = step, (epoch - 1) * STEPS + step
            batch = step * batches // STEPS  # the batches of the plan, spread over the steps
            if batch > (step - 1) * batches // STEPS:
                heart.beat(phase="training", epoch=epoch - 1, batch=batch)
            injector.at_step(progress.step)
            if TERM["at"] and step < STEPS:  # a preemption notice: save here, exit
                commit(progress.step, None, {"attempt": attempt, "epoch": epoch - 1,
                                                      "batch": step, "history": list(history)},
                             keep=spec.checkpoint.keep, arrays=weights)
                journal.append("preempted", source="worker", attempt=attempt,
                               step=progress.step, epoch=epoch - 1, batch=step)
                sys.exit(EXIT_PREEMPTED)
            if plan.get("mid_epoch") and step == STEPS // 2:
                commit(epoch * STEPS - 5, None, {"attempt": attempt, "epoch": epoch - 1,
                                                          "batch": 5, "history": list(history)},
                             keep=spec.checkpoint.keep, arrays=weights)
        history.append({"epoch": epoch, "loss": 1.0 / epoch})
        early = plan.get("stop_early", {}).get(n) == epoch
        commit(epoch * STEPS, None, {"attempt": attempt, "epoch": epoch,
                                              "history": list(history), "stopped_early": early,
                                              "weights_sha256": f"fake-{epoch}"},
                     keep=spec.checkpoint.keep, arrays=weights)
        if early:
            break
    if n in plan.get("killed_exporting", []):  # the real export's first step, then SIGKILL
        os.makedirs(export_staging(rd.export))
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()

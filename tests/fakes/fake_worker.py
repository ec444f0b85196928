"""A tiny stand-in for orchestrator.worker that never imports TensorFlow.

It commits one checkpoint per "epoch" through the real CheckpointStore, and misbehaves as the
plan in $FAKE_PLAN (JSON) says, per attempt number:
  {"epoch_s": 0.05,
   "exit": {"1": 1},            attempt 1 exits with code 1 right after start
   "exit_at_epoch": {"2": [3, -9]}, attempt 2 SIGKILLs itself when epoch 3 would begin
   "sleep_forever": ["3"],      attempt 3 never finishes
   "batches": 5,                heartbeats per epoch, as the real worker's batches
   "mid_epoch": true,           also commit a checkpoint in the middle of each epoch
   "stop_early": {"1": 2}}      attempt 1 ends training after epoch 2, as EarlyStopping does
Like the real worker it journals ``worker_ready`` (with steps_per_epoch) and ``first_step``,
beats ``heartbeat.json`` with epoch/batch, and prints TensorFlow-like log noise to its output.
"""
import argparse
import json
import os
import signal
import sys
import time

from orchestrator.checkpoints import CheckpointStore
from orchestrator.heartbeat import HeartbeatWriter
from orchestrator.journal import Journal
from orchestrator.osutil import write_json_atomic
from orchestrator.rundir import RunDir
from orchestrator.spec import load


def main():
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--attempt", type=int, required=True)
    a = p.parse_args()
    plan = json.loads(os.environ.get("FAKE_PLAN", "{}"))
    n = str(a.attempt)
    spec = load(a.job, run_dir=a.run_dir)
    rd = RunDir(spec.run_dir)
    with open(os.path.join(rd.root, f"fake-{n}.pid"), "w") as f:
        f.write(str(os.getpid()))
    print("2026-01-01 00:00:00.000000: I tensorflow/core/util/port.cc:153] oneDNN custom "
          "operations are on.", file=sys.stderr, flush=True)
    if n in plan.get("exit", {}):
        code = plan["exit"][n]
        write_json_atomic(rd.error_record(a.attempt), {
            "attempt": a.attempt, "type": "RuntimeError", "message": f"planned exit {code}",
            "epoch": 0, "batch": 0})
        sys.exit(code)
    if n in plan.get("sleep_forever", []):
        while True:
            time.sleep(1)
    store = CheckpointStore(rd.checkpoints)
    latest = store.latest_valid()
    start = latest.epoch if latest else 0
    history = latest.manifest.get("history", []) if latest else []
    stop = plan.get("exit_at_epoch", {}).get(n)
    batches = int(plan.get("batches", 1))
    journal = Journal(rd.journal)
    heart = HeartbeatWriter(rd.root, a.attempt, interval=0.0)
    journal.append("worker_ready", source="worker", attempt=a.attempt, strategy="fake",
                   steps_per_epoch=batches, resumed_from_epoch=start)
    for epoch in range(start + 1, spec.epochs + 1):
        if stop and epoch == stop[0]:
            if stop[1] < 0:
                os.kill(os.getpid(), -stop[1])
            sys.exit(stop[1])
        for b in range(1, batches + 1):
            time.sleep(plan.get("epoch_s", 0.02) / batches)
            if epoch == start + 1 and b == 1:
                journal.append("first_step", source="worker", attempt=a.attempt)
            heart.beat(phase="training", epoch=epoch - 1, batch=b)

        def payload(d, epoch=epoch):
            with open(os.path.join(d, "state.npz"), "wb") as f:
                f.write(f"weights after epoch {epoch}".encode())

        if plan.get("mid_epoch"):
            store.commit(epoch * 10 - 5, payload, {"attempt": a.attempt, "epoch": epoch - 1,
                                                   "batch": 5, "history": list(history)},
                         keep=spec.checkpoint.keep)
        history.append({"epoch": epoch, "loss": 1.0 / epoch})
        early = plan.get("stop_early", {}).get(n) == epoch
        store.commit(epoch * 10, payload, {"attempt": a.attempt, "epoch": epoch,
                                      "history": list(history), "stopped_early": early,
                                      "weights_sha256": f"fake-{epoch}"},
                     keep=spec.checkpoint.keep)
        if early:
            break
    sys.exit(0)


if __name__ == "__main__":
    main()

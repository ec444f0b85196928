"""Measure what a failing durable tier costs training: runs A (Drive healthy) and B (Drive
down with ENOTCONN for a stretch of epochs mid-run) alternated A B A B ..., side by side.

    .venv/bin/python scripts/bench_durable.py [--pairs 2] [--epochs 12] [--job cifar|digits]

Training time = journal ``first_step`` -> last ``checkpoint_committed`` (the worker's training,
start-up and export excluded). Each B run must end with every checkpoint retention keeps
present and verified in the durable tier. The supervisor runs in this process, so the fault is
injected at its filesystem-call boundary (tests/drivefaults.py); the worker is a real one.
"""
import argparse
import errno
import io
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]

from drivefaults import DriveFaults  # noqa: E402
from orchestrator.checkpoint import tiers  # noqa: E402
from orchestrator.core.journal import Journal  # noqa: E402
from orchestrator.core.specload import load  # noqa: E402
from orchestrator.supervise.compose import Commands  # noqa: E402
from orchestrator.supervise.supervisor import Supervisor  # noqa: E402

JOBS = {
    "cifar": ("cifar10_resnet", lambda t, e: t.replace("args: {synthetic: false}",
              "args: {synthetic: true, synthetic_examples: 640}")
              .replace("epochs: 200", f"epochs: {e}").replace("batch_size: 128", "batch_size: 32")
              .replace("strategy: auto", "strategy: cpu")),
    "digits": ("digits", lambda t, e: t.replace("epochs: 10", f"epochs: {e}")
               .replace("strategy: auto", "strategy: cpu")),
}
CKPT = ("checkpoint: {every_epochs: 1, keep: 3, keep_every_epochs: 4, "
        "upload_backoff: {initial: 0.2, max: 2}}\n")


def one_run(kind: str, job_name: str, edit, epochs: int, work: str, outage: tuple) -> dict:
    d = tempfile.mkdtemp(prefix=f"bench-{kind}-", dir=work)
    src = os.path.join(ROOT, "jobs", job_name)
    for n in os.listdir(src):
        shutil.copy(os.path.join(src, n), d)
    text = edit(open(os.path.join(d, "job.yaml")).read(), epochs)
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("checkpoint"))
    open(os.path.join(d, "job.yaml"), "w").write(text + "\n" + CKPT)
    spec = load(os.path.join(d, "job.yaml"), run_dir=os.path.join(d, "run"))
    journal = Journal(os.path.join(spec.run_dir, "events.jsonl"))

    def count(ev):
        return sum(1 for _ in journal.iter(ev))

    with DriveFaults(os.path.join(spec.run_dir, "checkpoints")) as drive:
        def fail_for_a_while():
            while count("checkpoint_durable") < outage[0]:
                time.sleep(0.01)
            drive.down(errno.ENOTCONN)
            t0 = time.time()
            while count("checkpoint_committed") < outage[1]:
                time.sleep(0.01)
            drive.up()
            stats["down_s"] = round(time.time() - t0, 2)

        stats = {}
        cpu0 = time.process_time()
        if kind == "B":
            threading.Thread(target=fail_for_a_while, daemon=True).start()
        rc = Supervisor(spec, out=io.StringIO(), commands=Commands(export=None)).run()
        stats["supervisor_cpu_s"] = round(time.process_time() - cpu0, 2)
    ev = journal.events()
    commits = [e["ts"] for e in ev if e["event"] == "checkpoint_committed"]
    stats["epoch_s"] = [round(b - a, 2) for a, b in zip(commits, commits[1:])]
    first = next(e["ts"] for e in ev if e["event"] == "first_step")
    last = max(e["ts"] for e in ev if e["event"] == "checkpoint_committed")
    store = tiers.for_spec(spec)
    durable = sorted(c.epoch for c in store.durable.list() if store.durable.verify(c.path) is None)
    due = sorted({e for e in range(1, epochs + 1) if e % 4 == 0} | set(range(epochs - 2,
                                                                            epochs + 1)))
    return {"kind": kind, "rc": rc, "train_s": round(last - first, 3), "durable": durable,
            "due_ok": durable == due, **stats,
            "unreachable": sum(e["event"] == "durable_unreachable" for e in ev),
            "restored": sum(e["event"] == "durable_restored" for e in ev),
            "attempts": sum(e["event"] == "attempt_started" for e in ev)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--job", choices=JOBS, default="cifar")
    a = p.parse_args()
    name, edit = JOBS[a.job]
    outage = (2, a.epochs - 3)  # down after the 2nd durable copy, up 3 epochs before the end
    work = tempfile.mkdtemp(prefix="bench-durable-")
    results = []
    for i in range(a.pairs):
        for kind in ("A", "B"):
            r = one_run(kind, name, edit, a.epochs, work, outage)
            print(r, flush=True)
            results.append(r)
    shutil.rmtree(work, ignore_errors=True)
    ta = [r["train_s"] for r in results if r["kind"] == "A"]
    tb = [r["train_s"] for r in results if r["kind"] == "B"]
    grow = (statistics.mean(tb) / statistics.mean(ta) - 1) * 100
    print(f"A (healthy) train s: {ta}  mean {statistics.mean(ta):.3f}")
    print(f"B (Drive down mid-run) train s: {tb}  mean {statistics.mean(tb):.3f}")
    print(f"training time grew by {grow:+.2f} %; every due checkpoint durable and verified in "
          f"all B runs: {all(r['due_ok'] and r['rc'] == 0 for r in results)}")
    return 0 if all(r["due_ok"] and r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

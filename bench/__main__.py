"""The benchmark: overhead, recovery time, goodput under kills and footprint of the orchestrator,
side by side with a plain Keras script (with and without BackupAndRestore, and in a shell
restart loop), on the digits job and a larger synthetic ResNet job. Run it with ``scripts/bench``
(``--quick`` for a smoke run); it writes ``bench/results.{md,json}`` and BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from . import arms, report
from .stats import interleaved

ARMS = ("orchestrator", "keras_fit_backup", "keras_fit")
# The checkpoint writer side by side: background (``checkpoint.background: true``, the default,
# which the bench's orchestrator arms say explicitly) and in line, on the job the stall target
# is about (ResNet-20).
SYNC_ARM, SYNC_JOBS = "orchestrator_sync", ("synthetic",)
PARTS = ("overhead", "goodput", "recovery", "standby")


@dataclass(frozen=True)
class Config:
    mode: str
    reps: int              # runs of each arm per job for the overhead (interleaved)
    digits_epochs: int
    synth_examples: int    # synthetic CIFAR-sized images (1/8 of them for validation)
    synth_epochs: int
    recovery_kills: int    # kills in the digits recovery run
    fault_reps: int        # runs each with a raised accelerator error and with a hang
    goodput_reps: int      # runs of each goodput arm (interleaved)
    kill_every_s: float    # mean gap of the seeded SIGKILL schedule
    kills: int
    hang_timeout_s: float
    standby_epochs: int = 40  # digits, long enough for a standby to warm up behind the worker
    standby_kills: int = 1
    standby_synth_epochs: int = 0  # the synthetic ResNet too (0: not in this mode)
    seed: int = 20261202


FULL = Config("full", reps=3, digits_epochs=10, synth_examples=768, synth_epochs=6,
              recovery_kills=3, fault_reps=3, goodput_reps=2, kill_every_s=15.0, kills=2,
              hang_timeout_s=6.0, standby_epochs=60, standby_kills=2,
              standby_synth_epochs=16)
QUICK = Config("quick", reps=1, digits_epochs=4, synth_examples=384, synth_epochs=3,
               recovery_kills=1, fault_reps=1, goodput_reps=1, kill_every_s=12.0, kills=1,
               hang_timeout_s=5.0)
RESTARTS = {"max": 10, "backoff": {"initial": arms.RESTART_DELAY_S, "max": arms.RESTART_DELAY_S}}


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def faults_available() -> bool:
    """Does this orchestrator have ``run --fault`` (fault injection, issue 3)?"""
    out = subprocess.run([sys.executable, "-m", "orchestrator", "run", "--help"],
                         capture_output=True, text=True, cwd=arms.ROOT)
    return "--fault" in out.stdout


def prepare_jobs(cfg: Config, work: str, faults: bool) -> dict[str, str]:
    """The two jobs with the bench's restart policy (and, for hangs, a short hang_timeout)."""
    digits_src = os.path.join(arms.ROOT, "jobs", "digits", "job.yaml")
    jobs = {
        "digits": arms.prepare_job(digits_src, os.path.join(work, "jobs", "digits"),
                                   {"restarts": RESTARTS, "epochs": cfg.digits_epochs,
                                    "checkpoint": {"background": True}}),
        "synthetic": arms.prepare_job(
            os.path.join(arms.ROOT, "jobs", "cifar10_resnet", "job.yaml"),
            os.path.join(work, "jobs", "synthetic"),
            {"name": "synthetic_resnet20", "restarts": RESTARTS, "epochs": cfg.synth_epochs,
             "checkpoint": {"background": True},
             "deterministic": True,  # what the bit-identity promise needs (both arms get it)
             "data": {"args": {"synthetic": True, "synthetic_examples": cfg.synth_examples}}}),
    }
    for mode in ("auto", "off"):  # the same job, with and without the warm standby
        jobs[f"digits_standby_{mode}"] = arms.prepare_job(
            digits_src, os.path.join(work, "jobs", f"digits_standby_{mode}"),
            {"restarts": RESTARTS, "epochs": cfg.standby_epochs, "standby": mode})
        if cfg.standby_synth_epochs:
            jobs[f"synthetic_standby_{mode}"] = arms.prepare_job(
                os.path.join(arms.ROOT, "jobs", "cifar10_resnet", "job.yaml"),
                os.path.join(work, "jobs", f"synthetic_standby_{mode}"),
                {"name": f"synthetic_standby_{mode}", "restarts": RESTARTS,
                 "epochs": cfg.standby_synth_epochs, "deterministic": True, "standby": mode,
                 "data": {"args": {"synthetic": True,
                                   "synthetic_examples": cfg.synth_examples}}})
    for name in SYNC_JOBS:
        jobs[f"{name}_sync"] = arms.prepare_job(jobs[name], os.path.join(work, "jobs",
                                                                        f"{name}_sync"),
                                                {"checkpoint": {"background": False}})
    if faults:  # only this job: a slow first step (tracing) must not pass for a hang elsewhere
        jobs["digits_hang"] = arms.prepare_job(
            digits_src, os.path.join(work, "jobs", "digits_hang"),
            {"restarts": RESTARTS, "epochs": cfg.digits_epochs,
             "hang_timeout": cfg.hang_timeout_s})
    return jobs


def run_arm(arm: str, job: str, where: str, **kw) -> dict:
    if arm in ("orchestrator", SYNC_ARM):
        return arms.run_orchestrator(job, where, **kw)
    return arms.run_keras(job, where, backup=arm != "keras_fit", **kw)


def overhead(jobs: dict, cfg: Config, work: str) -> dict:
    out = {}
    for name in ("digits", "synthetic"):
        arms_here = ARMS[:1] + ((SYNC_ARM,) if name in SYNC_JOBS else ()) + ARMS[1:]
        runs = {a: [] for a in arms_here}
        for rep, arm in interleaved(arms_here, cfg.reps):
            job = jobs[f"{name}_sync"] if arm == SYNC_ARM else jobs[name]
            r = run_arm(arm, job, os.path.join(work, "overhead", name, f"{arm}-{rep}"))
            runs[arm].append(r)
            say(f"overhead {name} rep {rep + 1}/{cfg.reps} {arm}: rc {r['rc']}, "
                f"{r['wall_s']:.2f} s wall, {r['train_s']} s training")
        out[name] = runs
    return out


def recovery(jobs: dict, cfg: Config, work: str, faults: bool) -> dict:
    out = {"digits/kill": [arms.run_orchestrator(
        jobs["digits"], os.path.join(work, "recovery", "kill"),
        plan=arms.KillPlan(after_checkpoint=cfg.recovery_kills))]}
    say(f"recovery digits kill: {len(out['digits/kill'][0]['recoveries'])} sample(s)")
    if not faults:
        say("recovery: `orchestrator run --fault` is not in this version; raise and hang skipped")
        return out
    step = 60  # in the 2nd epoch of digits (45 steps), after a checkpoint
    for kind, fault, job in (("raise", f"raise=accelerator_context@step={step}", "digits"),
                             ("hang", f"hang@step={step}", "digits_hang")):
        out[f"digits/{kind}"] = []
        for rep in range(cfg.fault_reps):
            r = arms.run_orchestrator(jobs[job],
                                      os.path.join(work, "recovery", f"{kind}-{rep}"),
                                      extra_args=("--fault", fault))
            out[f"digits/{kind}"].append(r)
            say(f"recovery digits {kind} rep {rep + 1}: rc {r['rc']}, "
                f"{len(r['recoveries'])} sample(s), failures {r['failures']}")
    return out


def standby(jobs: dict, cfg: Config, work: str) -> dict:
    """Kill -> next first step with the standby on and off, side by side: each kill once a
    checkpoint is committed (and, with it on, once a standby is ready behind the worker)."""
    out = {}
    for job in ("digits", "synthetic"):
        for mode in ("auto", "off"):
            if f"{job}_standby_{mode}" not in jobs:
                continue
            r = arms.run_orchestrator(jobs[f"{job}_standby_{mode}"],
                                      os.path.join(work, "standby", f"{job}-{mode}"),
                                      plan=arms.KillPlan(after_checkpoint=cfg.standby_kills,
                                                         after_standby=mode == "auto"))
            out[f"{job}/{mode}"] = r
            totals = [x["total"] for x in r["recoveries"]]
            say(f"standby {job} {mode}: rc {r['rc']}, paths {r['recovery_paths']}, kill -> "
                f"first step {totals} s, cold start {r['startup'].get('total')} s, worker "
                f"peak RSS {r['worker_peak_rss_mb']} MiB, standby RSS {r['standby_rss_mb']} MiB")
    return out


def goodput(jobs: dict, cfg: Config, work: str) -> dict:
    schedule = arms.kill_schedule(cfg.seed, cfg.kill_every_s, cfg.kills)
    out = {"schedule_s": schedule, "orchestrator": [], "restart_loop": []}
    for rep, arm in interleaved(("orchestrator", "restart_loop"), cfg.goodput_reps):
        where = os.path.join(work, "goodput", f"{arm}-{rep}")
        plan = arms.KillPlan(offsets=schedule)
        if arm == "orchestrator":
            r = arms.run_orchestrator(jobs["synthetic"], where, plan=plan)
        else:
            r = arms.run_keras(jobs["synthetic"], where, backup=True, loop=True, loop_plan=plan)
        out[arm].append(r)
        say(f"goodput {arm} rep {rep + 1}: rc {r['rc']}, {r['wall_s']:.1f} s, "
            f"{len(r['kills'])} kill(s)")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a smoke run (about 3 minutes): one repetition, small jobs")
    p.add_argument("--out", default=os.path.join(arms.ROOT, "bench"),
                   help="where results.md/json (quick.md/json with --quick) go")
    p.add_argument("--work", help="scratch directory for run dirs (default: a new temp dir)")
    p.add_argument("--no-benchmarks-md", action="store_true",
                   help="do not update BENCHMARKS.md (a full run updates it by default)")
    p.add_argument("--standby-only", action="store_true",
                   help="only the standby on/off recovery comparison (prints its summary)")
    p.add_argument("--only", choices=PARTS, action="append",
                   help="run only this part (repeatable); the others are left out of the "
                        "results, and BENCHMARKS.md is not updated")
    args = p.parse_args(argv)
    parts = args.only or PARTS
    cfg = QUICK if args.quick else FULL
    work = args.work or tempfile.mkdtemp(prefix="orchestrator-bench-")
    faults = faults_available()
    jobs = prepare_jobs(cfg, work, faults)
    say(f"{cfg.mode} run in {work}; faults injection {'available' if faults else 'absent'}")
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True)  # warm cache
    results = {"config": asdict(cfg), "machine": report.machine(), "work_dir": work,
               "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
               "faults_injection": faults, "jobs": {k: report.read_job(p) for k, p in jobs.items()}}
    stem = ("quick" if args.quick else "results") + ("-" + "-".join(args.only) if args.only
                                                     else "")
    json_path = os.path.join(args.out, f"{stem}.json")

    def save():
        results["duration_s"] = round(time.time() - t0, 1)
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)

    if args.standby_only:
        results["standby"] = standby(jobs, cfg, work)
        print(json.dumps(report.standby_summary(results), indent=1))
        return 0
    results["overhead"] = overhead(jobs, cfg, work) if "overhead" in parts else {}
    save()
    results["goodput"] = goodput(jobs, cfg, work) if "goodput" in parts else {}
    save()
    results["recovery"] = recovery(jobs, cfg, work, faults) if "recovery" in parts else {}
    results["standby"] = standby(jobs, cfg, work) if "standby" in parts else {}
    results["machine"]["load_after"] = report.machine()["load"]
    save()
    summary = report.summarise(results)
    results["summary"] = summary
    save()
    md = report.markdown(results)
    with open(os.path.join(args.out, f"{stem}.md"), "w", encoding="utf-8") as f:
        f.write(md)
    if not args.quick and not args.no_benchmarks_md and not args.only:
        report.update_benchmarks(os.path.join(arms.ROOT, "BENCHMARKS.md"), md)
    say(f"done in {results['duration_s']:.0f} s: {json_path}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

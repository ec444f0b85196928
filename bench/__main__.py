"""The benchmark: overhead, recovery time, goodput under kills and footprint of the orchestrator,
side by side with a plain Keras script (with and without BackupAndRestore, and in a shell
restart loop), on the digits job and a larger synthetic ResNet job, on TensorFlow and on JAX in
one run. Run it with ``scripts/bench`` (``--quick`` for a smoke run; ``--backends`` to measure
one backend); it writes ``bench/results.{md,json}`` and BENCHMARKS.md.

Each backend's arms run beside the other's (``stats.side_by_side``): the machine's speed drifts
from one hour to the next, so the two backends are compared on runs made minutes apart, never
on two runs of the bench. TensorFlow's results stay where they were (``results["overhead"]``,
...), JAX's are under ``results["jax"]``, in the same shape.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

from orchestrator.core import backends as core_backends
from orchestrator.core.kinds import Kind

from . import arms, bigstate, report
from .stats import side_by_side

ARMS = ("orchestrator", "keras_fit_backup", "keras_fit")
# The checkpoint writer side by side: background (``checkpoint.background: true``, the default,
# which the bench's orchestrator arms say explicitly) and in line, on the job the stall target
# is about (ResNet-20).
SYNC_ARM, SYNC_JOBS = "orchestrator_sync", ("synthetic",)
# The orchestrator with ``standby: off`` beside the default (auto): what checkpointing alone
# costs, apart from the standby's warm-up on the cores the worker trains on.
NOSTANDBY_ARM = "orchestrator_standby_off"
PARTS = ("overhead", "goodput", "recovery", "cache", "standby", "kills", "goodput_2min",
         "tiers", "bigstate")
# The standby section (kill -> first step, standby auto vs off) runs only when asked for: the
# goodput and recovery sections now measure the same recoveries, side by side, on both jobs.
# The compile cache's (JAX only) runs when JAX is measured. Issue 27's parts (TensorFlow only):
# kills (recovery by kind of kill, standby auto vs off), goodput_2min (a SIGKILL every ~2 min)
# and tiers (the standby's warm-up tiers); a part whose config says 0 epochs is left out of that
# mode (QUICK: goodput_2min and tiers).
DEFAULT_PARTS = ("overhead", "goodput", "recovery", "cache", "kills", "goodput_2min", "tiers",
                 "bigstate")
# Issue 27's three kinds of kill, one per attempt, in order (KillPlan.triggers):
# (a) once the first attempt has a checkpoint, 20 s on: under auto no standby is behind a run's
#     first attempt (by policy), and it starts one for attempt 3 only if the next kill is not
#     expected before it would be ready (standby_policy: the gap between kills must exceed a
#     cold start and a warm-up, ~12 s here); a kill right at the first checkpoint (a gap of one
#     cold start) would have auto start none, and kill (b) would measure nothing of the standby;
# (b) 1.5 s after the next attempt's first step: its standby (auto) has just started and is
#     still warming up (adopted or discarded);
# (c) once the standby for the next attempt is ready (standby: off, or auto deciding none: at
#     the attempt's first checkpoint, said as a fallback).
KILL_TRIGGERS = ("checkpoint+20", "first_step+1.5", "standby_ready")
BACKENDS = (core_backends.TENSORFLOW, core_backends.JAX)


@dataclass(frozen=True)
class Config:
    mode: str
    reps: int              # runs of each arm per job for the overhead (interleaved)
    digits_epochs: int
    synth_examples: int    # synthetic CIFAR-sized images (1/8 of them for validation)
    synth_epochs: int
    fault_steps: int       # recovery: kill at this step, raise at 2x, hang at 3x (digits)
    fault_epochs: int      # ... of a digits job long enough for the three and a tail
    fault_modes: tuple     # the standby settings of the recovery runs, side by side
    fault_reps: int        # recovery runs per standby setting (interleaved)
    goodput_epochs: int    # the goodput job: synthetic ResNet-20, one checkpoint per epoch
    goodput_reps: int      # runs of each goodput arm (interleaved)
    goodput_timeout_s: float  # per goodput run; the kill schedule covers it
    kill_every_s: float    # mean gap of the seeded SIGKILL schedule
    hang_timeout_s: float
    goodput_reference: bool = False  # also run the goodput job uninterrupted (both kinds)
    # plain fit with no checkpoints on ResNet-20 too (the #12 target is against fit + B&R;
    # digits always has it: the issue's 1.18x was measured there)
    synth_plain_fit: bool = True
    standby_epochs: int = 40  # --only standby: digits, long enough for a standby to warm up
    standby_kills: int = 1
    standby_synth_epochs: int = 0  # the synthetic ResNet too (0: not in this mode)
    seed: int = 20261202
    # JAX (issue 23), beside TensorFlow: the arms its targets and figures need. Overhead: the
    # orchestrator with standby: off (its cold start, the #12 training ratio) and fit +
    # BackupAndRestore; the defaults' arm and plain fit are TensorFlow's only (the standby's
    # warm-up cost is measured there, and a JAX cold start is 2-4x TensorFlow's: each JAX arm
    # costs more than the TensorFlow one). Goodput: the standby on and off; not the shell
    # loop, whose every restart compiles afresh (a plain script has no persistent compile
    # cache: ResNet-20's cold start on JAX, 22-28 s measured for issue 23, is longer than the
    # ~20 s between kills, so it would only run into its timeout).
    jax_overhead_arms: tuple = ("orchestrator_standby_off", "keras_fit_backup")
    jax_goodput_arms: tuple = ("standby_auto", "standby_off")
    cache_jobs: tuple = ("digits", "synthetic")  # the compile cache, empty vs warm (JAX)
    cache_reps: int = 1
    # Issue 27. kills: ResNet-20 (synthetic, synth_examples) killed once per trigger, one run
    # per standby setting side by side (0 epochs: not in this mode). Long enough that the
    # last kill comes before the end: ~31 s of training before it (20 + 1.5 s, a warm-up of
    # ~12 s at ~1.8x slower) and a tail.
    kills_epochs: int = 0
    kills_triggers: tuple = KILL_TRIGGERS
    # auto (the default), on (a standby behind every attempt: the one place kill (b) meets a
    # standby still warming up whatever auto decides) and off; ~+75 s (quick) for "on"
    kills_modes: tuple = ("auto", "on", "off")
    # goodput_2min: the goodput job under a SIGKILL every ~2 min (TensorFlow, the orchestrator
    # arms only: the shell loop's figure is the ~20 s table's)
    goodput_long_epochs: int = 0
    goodput_long_every_s: float = 120.0
    goodput_long_timeout_s: float = 480.0
    goodput_long_arms: tuple = ("standby_auto", "standby_off")
    # tiers: digits with each warm-up tier, killed once 5 s after its standby is ready (off:
    # 5 s after a checkpoint), so the worker's speed is measured during the warm-up and after
    tiers_epochs: int = 0
    tiers_modes: tuple = ("import_only", "on", "off")
    tiers_trigger: str = "standby_ready+5"
    # issue 37 (bench/bigstate.py): the MLP's width and hidden layers (0: not in this mode),
    # its examples (20 steps an epoch at batch 32, 2 epochs: 5 checkpoints every 8 steps and
    # one at each epoch's end) and each run's timeout
    bigstate_width: int = 0
    bigstate_hidden: int = 7
    bigstate_examples: int = 640
    bigstate_timeout_s: float = 900.0


# FULL, timed on the 2 shared cores (a quiet hour, 2026-12-04), TensorFlow alone: overhead 2.7
# min (2 reps, down from 3), goodput ~10 min (the three arms of a job with >= 2 minutes of
# training; the shell loop alone ~4 min), recovery 0.75 min per standby setting: standby off
# (the cold side by side, 1.13x / 0.99x for raise / hang) is left out for a minute of margin.
# Uninterrupted runs of the goodput job (reference weights) would add ~5 min:
# --goodput-reference. The standby comparison (--only standby) is left out: goodput measures
# kills with it on and off.
# With JAX beside it (issue 23; its arms above), the same config would take about 24 minutes
# (JAX's arms cost about as much again as TensorFlow's: its cold start is 2-4x, and it adds
# the compile cache's runs), so to stay near 15: the overhead runs once (reps 2 -> 1: -1.4
# min for TensorFlow, -2 for JAX; its ratios lose their min-max), and the goodput job trains
# 40 epochs, not 80 (about 1 minute of training; -5 min over the five goodput runs). The
# goodput figures then count the first cold start twice as much (its column in the table):
# compare them with 80-epoch runs only through that column.
# Issue 27's parts add to FULL (estimated, not yet timed; 2 cores, ResNet-20 epochs of 1.1-1.4 s
# at 768 images): kills ~3.5 min (2 runs of ~100 s: a cold start, ~40 epochs, three
# recoveries); goodput_2min ~9.5 min (2 runs of ~4-5 min: 190 epochs put the run's end past
# the seeded schedule's second kill, at 209 s (the first at 100 s), even at 1.1 s an epoch:
# 6-12 s of cold start + 209 s of training + a recovery; 170 would end at ~205 s);
# tiers ~2 min (3 digits runs of ~35 s, timed: digits trains ~0.22 s an epoch here, 2026-12-06,
# so 150 epochs put the end well past a warm-up of 7-12 s and the 5 s after it). About 15
# minutes in all.
FULL = Config("full", reps=1, digits_epochs=10, synth_examples=768, synth_epochs=6,
              fault_steps=2500, fault_epochs=187, fault_modes=("on",), fault_reps=1,
              goodput_epochs=40, goodput_reps=1, goodput_timeout_s=420.0, kill_every_s=20.0,
              hang_timeout_s=6.0, synth_plain_fit=False, standby_epochs=60, standby_kills=2,
              standby_synth_epochs=16, kills_epochs=40, goodput_long_epochs=190,
              tiers_epochs=150, bigstate_width=4096)
# QUICK's goodput job trains 48 epochs, not 16 or 32: on a quiet machine 16 took 10 s and the
# run ended before the second kill, and at 32 (2026-12-05, 21:12) every arm had one kill, cold,
# after which auto rightly started no standby (the run was expected to end first): a tie, 0.565
# against 0.571, that showed nothing of what a standby buys. At 48 the second kill (34.8 s)
# comes before the end. Issue 27 in QUICK: kills only, ~3.5 min added (3 runs of ~65-70 s: auto,
# on and off; 384 images make an epoch ~0.6-0.7 s, so 70 of them). goodput_2min is left
# out: two kills ~2 min apart need runs of ~4 min per arm (~8 min), far over a smoke run's
# minute; tiers too (~2 min): the full bench measures them.
QUICK = Config("quick", reps=1, digits_epochs=4, synth_examples=384, synth_epochs=3,
               fault_steps=2500, fault_epochs=187, fault_modes=("on",), fault_reps=1,
               goodput_epochs=48, goodput_reps=1, goodput_timeout_s=240.0, kill_every_s=20.0,
               hang_timeout_s=6.0, cache_jobs=("digits",), kills_epochs=70,
               bigstate_width=512, bigstate_hidden=3, bigstate_timeout_s=300.0)
RESTARTS = {"max": 10, "backoff": {"initial": arms.RESTART_DELAY_S, "max": arms.RESTART_DELAY_S}}
# What each recovery fault dies of, as the supervisor classifies it. The raised error is a
# storage error (a Drive mount that dropped): its whole ladder is a plain restart, which
# promotes the standby; accelerator_context's goes on to reinitialising the accelerator, an
# action that needs a fresh TensorFlow and discards the standby by design.
FAULT_KINDS = {"kill": Kind.KILLED, "raise": Kind.STORAGE, "hang": Kind.HANG}
GOODPUT_ARMS = ("standby_auto", "standby_off", "restart_loop")


def fault_specs(cfg: Config) -> dict[str, str]:
    """The recovery run's three faults, ``fault_steps`` apart: each once a standby has had time
    to warm up behind the worker that the previous fault left (about 10 s on digits)."""
    k = cfg.fault_steps
    return {"kill": f"kill@step={k}", "raise": f"raise={Kind.STORAGE}@step={2 * k}",
            "hang": f"hang@step={3 * k}"}


def parse_backends(text: str) -> tuple:
    """``tensorflow,jax`` -> ('tensorflow', 'jax'), in the order given, each once."""
    names = tuple(dict.fromkeys(x.strip().lower() for x in text.split(",") if x.strip()))
    wrong = [n for n in names if n not in BACKENDS]
    if not names or wrong:
        raise argparse.ArgumentTypeError(
            f"{text!r}: name one or more of {', '.join(BACKENDS)}, comma-separated")
    return names


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def faults_available() -> bool:
    """Does this orchestrator have ``run --fault`` (fault injection, issue 3)?"""
    out = subprocess.run([sys.executable, "-m", "orchestrator", "run", "--help"],
                         capture_output=True, text=True, cwd=arms.ROOT)
    return "--fault" in out.stdout


def prepare_jobs(cfg: Config, work: str) -> dict[str, str]:
    """The bench's jobs, each with the bench's restart policy: digits and synthetic ResNet-20
    (overhead), their standby variants, the goodput job and the recovery (faults) job."""
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
        # goodput: ResNet-20 for >= 2 minutes, a checkpoint per epoch (about 2 s of training
        # here; BackupAndRestore gets save_freq="epoch", the same)
        jobs[f"goodput_{mode}"] = arms.prepare_job(
            jobs["synthetic"], os.path.join(work, "jobs", f"goodput_{mode}"),
            {"name": f"goodput_{mode}", "epochs": cfg.goodput_epochs, "standby": mode})
    # recovery: only these jobs have a short hang_timeout (a slow first step elsewhere must not
    # pass for a hang); a checkpoint every half epoch, not every 20 steps, over 8000 steps
    # (fewer journal lines for the bench to reread while it watches). One per standby setting
    # the recovery runs ask for (cfg.fault_modes: "on", not the loop's auto/off above)
    for mode in cfg.fault_modes:
        jobs[f"faults_{mode}"] = arms.prepare_job(
            digits_src, os.path.join(work, "jobs", f"faults_{mode}"),
            {"name": f"faults_{mode}", "restarts": RESTARTS, "epochs": cfg.fault_epochs,
             "standby": mode, "hang_timeout": cfg.hang_timeout_s,
             "checkpoint": {"background": True, "every_steps": 225}})
    for mode in cfg.kills_modes if cfg.kills_epochs else ():  # issue 27: kinds of kill
        jobs[f"kills_{mode}"] = arms.prepare_job(
            jobs["synthetic"], os.path.join(work, "jobs", f"kills_{mode}"),
            {"name": f"kills_{mode}", "epochs": cfg.kills_epochs, "standby": mode})
    for arm in cfg.goodput_long_arms if cfg.goodput_long_epochs else ():  # kills every ~2 min
        mode = arm.split("_", 1)[1]
        jobs[f"goodput_long_{mode}"] = arms.prepare_job(
            jobs["synthetic"], os.path.join(work, "jobs", f"goodput_long_{mode}"),
            {"name": f"goodput_long_{mode}", "epochs": cfg.goodput_long_epochs,
             "standby": mode})
    for mode in cfg.tiers_modes if cfg.tiers_epochs else ():  # the warm-up tiers, digits
        jobs[f"tiers_{mode}"] = arms.prepare_job(
            digits_src, os.path.join(work, "jobs", f"tiers_{mode}"),
            {"name": f"tiers_{mode}", "restarts": RESTARTS, "epochs": cfg.tiers_epochs,
             "standby": mode, "checkpoint": {"background": True}})
    for name in ("digits", "synthetic"):
        jobs[f"{name}_nostandby"] = arms.prepare_job(
            jobs[name], os.path.join(work, "jobs", f"{name}_nostandby"), {"standby": "off"})
    for name in SYNC_JOBS:
        jobs[f"{name}_sync"] = arms.prepare_job(jobs[name], os.path.join(work, "jobs",
                                                                        f"{name}_sync"),
                                                {"checkpoint": {"background": False}})
    return jobs


def backend_jobs(jobs: dict, work: str, backend: str) -> dict:
    """The bench's jobs on ``backend``: TensorFlow's as prepared (``backend: auto``, the arms'
    ``KERAS_BACKEND`` saying which), a copy of each with ``backend: jax`` said in the job, so
    the run's frozen spec and its training hash are JAX's whatever the shell says. JAX also
    gets the compile cache's jobs: one epoch, ``standby: off`` (only the cold start counts)."""
    if backend == core_backends.TENSORFLOW:
        return jobs
    out = {name: arms.prepare_job(path, os.path.join(work, f"jobs-{backend}", name),
                                  {"backend": backend}) for name, path in jobs.items()}
    for name in ("digits", "synthetic"):
        out[f"cache_{name}"] = arms.prepare_job(
            out[name], os.path.join(work, f"jobs-{backend}", f"cache_{name}"),
            {"name": f"cache_{name}", "epochs": 1, "standby": "off"})
    return out


def overhead_arms(name: str, cfg: Config, backend: str) -> tuple:
    if backend == core_backends.JAX:
        return cfg.jax_overhead_arms
    return ARMS[:1] + (NOSTANDBY_ARM,) + ((SYNC_ARM,) if name in SYNC_JOBS else ()) + (
        ARMS[1:] if name == "digits" or cfg.synth_plain_fit else ARMS[1:2])


def run_arm(arm: str, job: str, where: str, **kw) -> dict:
    if arm in ("orchestrator", SYNC_ARM, NOSTANDBY_ARM):
        return arms.run_orchestrator(job, where, **kw)
    return arms.run_keras(job, where, backup=arm != "keras_fit", **kw)


def _where(work: str, part: str, backend: str) -> str:
    """TensorFlow's runs where they always were, another backend's beside them."""
    return os.path.join(work, part if backend == core_backends.TENSORFLOW else f"{part}-{backend}")


def overhead(jobs: dict, cfg: Config, work: str, backends: tuple) -> dict:
    """Per backend, per job: every arm's runs, the backends' runs of an arm side by side."""
    out: dict = {b: {} for b in backends}
    for name in ("digits", "synthetic"):
        arms_by = {b: overhead_arms(name, cfg, b) for b in backends}
        runs = {b: {a: [] for a in arms_by[b]} for b in backends}
        for rep, b, arm in side_by_side(arms_by, cfg.reps):
            job = jobs[b][{SYNC_ARM: f"{name}_sync", NOSTANDBY_ARM: f"{name}_nostandby"}.get(
                arm, name)]
            r = run_arm(arm, job, os.path.join(_where(work, "overhead", b), name,
                                               f"{arm}-{rep}"), env=arms.backend_env(b))
            runs[b][arm].append(r)
            say(f"overhead {name} {b} rep {rep + 1}/{cfg.reps} {arm}: rc {r['rc']}, "
                f"{r['wall_s']:.2f} s wall, {r['train_s']} s training, cold start "
                f"{r['startup'].get('total')} s (trained on {r.get('backend')})")
        for b in backends:
            out[b][name] = runs[b]
    return out


def recovery(jobs: dict, cfg: Config, work: str, faults: bool, backends: tuple) -> dict:
    """Kill, raised error and hang, each -> the next first step, in one digits run per standby
    setting (side by side), each fault once a standby is warm behind the worker (auto); per
    backend, the backends' runs of a setting side by side."""
    if not faults:
        say("recovery: `orchestrator run --fault` is not in this version; skipped")
        return {b: {} for b in backends}
    specs = fault_specs(cfg)
    out = {b: {"faults": specs, "kinds": FAULT_KINDS, "runs": {m: [] for m in cfg.fault_modes}}
           for b in backends}
    args = tuple(x for spec in specs.values() for x in ("--fault", spec))
    for rep, b, mode in side_by_side({b: cfg.fault_modes for b in backends}, cfg.fault_reps):
        r = arms.run_orchestrator(jobs[b][f"faults_{mode}"],
                                  os.path.join(_where(work, "recovery", b), f"{mode}-{rep}"),
                                  extra_args=args, env=arms.backend_env(b))
        out[b]["runs"][mode].append(r)
        got = ", ".join(f"{x['kind']} {x['path']} {x['total']} s" for x in r["recoveries"])
        say(f"recovery digits {b} standby {mode} rep {rep + 1}: rc {r['rc']}, "
            f"{r['wall_s']:.1f} s, cold start {r['startup'].get('total')} s; {got}")
    return out


def compile_cache(jobs: dict, cfg: Config, work: str) -> dict:
    """JAX's persistent compile cache: per job and repetition, a cold start into a new, empty
    cache folder, then one with the folder that run filled (a new run directory: nothing comes
    from the run's own mirror), side by side."""
    out: dict = {"runs": {}}
    for name in cfg.cache_jobs:
        pairs = out["runs"][name] = []
        for rep in range(cfg.cache_reps):
            folder = os.path.join(work, "jax-compile-cache", f"{name}-{rep}")
            pair = {}
            for state in ("empty", "warm"):
                r = arms.run_orchestrator(
                    jobs[f"cache_{name}"], os.path.join(work, "cache-jax", f"{name}-{rep}-{state}"),
                    env=arms.backend_env(core_backends.JAX, compile_cache=folder))
                pair[state] = r
                say(f"compile cache {name} rep {rep + 1} {state}: rc {r['rc']}, cold start "
                    f"{r['startup'].get('total')} s, cache at start {r.get('compile_cache')}")
            pairs.append(pair)
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


def _kill_line(r: dict) -> str:
    """Each kill of a run by trigger: '-> first step' seconds and the recovery path."""
    return "; ".join(f"{x.get('trigger')}"
                     f"{' (' + x['fallback'] + ')' if x.get('fallback') else ''}"
                     f" -> {x.get('total')} s {x.get('path')}" for x in r["recoveries"])


def kills(jobs: dict, cfg: Config, work: str) -> dict:
    """Issue 27: kill -> next first step on ResNet-20 for each kind of kill (cfg.kills_triggers,
    one per attempt, in order), one run per standby setting, side by side (TensorFlow)."""
    if not cfg.kills_epochs:
        say("kills: not in this mode")
        return {}
    out = {"triggers": list(cfg.kills_triggers), "epochs": cfg.kills_epochs, "runs": {}}
    for mode in cfg.kills_modes:
        r = arms.run_orchestrator(jobs[f"kills_{mode}"], os.path.join(work, "kills", mode),
                                  plan=arms.KillPlan(triggers=cfg.kills_triggers),
                                  env=arms.backend_env(core_backends.TENSORFLOW))
        out["runs"][mode] = r
        say(f"kills synthetic standby {mode}: rc {r['rc']}, {r['wall_s']:.1f} s, cold start "
            f"{r['startup'].get('total')} s; {_kill_line(r)}")
    return out


def goodput_2min(jobs: dict, cfg: Config, work: str) -> dict:
    """Issue 27: the goodput job, longer, under a seeded SIGKILL every ~2 min (closer to real
    preemptions), the orchestrator with the standby auto and off, side by side (TensorFlow)."""
    if not cfg.goodput_long_epochs:
        say("goodput_2min: not in this mode")
        return {}
    schedule = arms.kill_schedule(cfg.seed, cfg.goodput_long_every_s,
                                  until_s=cfg.goodput_long_timeout_s)
    out = {"schedule_s": schedule, "every_s": cfg.goodput_long_every_s,
           "epochs": cfg.goodput_long_epochs, "arms": {a: [] for a in cfg.goodput_long_arms},
           "reference": {}}
    for rep in range(cfg.goodput_reps):
        for arm in cfg.goodput_long_arms:
            r = arms.run_orchestrator(jobs[f"goodput_long_{arm.split('_', 1)[1]}"],
                                      os.path.join(work, "goodput_2min", f"{arm}-{rep}"),
                                      plan=arms.KillPlan(offsets=schedule),
                                      timeout=cfg.goodput_long_timeout_s,
                                      env=arms.backend_env(core_backends.TENSORFLOW))
            out["arms"][arm].append(r)
            say(f"goodput_2min {arm} rep {rep + 1}: rc {r['rc']}, {r['wall_s']:.1f} s wall, "
                f"{r['useful_s']:.1f} s useful, {len(r['kills'])} kill(s), paths "
                f"{r.get('recovery_paths')}")
    return out


def tiers(jobs: dict, cfg: Config, work: str) -> dict:
    """Issue 27: the standby's warm-up tiers one against another (digits, TensorFlow): each
    killed once ``tiers_trigger`` (after its standby is ready; off: after a checkpoint)."""
    if not cfg.tiers_epochs:
        say("tiers: not in this mode")
        return {}
    out = {"trigger": cfg.tiers_trigger, "epochs": cfg.tiers_epochs, "runs": {}}
    for mode in cfg.tiers_modes:
        r = arms.run_orchestrator(jobs[f"tiers_{mode}"], os.path.join(work, "tiers", mode),
                                  plan=arms.KillPlan(triggers=(cfg.tiers_trigger,)),
                                  env=arms.backend_env(core_backends.TENSORFLOW))
        out["runs"][mode] = r
        say(f"tiers digits standby {mode}: rc {r['rc']}, cold start "
            f"{r['startup'].get('total')} s, warm-ups "
            f"{[(x['mode'], x['warm_up_s'], x['slowdown']) for x in r['standbys']]}; "
            f"{_kill_line(r)}")
    return out


def goodput(jobs: dict, cfg: Config, work: str, backends: tuple) -> dict:
    """The goodput job under a seeded SIGKILL every ~``kill_every_s`` until it ends, three arms
    side by side: the orchestrator with the standby on and off, the shell loop + B&R; each
    backend under the same schedule, its run of an arm beside the other's."""
    schedule = arms.kill_schedule(cfg.seed, cfg.kill_every_s, until_s=cfg.goodput_timeout_s)
    arms_by = {b: cfg.jax_goodput_arms if b == core_backends.JAX else GOODPUT_ARMS
               for b in backends}
    out = {b: {"schedule_s": schedule, "arms": {a: [] for a in arms_by[b]}, "reference": {}}
           for b in backends}
    for rep, b, arm in side_by_side(arms_by, cfg.goodput_reps):
        where = os.path.join(_where(work, "goodput", b), f"{arm}-{rep}")
        plan = arms.KillPlan(offsets=schedule)
        env = arms.backend_env(b)
        if arm == "restart_loop":
            r = arms.run_keras(jobs[b]["goodput_auto"], where, backup=True, loop=True,
                               loop_plan=plan, timeout=cfg.goodput_timeout_s,
                               max_restarts=len(schedule), env=env)
        else:
            r = arms.run_orchestrator(jobs[b][f"goodput_{arm.split('_')[1]}"], where, plan=plan,
                                      timeout=cfg.goodput_timeout_s, env=env)
        out[b]["arms"][arm].append(r)
        say(f"goodput {b} {arm} rep {rep + 1}: rc {r['rc']}, {r['wall_s']:.1f} s wall, "
            f"{r['useful_s']:.1f} s useful, {len(r['kills'])} kill(s), paths "
            f"{r.get('recovery_paths', '-')}")
    if cfg.goodput_reference:
        for b in backends:
            where, env = _where(work, "goodput", b), arms.backend_env(b)
            out[b]["reference"] = {
                "orchestrator": arms.run_orchestrator(
                    jobs[b]["goodput_auto"], os.path.join(where, "reference-orchestrator"),
                    timeout=cfg.goodput_timeout_s, env=env),
                "keras_fit_backup": arms.run_keras(
                    jobs[b]["goodput_auto"], os.path.join(where, "reference-fit"),
                    backup=True, timeout=cfg.goodput_timeout_s, env=env)}
            say(f"goodput references {b}: " + ", ".join(
                f"{k} rc {r['rc']} {r['wall_s']:.1f} s" for k, r in out[b]["reference"].items()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a smoke run (about 4 minutes on TensorFlow alone; JAX beside it adds "
                        "as much again): one repetition, small jobs")
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
    p.add_argument("--goodput-reference", action="store_true",
                   help="also run the goodput job uninterrupted (orchestrator and fit + "
                        "BackupAndRestore) to check the final weights (adds ~5 min)")
    p.add_argument("--backends", type=parse_backends, default=BACKENDS,
                   help="the Keras backends to measure, side by side in one run "
                        "(default: tensorflow,jax)")
    args = p.parse_args(argv)
    parts = args.only or DEFAULT_PARTS
    backends = args.backends
    missing = [b for b in backends if not core_backends.installed(b)]
    if missing:
        rest = ",".join(b for b in backends if b not in missing)
        p.error(f"--backends: {', '.join(missing)} not installed for {sys.executable} "
                f"(install it, or measure {'--backends ' + rest if rest else 'another'})")
    cfg = QUICK if args.quick else FULL
    if args.goodput_reference:
        cfg = replace(cfg, goodput_reference=True)
    work = args.work or tempfile.mkdtemp(prefix="orchestrator-bench-")
    faults = faults_available()
    tf_jobs = prepare_jobs(cfg, work)
    jobs = {b: backend_jobs(tf_jobs, work, b) for b in BACKENDS}
    say(f"{cfg.mode} run in {work} on {', '.join(backends)}; faults injection "
        f"{'available' if faults else 'absent'}")
    t0 = time.time()
    for b in backends:  # the page cache warm for the first run of each
        subprocess.run([sys.executable, "-c", f"import {core_backends.MODULES[b]}"],
                       capture_output=True)
    results = {"config": asdict(cfg), "machine": report.machine(), "work_dir": work,
               "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t0)),
               "faults_injection": faults, "backends": list(backends),
               "jobs": {k: report.read_job(p) for k, p in tf_jobs.items()}}
    if core_backends.JAX in backends:
        results["jax"] = {"jobs": {k: report.read_job(p)
                                   for k, p in jobs[core_backends.JAX].items()}}
    stem = ("quick" if args.quick else "results") + ("-" + "-".join(args.only) if args.only
                                                     else "")
    os.makedirs(args.out, exist_ok=True)  # --out may name a folder not made yet
    json_path = os.path.join(args.out, f"{stem}.json")

    def save():
        results["duration_s"] = round(time.time() - t0, 1)
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)

    def store(part: str, by_backend: dict) -> None:
        """TensorFlow's part at the top level (as before JAX), JAX's under results["jax"]."""
        results[part] = by_backend.get(core_backends.TENSORFLOW) or {}
        if "jax" in results:
            results["jax"][part] = by_backend.get(core_backends.JAX) or {}
        save()

    if args.standby_only:
        results["standby"] = standby(tf_jobs, cfg, work)
        print(json.dumps(report.standby_summary(results), indent=1))
        return 0
    store("overhead", overhead(jobs, cfg, work, backends) if "overhead" in parts else {})
    store("goodput", goodput(jobs, cfg, work, backends) if "goodput" in parts else {})
    store("recovery", recovery(jobs, cfg, work, faults, backends) if "recovery" in parts else {})
    if "jax" in results and "cache" in parts:
        results["jax"]["cache"] = compile_cache(jobs[core_backends.JAX], cfg, work)
    results["standby"] = standby(tf_jobs, cfg, work) if "standby" in parts else {}
    tf = core_backends.TENSORFLOW in backends  # issue 27's parts measure TensorFlow
    results["kills"] = kills(tf_jobs, cfg, work) if tf and "kills" in parts else {}
    save()
    results["goodput_2min"] = (goodput_2min(tf_jobs, cfg, work)
                               if tf and "goodput_2min" in parts else {})
    save()
    results["tiers"] = tiers(tf_jobs, cfg, work) if tf and "tiers" in parts else {}
    save()
    results["bigstate"] = bigstate.run(cfg, work, backends, say) if "bigstate" in parts else {}
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

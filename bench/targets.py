"""Issue #12's recovery targets from the bench's runs: the goodput arms, the fault recoveries
(kill, raised error, hang) against each run's own cold start, and one table of every target
with its measured figure and whether it passed; issue #23's for the same runs on JAX, whose
limits are tighter (its cold start is mostly compiling, which the warm standby has done).

Ratios, not seconds: the machine is shared and its speed drifts by tens of percent from one
hour to the next, so each recovery is divided by the cold start (launch -> first step of
attempt 1) of the same run, and the goodput arms run side by side.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import breakdown
from .stats import fmt_pct, fmt_ratio, fmt_s, fmt_yes, md_table, median, spread

# The targets, as issue #12 states them.
KILL_RATIO = 0.30        # kill -> next first step, x the same run's cold start
RAISE_RATIO = 0.35       # raised error -> next first step
HANG_COLD_SHARE = 0.30   # hang -> next first step <= hang_timeout + this x cold start
GOODPUT_TARGET = 0.75    # standby auto, a seeded SIGKILL every ~20 s
STALL_TARGET_MS, TRAIN_RATIO_TARGET = 20.0, 1.02


@dataclass(frozen=True)
class Limits:
    """One backend's targets: the same rows, each backend's own limits and issue."""

    title: str
    kill: float
    raised: float
    hang: float            # x cold start beyond hang_timeout
    goodput: float
    stall_ms: float = STALL_TARGET_MS
    train_ratio: float = TRAIN_RATIO_TARGET


TENSORFLOW = Limits("Issue #12 targets", KILL_RATIO, RAISE_RATIO, HANG_COLD_SHARE,
                    GOODPUT_TARGET)
# Issue #23 on JAX: "recovery <= 0.1x of a cold start with the standby; goodput >= 0.9", the
# recovery limit taken for each fault (the hang's beyond its hang_timeout, as on TensorFlow).
# Its fault-free training and stall limits are #12's: the same promise on either backend.
JAX = Limits("Issue #23 targets, JAX", 0.10, 0.10, 0.10, 0.90)
LIMITS = {"tensorflow": TENSORFLOW, "jax": JAX}

STALL_ROW = "training-thread stall per checkpoint, ResNet-20, median"
ORCH_ARMS = ("standby_auto", "standby_off")
LOOP_ARM = "restart_loop"
ARM_LABELS = {"standby_auto": "orchestrator, standby: auto",
              "standby_off": "orchestrator, standby: off",
              "restart_loop": "Keras fit + BackupAndRestore in a shell loop"}


def cold_start(run: dict) -> float | None:
    """A run's cold start: launch -> first step of attempt 1."""
    return (run.get("startup") or {}).get("total")


def _of_cold_start(total: float | None, cold: float | None, minus: float = 0.0) -> float | None:
    return None if total is None or not cold else round((total - minus) / cold, 3)


def fault_recoveries(recovery: dict, hang_timeout_s: float | None,
                     limits: Limits = TENSORFLOW) -> dict:
    """Per ``fault/mode``: each recovery of that fault's kind against its own run's cold start.

    The hang's ratio is (total - hang_timeout) / cold start: its target is hang_timeout plus a
    share of the cold start, the detection being the timeout by design."""
    out = {}
    for mode, runs in (recovery.get("runs") or {}).items():
        for fault, kind in (recovery.get("kinds") or {}).items():
            minus = (hang_timeout_s or 0.0) if fault == "hang" else 0.0
            xs = [(x, cold_start(r)) for r in runs
                  for x in r["recoveries"] if x.get("kind") == kind]
            totals = [x.get("total") for x, _ in xs]
            ratios = [_of_cold_start(x.get("total"), cold, minus) for x, cold in xs]
            paths = [x.get("path") for x, _ in xs]
            target = {"kill": limits.kill, "raise": limits.raised, "hang": limits.hang}[fault]
            ratio = median(ratios)  # as shown (3 decimals), so the verdict matches the cell
            ratio = None if ratio is None else round(ratio, 3)
            out[f"{fault}/{mode}"] = {
                "fault": fault, "mode": mode, "n": len(xs), "total_s": median(totals),
                "total_spread": spread(totals), "cold_start_s": median(c for _, c in xs),
                "ratio": ratio, "ratio_spread": spread(ratios), "paths": paths,
                "all_warm": bool(paths) and all(p == "warm" for p in paths),
                "target": target, "passed": None if ratio is None else ratio <= target,
                "spec": (recovery.get("faults") or {}).get(fault),
                "rc": [r["rc"] for r in runs]}
    return out


def kills_of(run: dict) -> int:
    """Kills that hit a training process: the orchestrator's journal (attempts that ended
    killed), or the shell loop's child processes killed."""
    if "failures" in run:
        return sum(f.get("kind") == "killed" for f in run["failures"])
    return len(run["kills"])


def goodput_summary(goodput: dict) -> dict:
    """Per arm: wall, useful, goodput (useful / wall), kills, warm and cold recoveries, steps
    redone, completed, and the final weights against the uninterrupted reference run of the
    same kind (when the bench ran one) and, for the orchestrator, between its two arms."""
    ref = goodput.get("reference") or {}
    out: dict = {"schedule_s": goodput["schedule_s"], "arms": {}}
    for arm, runs in goodput["arms"].items():
        if not runs:
            continue
        reference = ref.get("keras_fit_backup" if arm == LOOP_ARM else "orchestrator")
        fp_ref = reference.get("fingerprint") if reference and reference["rc"] == 0 else None
        kills = [[x for x in r.get("recoveries", []) if x.get("kind") == "killed"]
                 for r in runs]
        out["arms"][arm] = {
            "wall_s": median(r["wall_s"] for r in runs),
            "useful_s": median(r["useful_s"] for r in runs),
            "goodput": median(r["useful_s"] / r["wall_s"] for r in runs if r["wall_s"]),
            "goodput_spread": spread(r["useful_s"] / r["wall_s"] for r in runs if r["wall_s"]),
            "kills": median(kills_of(r) for r in runs),
            "warm": median(sum(p == "warm" for p in r.get("recovery_paths") or []) for r in runs)
            if arm != LOOP_ARM else None,
            "cold": median(sum(p == "cold" for p in r.get("recovery_paths") or []) for r in runs)
            if arm != LOOP_ARM else None,
            # a standby promoted before it was ready, finishing its warm-up as the attempt
            "adopted": median(sum(p == "adopted" for p in r.get("recovery_paths") or [])
                              for r in runs) if arm != LOOP_ARM else None,
            "kill_to_first_step_s": median(x["total"] for k in kills for x in k),
            "kill_ratio": median(_of_cold_start(x["total"], cold_start(r))
                                 for r, k in zip(runs, kills) for x in k),
            # each kill of the run is a repetition of the recovery: their min-max
            "kill_ratio_spread": spread(_of_cold_start(x["total"],
                                                       cold_start(r))
                                        for r, k in zip(runs, kills) for x in k),
            "cold_start_s": median(cold_start(r) for r in runs),
            "steps_redone": median(breakdown.steps_redone(r["kills"]) for r in runs),
            "completed": all(r["rc"] == 0 for r in runs),
            "fingerprints": [r.get("fingerprint") for r in runs],
            "fingerprint_equal": [None if fp_ref is None or not r.get("fingerprint") else
                                  r["fingerprint"] == fp_ref for r in runs],
            "failed_alone": sum(r.get("failed_alone") or 0 for r in runs),
            "last_error": next((r["last_error"] for r in runs
                                if r.get("failed_alone") and r.get("last_error")), None),
            "standby_rss_mb": median(x for r in runs for x in r.get("standby_rss_mb") or []),
            "worker_peak_rss_mb": median(r.get("worker_peak_rss_mb") for r in runs),
        }
    fps = [fp for a in ORCH_ARMS for fp in out["arms"].get(a, {}).get("fingerprints", [])]
    out["orchestrator_arms_agree"] = (None if len(fps) < 2 or not all(fps)
                                      else len(set(fps)) == 1)
    out["reference_run"] = bool(ref)
    return out


def _row(what: str, target: str, measured: str, passed: bool | None) -> dict:
    return {"what": what, "target": target, "measured": measured, "passed": passed}


def target_rows(s: dict, limits: Limits = TENSORFLOW) -> list[dict]:
    """Every target with the figure measured in this run and pass/fail (None: not measured in
    this run, or a figure given for comparison only), with ``limits``' figures: #12's on
    TensorFlow, #23's on JAX."""
    rows = []
    f = s.get("faults") or {}
    g = (s.get("goodput") or {}).get("arms", {})

    def fault_row(key: str, what: str, target: str, note: str = "") -> None:
        # the recovery runs ask for standby: on (what a standby buys) since auto became a
        # policy; results from before say auto
        x = f.get(key.replace("/auto", "/on")) or f.get(key)
        if not x or x["ratio"] is None:
            rows.append(_row(what, target, "not measured", None))
            return
        not_warm = {p: x["paths"].count(p) for p in dict.fromkeys(x["paths"]) if p != "warm"}
        cold = "" if x["all_warm"] else "; **" + ", ".join(  # cold, adopted, ... each counted
            f"{p or 'no'} path in {n}" for p, n in not_warm.items()) + "**"
        lo, hi = x["ratio_spread"]
        rng = f" ({lo:.3f}-{hi:.3f}x, n={x['n']})" if x["n"] > 1 else ""
        rows.append(_row(what, target, f"{fmt_ratio(x['ratio'])}{rng} {note}"
                         f"({fmt_s(x['total_s'])} s; cold start {fmt_s(x['cold_start_s'])} s"
                         f"{cold})", x["passed"]))

    fault_row("kill/auto", "kill -> next first step, digits",
              f"<= {limits.kill:.2f}x cold start")
    a = g.get("standby_auto")
    if a and a["kill_ratio"] is not None:
        rows.append(_row("kill -> next first step, synthetic ResNet-20 (goodput run)",
                         f"<= {limits.kill:.2f}x cold start",
                         f"{fmt_ratio(a['kill_ratio'])} ({fmt_s(a['kill_to_first_step_s'])} s, "
                         f"median of {a['warm']} warm + "
                         f"{str(a['adopted']) + ' adopted + ' if a.get('adopted') else ''}"
                         f"{a['cold']} cold; cold start "
                         f"{fmt_s(a['cold_start_s'])} s)", a["kill_ratio"] <= limits.kill))
    else:
        rows.append(_row("kill -> next first step, synthetic ResNet-20", "", "not measured",
                         None))
    fault_row("raise/auto", "raised error (storage) -> next first step",
              f"<= {limits.raised:.2f}x cold start")
    fault_row("hang/auto", "hang -> next first step", f"<= hang_timeout + "
              f"{limits.hang:.2f}x cold start", note="of cold start beyond hang_timeout ")
    for arm in GOODPUT_ROWS:
        x = g.get(arm)
        target = f">= {limits.goodput:.2f}" if arm == "standby_auto" else "(for comparison)"
        if not x:
            rows.append(_row(f"goodput, {ARM_LABELS[arm]}", target, "not measured", None))
            continue
        rows.append(_row(f"goodput, {ARM_LABELS[arm]}", target,
                         f"{x['goodput']:.3f} ({fmt_s(x['useful_s'], 1)} s useful / "
                         f"{fmt_s(x['wall_s'], 1)} s wall, {fmt_s(x['kills'], 0)} kills)",
                         x["goodput"] >= limits.goodput if arm == "standby_auto" else None))
    for job, o in (s.get("overhead") or {}).items():
        # the target is what checkpointing costs (standby off); the default (auto) adds the
        # standby's warm-up on the same cores, once per attempt, stated beside it
        r = o.get("nostandby_train_ratio_vs_backup")
        rows.append(_row(f"fault-free training time vs fit + BackupAndRestore, {job}, "
                         f"standby: off", f"<= {limits.train_ratio:.2f}x", fmt_ratio(r),
                         None if r is None else r <= limits.train_ratio))
        r = o.get("train_ratio_vs_backup")
        rows.append(_row(f"fault-free training time vs fit + BackupAndRestore, {job}, "
                         f"standby: auto (its warm-up beside the worker)", "(for comparison)",
                         fmt_ratio(r), None))
    stalls = (s.get("overhead") or {}).get("synthetic", {}).get("stall_ms") or {}
    st = stalls.get("orchestrator") or stalls.get("orchestrator_standby_off")
    if st and st["n"]:
        rows.append(_row(STALL_ROW,
                         f"<= {limits.stall_ms:.0f} ms",
                         f"{st['median']:.1f} ms ({st['spread'][0]:.1f}-{st['spread'][1]:.1f}, "
                         f"n={st['n']})", st["median"] <= limits.stall_ms))
    else:
        rows.append(_row(STALL_ROW,
                         f"<= {limits.stall_ms:.0f} ms", "not measured", None))
    return rows


GOODPUT_ROWS = ("standby_auto", "standby_off", "restart_loop")


def _verdict(passed: bool | None) -> str:
    return {True: "pass", False: "**FAIL**", None: "-"}[passed]


def targets_markdown(s: dict, limits: Limits = TENSORFLOW) -> list[str]:
    rows = [[r["what"], r["target"], r["measured"], _verdict(r["passed"])]
            for r in s.get("targets") or []]
    if not rows:
        return []
    return [f"### {limits.title}", "",
            md_table(["what", "target", "measured", "result"], rows), "",
            "Recovery ratios are to the same run's cold start (launch -> first step of attempt "
            "1); each is the median over its samples. The goodput figures are useful / wall of "
            "one run per arm, side by side; details in the sections below.", ""]


def faults_markdown(s: dict, hang_timeout_s: float | None) -> list[str]:
    f = s.get("faults") or {}
    if not f:
        return []
    rows = []
    for x in f.values():
        ratio = fmt_ratio(x["ratio"])
        if x["n"] > 1 and x["ratio_spread"]:
            ratio += f" ({x['ratio_spread'][0]:.3f}-{x['ratio_spread'][1]:.3f}x)"
        paths = ", ".join(p or "-" for p in x["paths"]) or "-"
        if x["mode"] != "off" and not x["all_warm"]:
            paths += " **(not warm)**"
        rows.append([x["fault"], x["mode"], x["spec"] or "-", x["n"], fmt_s(x["total_s"]),
                     fmt_s(x["cold_start_s"]), ratio, paths,
                     f"<= {x['target']:.2f}x" if x["mode"] != "off" else "-",
                     _verdict(x["passed"]) if x["mode"] != "off" else "-"])
    return ["Faults -> next first step against the same run's cold start (one digits run per "
            "standby setting with the three faults in turn, each far enough behind the last "
            "for a standby to warm up; the path is the journal's `attempt_started.path`). "
            f"For the hang, ratio = (total - hang_timeout {fmt_s(hang_timeout_s, 0)} s) / "
            "cold start.", "",
            md_table(["fault", "standby", "injected", "n", "-> first step (s)",
                      "cold start (s)", "ratio", "recovery path", "target", "result"], rows),
            ""]


def goodput_markdown(s: dict, seed: int, mean_s: float, job: str,
                     epochs: int | None = None,
                     title: str = "### 3. Goodput under a seeded SIGKILL schedule "
                                  "(synthetic ResNet-20)") -> list[str]:
    g = s.get("goodput") or {}
    if not g.get("arms"):
        return []
    sched = g["schedule_s"]
    out = [title, "",
           f"Job: {job}. A SIGKILL of the training process (the worker; the loop's Python "
           f"child) every {mean_s:.0f} s on average (0.75-1.25x; seed {seed}: at "
           f"{', '.join(str(t) for t in sched[:4])}, ... s after launch) until the run "
           f"ends. Useful = training whose result was kept: per process, first step to its "
           f"last checkpoint (`orchestrator.ops.timeline`'s rule; for the loop, to its last "
           f"BackupAndRestore save). Goodput = useful / wall, wall = launch to exit.", ""]
    rows = []
    for arm, x in g["arms"].items():
        if g.get("reference_run"):
            weights = ", ".join(fmt_yes(v) for v in x["fingerprint_equal"]) or "-"
        elif arm in ORCH_ARMS:
            weights = f"auto = off: {fmt_yes(g['orchestrator_arms_agree'])}"
        else:
            weights = "not checked"
        rec = "-" if x["warm"] is None else (f"{fmt_s(x['warm'], 0)} / "
                                             f"{fmt_s(x.get('adopted'), 0)} / "
                                             f"{fmt_s(x['cold'], 0)}")
        rows.append([ARM_LABELS.get(arm, arm), fmt_s(x["wall_s"], 1), fmt_s(x["useful_s"], 1),
                     fmt_s(x["cold_start_s"]), fmt_s(x["kills"], 0), rec,
                     fmt_s(x["kill_to_first_step_s"]),
                     fmt_s(x["steps_redone"], 0), fmt_pct(x["goodput"]), fmt_yes(x["completed"]),
                     weights])
    out.append(md_table(["", "wall (s)", "useful (s)", "of the wall: first cold start (s)",
                         "kills", "recoveries warm / adopted / cold",
                         "kill -> first step (s, median)", "steps redone", "goodput",
                         "completed", "final weights = uninterrupted run's"], rows))
    out += ["", "Steps redone = steps trained after the last saved state by killed processes "
            "(progress sampled at most 1 s before the kill: a lower bound). Final weights: "
            + ("each run against an uninterrupted run of the same kind (orchestrator; fit + "
               "BackupAndRestore)." if g.get("reference_run") else
               "no uninterrupted run of this job in this configuration (it would take "
               "~5 more minutes; `--goodput-reference`), so the two orchestrator arms, killed "
               "at different steps, are checked against each other."), ""]
    for arm, x in g["arms"].items():
        if x.get("failed_alone"):
            out += [f"**{ARM_LABELS.get(arm, arm)}**: {x['failed_alone']} of its processes "
                    f"failed on their own (not killed), each a restart of the loop; the last "
                    f"error: `{x['last_error'] or '-'}`.", ""]
    if epochs:
        out += ["Kept training per epoch (useful / epochs): " + ", ".join(
            f"{ARM_LABELS.get(arm, arm)} {x['useful_s'] / epochs:.2f} s"
            for arm, x in g["arms"].items() if x["useful_s"] and x["completed"]) + ". With "
            "the standby on, it "
            "warms up (at nice 19) on the cores the worker trains on.", ""]
    a = g["arms"].get("standby_auto")
    if a and a.get("standby_rss_mb"):
        out += [f"Memory: the standby holds {fmt_s(a['standby_rss_mb'], 0)} MiB when ready, "
                f"beside the worker's peak of {fmt_s(a['worker_peak_rss_mb'], 0)} MiB.", ""]
    return out


# Issue 37's targets for a big state (bench/bigstate.py), each against arms of the same run.
BIG_TRAIN_VS_BACKUP, BIG_TRAIN_VS_PLAIN = 1.05, 1.15
BIG_STALL_MS_PER_GB = 20.0
BIG_BYTES_RATIO = 1.1      # bytes per checkpoint, x the bytes that changed
BIG_RSS_RATIO = 1.3        # the worker's peak RSS, x plain fit's
BIG_RECOVERY_RATIO = 1.0   # kill -> next first step, x the run's cold start


def bigstate_rows(x: dict) -> list[dict]:
    """Issue 37's targets for one job and backend of the big-state part (its summary)."""
    ours, backup, plain = x.get("orchestrator") or {}, x.get("keras_fit_backup") or {}, \
        x.get("keras_fit") or {}
    m, rec = x.get("model") or {}, x.get("recovery") or {}

    def ratio(a, b):
        return None if a is None or not b else round(a / b, 3)

    def row(what, limit, value, fmt=fmt_ratio):
        rows.append(_row(what, f"<= {limit}", fmt(value) if value is not None else
                         "not measured", None if value is None else value <= limit))

    rows: list[dict] = []
    row("training time vs fit + BackupAndRestore", BIG_TRAIN_VS_BACKUP,
        ratio(ours.get("train_s"), backup.get("train_s")))
    row("training time vs plain fit", BIG_TRAIN_VS_PLAIN,
        ratio(ours.get("train_s"), plain.get("train_s")))
    gb = (m.get("state") or 0) / 1e9
    row("median stall per checkpoint, ms per GB of state", BIG_STALL_MS_PER_GB,
        None if ours.get("stall_ms") is None or not gb else round(ours["stall_ms"] / gb, 1),
        fmt=lambda v: f"{v:.1f} ms/GB ({ours['stall_ms']:.0f} ms, {gb:.2f} GB)")
    row("bytes per checkpoint vs bytes changed", BIG_BYTES_RATIO,
        ratio(ours.get("bytes_per_checkpoint"), m.get("changed")),
        fmt=lambda v: f"{fmt_ratio(v)} ({ours.get('bytes_counted')})")
    row("worker peak RSS vs plain fit's", BIG_RSS_RATIO,
        ratio(ours.get("peak_rss_mb"), plain.get("peak_rss_mb")))
    row("kill -> next first step vs cold start", BIG_RECOVERY_RATIO, rec.get("ratio"))
    return rows

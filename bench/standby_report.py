"""Issue 27's figures: does the warm standby pay for itself or stay out of the way?

From the bench's runs: kill -> next first step for each kind of kill (KillPlan.triggers), the
standby on its default (auto) against ``standby: off``, each against its own run's cold start;
the target "no recovery slower than 1.0x of its run's cold start" over every recovery of the
default; the standby policy's decisions as the journal has them (``standby_decided``) with the
recovery paths; and the warm-up tiers (import only, full warm, off) one against another.
"""
from __future__ import annotations

from .stats import fmt_ratio, fmt_s, md_table
from .targets import ARM_LABELS, _of_cold_start, _row, cold_start

RECOVERY_RATIO = 1.0  # no recovery slower than its run's cold start (issue 27)
REASON_CHARS = 160    # a decision's reason as shown (verbatim in results.json)
PATHS = ("warm", "adopted", "import_only", "cold")  # attempt_started.path, warmest first


def kill_rows(run: dict) -> list[dict]:
    """Each recovery of a run from a kill, against the run's cold start (launch -> first step
    of attempt 1), with the trigger that set the bench's kill off (None: a goodput schedule)."""
    cold = cold_start(run)
    return [{"attempt": x.get("attempt"), "trigger": x.get("trigger"),
             "fallback": x.get("fallback"), "since_first_step_s": x.get("since_first_step_s"),
             "total_s": x.get("total"), "cold_start_s": cold,
             "ratio": _of_cold_start(x.get("total"), cold), "path": x.get("path")}
            for x in run.get("recoveries") or [] if x.get("kind", "killed") == "killed"]


def path_counts(paths) -> dict:
    """How many recoveries took each path (adopted counted apart from warm and cold)."""
    paths = [p for p in paths or [] if p]
    out = {p: paths.count(p) for p in PATHS if p in paths}
    out.update({p: paths.count(p) for p in paths if p not in PATHS})
    return out


def fmt_paths(paths) -> str:
    """'2 warm, 1 adopted, 1 cold' (or '-')."""
    return ", ".join(f"{n} {p}" for p, n in path_counts(paths).items()) or "-"


def kills_summary(kills: dict) -> dict:
    """Per standby setting: each kill's row (kill_rows), the run's cold start, rc and paths."""
    runs = (kills or {}).get("runs") or {}
    return {"triggers": list((kills or {}).get("triggers") or []),
            "runs": {mode: {"rows": kill_rows(r), "cold_start_s": cold_start(r), "rc": r.get("rc"),
                            "paths": r.get("recovery_paths") or [],
                            "decisions": r.get("standby_decisions") or [],
                            "standbys": r.get("standbys") or [],
                            "cold_path": cold_path_rows(r)}
                     for mode, r in runs.items()}}


def default_recoveries(results: dict) -> list[tuple[str, dict]]:
    """Every kill recovery of the default (standby: auto), labelled by where it was measured:
    the kills part's auto run, and the auto arm of both goodput parts."""
    out = []
    run = ((results.get("kills") or {}).get("runs") or {}).get("auto")
    if run:
        out += [(f"kills: {x['trigger']}", x) for x in kill_rows(run)]
    for part, label in (("goodput", "goodput ~20 s"), ("goodput_2min", "goodput ~2 min")):
        for r in ((results.get(part) or {}).get("arms") or {}).get("standby_auto") or []:
            out += [(label, x) for x in kill_rows(r)]
    return out


def recovery_target_row(results: dict) -> dict:
    """"No recovery slower than 1.0x of its run's cold start": the worst of the default's."""
    what = (f"no kill recovery slower than {RECOVERY_RATIO:.1f}x of its run's cold start, "
            f"standby: auto (every one measured: kills, goodput)")
    xs = [(where, x) for where, x in default_recoveries(results) if x["ratio"] is not None]
    if not xs:
        return _row(what, f"<= {RECOVERY_RATIO:.2f}x", "not measured", None)
    where, worst = max(xs, key=lambda wx: wx[1]["ratio"])
    over = sum(x["ratio"] > RECOVERY_RATIO for _, x in xs)
    return _row(what, f"<= {RECOVERY_RATIO:.2f}x",
                f"worst {fmt_ratio(worst['ratio'])} ({where}, {worst['path'] or '-'}: "
                f"{fmt_s(worst['total_s'])} s, cold start {fmt_s(worst['cold_start_s'])} s); "
                f"{over} of {len(xs)} over", worst["ratio"] <= RECOVERY_RATIO)


def _kill_cell(x: dict | None) -> str:
    if not x:
        return "not killed"
    cell = f"{fmt_s(x['total_s'])} s ({fmt_ratio(x['ratio'])}), {x['path'] or '-'}"
    if x.get("fallback"):
        cell += f"; killed after a checkpoint: {x['fallback']}"
    return cell


def kills_markdown(ks: dict, job: str) -> list[str]:
    """The kinds of kill side by side, one column per standby setting."""
    runs = ks.get("runs") or {}
    if not runs:
        return []
    modes = list(runs)
    rows = []
    for i, trigger in enumerate(ks["triggers"]):
        cells = []
        for mode in modes:
            hits = [x for x in runs[mode]["rows"] if x["trigger"] == trigger]
            nth = ks["triggers"][:i].count(trigger)  # a trigger given twice: its nth kill
            cells.append(_kill_cell(hits[nth] if nth < len(hits) else None))
        rows.append([f"({chr(97 + i)}) {trigger}"] + cells)
    rows.append(["cold start of the run (launch -> first step)"]
                + [f"{fmt_s(runs[m]['cold_start_s'])} s" for m in modes])
    rows.append(["recovery paths (journal)"] + [fmt_paths(runs[m]["paths"]) for m in modes])
    rows.append(["run's rc"] + [str(runs[m]["rc"]) for m in modes])
    return ["#### Recovery by kind of kill, standby: " + " vs ".join(modes), "",
            f"Job: {job}. One run per standby setting, side by side, each killed (SIGKILL) once "
            "per attempt: (a) once the first attempt has a checkpoint, and the seconds after it "
            "the trigger says (auto starts no standby behind a run's first attempt); (b) 1.5 s "
            "after the next attempt's first step (where a standby was started behind it, as `on` "
            "always does, it is still warming up: adopted); (c) once the standby for the next attempt is ready (where "
            "none will be: at the attempt's first checkpoint, said in the cell). Each cell: kill "
            "-> next first step (x the run's cold start), the recovery path "
            "(`attempt_started.path`).", "",
            md_table(["kill"] + [f"standby: {m}" for m in modes], rows), ""] + \
        cold_path_markdown(runs)


BEFORE_WORKER = ("detected", "stopped", "process_started")  # the orchestrator's, no worker yet
WORKER_START = ("python_ready", "tf_imported", "model_built")  # the worker's, the same code


def _sum(phases: dict, names) -> float | None:
    xs = [phases.get(n) for n in names if phases.get(n) is not None]
    return round(sum(xs), 3) if xs else None


def cold_path_rows(run: dict) -> list[dict]:
    """A run's cold start and each of its cold recoveries cut where the orchestrator's part
    ends: before the worker runs (launch or kill -> the new process) and the restore, which
    only a recovery pays, against the worker's start-up and first step, the same code in both.
    Issue 38: a cold recovery should cost no more than a cold start; where it does, this says
    whether it was ours or the framework's start-up, which varies run to run on its own."""
    def row(label, ph, ratio):
        return {"label": label, "before_worker_s": _sum(ph, BEFORE_WORKER),
                "restore_s": ph.get("restored"), "worker_start_s": _sum(ph, WORKER_START),
                "first_step_s": ph.get("first_step"), "total_s": ph.get("total"),
                "ratio": ratio}
    cold = cold_start(run)
    out = [row("cold start", run.get("startup") or {}, 1.0 if cold else None)]
    for x in run.get("recoveries") or []:
        if x.get("kind", "killed") == "killed" and x.get("path") == "cold":
            out.append(row(f"recovery of attempt {x.get('attempt')} ({x.get('trigger')})", x,
                           _of_cold_start(x.get("total"), cold)))
    return out


def cold_path_markdown(runs: dict) -> list[str]:
    """Each summarised run's cold start and cold recoveries, phase by phase (cold_path_rows);
    a run with no cold recovery is left out."""
    rows = []
    for mode, run in runs.items():
        for r in run.get("cold_path") if len(run.get("cold_path") or []) > 1 else []:
            rows.append([f"{mode}: {r['label']}", fmt_s(r["before_worker_s"]),
                         fmt_s(r["restore_s"]), fmt_s(r["worker_start_s"]),
                         fmt_s(r["first_step_s"]), fmt_s(r["total_s"]), fmt_ratio(r["ratio"])])
    if not rows:
        return []
    return ["#### Where a cold recovery's time goes", "",
            "Each run's cold start and each recovery by a new process (`path: cold`), in "
            "seconds: the orchestrator's part before the worker runs (launch, or the kill, -> "
            "the new process: the supervisor's own start for a cold start; the death's "
            "detection, the attempt's end and the spawn for a recovery), the restore (a "
            "recovery's only: the values' copy into the model and its check; the checkpoint "
            "is read beside the framework's import), then the worker's start-up (Python, the "
            "framework's import, the model) and its first step, the same code either way.", "",
            md_table(["run: start", "before the worker", "restore", "worker start-up",
                      "first step", "total", "x cold start"], rows), ""]


def _reason(text: str | None) -> str:
    text = " ".join((text or "-").split())
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 1] + "…"


def decision_lines(label: str, run: dict) -> list[str]:
    """One run's standby decisions (``standby_decided``, verbatim but cut to REASON_CHARS), its
    standbys' fates and its recovery paths, as a compact list."""
    paths = run.get("recovery_paths") or []
    out = [f"**{label}** (recovery paths: {', '.join(p or '-' for p in paths) or 'none'})", ""]
    for d in run.get("standby_decisions") or []:
        out.append(f"- attempt {d.get('for_attempt')}: {d.get('mode') or 'none'} — "
                   f"{_reason(d.get('reason'))}")
    for sb in run.get("standbys") or []:
        out.append(f"- standby for attempt {sb.get('for_attempt')} ({sb.get('mode')}): "
                   f"{sb.get('outcome') or 'still there at the end'}, warm-up "
                   f"{fmt_s(sb.get('warm_up_s'))} s")
    if len(out) == 2:
        out.append("- no standby_decided event")
    return out + [""]


def decisions_markdown(results: dict) -> list[str]:
    """The policy's decisions for every orchestrator run of the goodput and kills parts."""
    blocks = []
    for part, title in (("kills", "kills"), ("goodput", "goodput ~20 s"),
                        ("goodput_2min", "goodput ~2 min")):
        p = results.get(part) or {}
        for key, runs in (p.get("runs") or {}).items():  # kills: one run per setting
            blocks += decision_lines(f"{title}, standby: {key}", runs)
        for arm, runs in (p.get("arms") or {}).items():
            for i, r in enumerate(runs):
                if "standby_decisions" not in r:
                    continue  # the shell loop, or a run from before issue 27
                n = f" (run {i + 1})" if len(runs) > 1 else ""
                blocks += decision_lines(f"{title}, {ARM_LABELS.get(arm, arm)}{n}", r)
    if not blocks:
        return []
    return ["#### The standby policy's decisions, from the journal", "",
            "Each `standby_decided` event (journaled when the decision changes: the attempt it "
            "was for, the mode or none, the reason cut to "
            f"{REASON_CHARS} characters), then each standby's fate (`standby_promoted` / "
            "`_discarded` / `_lost`) and warm-up (`standby_started` -> `standby_ready`).", ""] \
        + blocks


def tiers_summary(tiers: dict) -> dict:
    """Per tier (standby setting): its first standby's warm-up and the worker's speed while it
    warmed up against after, and the kill's recovery against the run's cold start."""
    out = {}
    for mode, r in ((tiers or {}).get("runs") or {}).items():
        sb = next(iter(r.get("standbys") or []), {})
        kill = next(iter(kill_rows(r)), {})
        out[mode] = {"standby_mode": sb.get("mode"), "warm_up_s": sb.get("warm_up_s"),
                     "phases_s": sb.get("phases_s"), "outcome": sb.get("outcome"),
                     "steps_per_s_during": sb.get("steps_per_s_during"),
                     "steps_per_s_after": sb.get("steps_per_s_after"),
                     "slowdown": sb.get("slowdown"), "steps_per_s": r.get("steps_per_s"),
                     "total_s": kill.get("total_s"), "cold_start_s": cold_start(r),
                     "ratio": kill.get("ratio"), "path": kill.get("path"),
                     "fallback": kill.get("fallback"), "rc": r.get("rc")}
    return out


def tiers_markdown(ts: dict, job: str, trigger: str) -> list[str]:
    if not ts:
        return []
    rows = []
    for mode, t in ts.items():
        phases = ", ".join(f"{k} {v}" for k, v in (t["phases_s"] or {}).items()) or "-"
        speed = ("-" if t["steps_per_s_during"] is None else
                 f"{fmt_s(t['steps_per_s_during'], 1)} / {fmt_s(t['steps_per_s_after'], 1)}"
                 f" ({fmt_ratio(t['slowdown'])})")
        rows.append([mode, t["standby_mode"] or "-", fmt_s(t["warm_up_s"]), phases, speed,
                     fmt_s(t["steps_per_s"], 1), fmt_s(t["total_s"]), fmt_s(t["cold_start_s"]),
                     fmt_ratio(t["ratio"]), (t["path"] or "-") + (
                         f" ({t['fallback']})" if t["fallback"] else ""), str(t["rc"])])
    return ["#### Warm-up tiers, one against another (TensorFlow)", "",
            f"Job: {job}. One run per `standby` setting, side by side, killed once "
            f"(`{trigger}`: after the standby is ready; off: after a checkpoint). Warm-up = "
            "`standby_started` -> `standby_ready` (its phases: the standby's own marks, s from "
            "its start); worker speed = steps per second between its checkpoint commits while "
            "the standby warmed up / after (after / during in brackets: the slowdown); "
            "attempt 1's speed over all its commits beside it. On JAX a warm compile cache is "
            "the cheaper tier (the compile cache table, section 5.4).", "",
            md_table(["standby", "standby's mode", "warm-up (s)", "warm-up phases (s)",
                      "worker steps/s during / after warm-up", "attempt 1 steps/s",
                      "kill -> first step (s)", "cold start (s)", "ratio", "path", "rc"],
                     rows), ""]

"""The bench's pure helpers on fixtures: statistics, tables, journal-based recovery breakdowns,
goodput bookkeeping and the report. The benchmark itself is not run here (scripts/bench)."""
import json
import os
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, ROOT)
from bench import arms, breakdown, report, standby_report, stats, targets  # noqa: E402
from orchestrator.ops import timeline  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "bench")


@pytest.fixture
def journal():
    with open(os.path.join(FIXTURES, "journal.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def baseline_lines():
    return arms.read_lines(os.path.join(FIXTURES, "baseline_events.jsonl"))


def test_median_spread_and_paired_ratios_skip_missing_values():
    assert stats.median([3.0, None, 1.0, 2.0]) == 2.0
    assert stats.median([None]) is None
    assert stats.spread([2.0, None, 5.0, 1.0]) == (1.0, 5.0)
    assert stats.paired_ratios([2.0, None, 9.0, 4.0], [1.0, 3.0, 3.0, 0.0]) == [2.0, 3.0]
    assert stats.fmt_median([1.0, 3.0, 2.0]) == "2.00 (1.00-3.00, n=3)"
    assert stats.fmt_median([None]) == "-"


def test_interleaved_order_runs_every_arm_once_per_repetition():
    assert stats.interleaved(["A", "B"], 2) == [(0, "A"), (0, "B"), (1, "A"), (1, "B")]


def test_markdown_table_escapes_pipes():
    assert stats.md_table(["a", "b|c"], [[1, "x|y"]]).splitlines() == [
        "| a | b\\|c |", "|---|---|", "| 1 | x\\|y |"]


def test_recovery_breakdown_from_the_journal(journal):
    ph = breakdown.orchestrator_recovery(journal, attempt=1, death=1005.5)
    assert ph == pytest.approx({"detected": 0.1, "stopped": 0.0, "process_started": 1.1,
                                "python_ready": 0.2,
                                "tf_imported": 1.9, "model_built": 0.9, "restored": 0.2,
                                "first_step": 0.6, "total": 5.0})


def test_a_hang_dies_at_its_last_heartbeat_and_is_stopped_after_detection(journal):
    hung = [dict(e) for e in journal if e["event"] != "attempt_ended" or e["attempt"] != 1]
    at = next(i for i, e in enumerate(hung) if e["event"] == "restart")
    hung[at:at] = [
        {"ts": 1015.0, "event": "hang_detected", "attempt": 1, "last_heartbeat_age_s": 10.5},
        {"ts": 1016.2, "event": "attempt_ended", "attempt": 1, "exit_code": -15},
    ]
    for e in hung[at + 2:]:  # the rest of the run happens later
        e["ts"] += 11.0
    death = breakdown.hang_death(hung, 1)
    assert death == pytest.approx(1004.5)
    ph = breakdown.orchestrator_recovery(hung, 1, death)
    assert ph["detected"] == pytest.approx(10.5)
    assert ph["stopped"] == pytest.approx(1.2)
    assert ph["process_started"] == pytest.approx(1017.7 - 1016.2)
    assert ph["total"] == pytest.approx(1021.5 - 1004.5)
    assert breakdown.hang_death(journal, 1) is None


def test_cold_start_and_useful_time_from_the_journal(journal):
    ph = breakdown.orchestrator_startup(journal, launched=999.9)
    assert ph["detected"] is None
    assert ph["process_started"] == pytest.approx(0.2)
    assert ph["total"] == pytest.approx(4.1)
    # useful time: the project's rule (orchestrator.ops.timeline), first step to last checkpoint
    assert timeline.account(timeline.build(journal))["useful_s"] == pytest.approx(1.0 + 1.5)
    assert breakdown.final_fingerprint(journal) == "bb"


def test_a_missing_point_folds_into_the_next_phase(journal):
    no_ready = [e for e in journal if not (e["event"] == "worker_ready" and e["attempt"] == 2)]
    ph = breakdown.orchestrator_recovery(no_ready, attempt=1, death=1005.5)
    assert ph["python_ready"] is None and ph["tf_imported"] is None
    assert ph["first_step"] == pytest.approx(1010.5 - 1006.7)
    assert ph["total"] == pytest.approx(5.0)


def test_shell_loop_recovery_and_progress_from_the_baseline_lines(baseline_lines):
    assert len(baseline_lines) == 14  # the torn last line is skipped
    ph = breakdown.baseline_recovery(baseline_lines, killed_pid=21, death=2006.0)
    assert ph["detected"] is None and ph["process_started"] is None
    assert ph["python_ready"] == pytest.approx(1.0)
    assert ph["total"] == pytest.approx(5.0)
    assert breakdown.baseline_recovery(baseline_lines, killed_pid=22, death=2014.0)["total"] is None
    at_kill = baseline_lines[:7]
    assert breakdown.baseline_progress(at_kill, 21, 10) == (17, 10)
    assert breakdown.baseline_startup(baseline_lines, launched=2000.0)["total"] == pytest.approx(4.0)
    assert breakdown.baseline_fingerprint(baseline_lines) == "cc"
    # pid 21 was killed, pid 22 finished: none failed on its own; unkilled, 21 did
    assert breakdown.baseline_failed_alone(baseline_lines, [{"pid": 21}]) == 0
    assert breakdown.baseline_failed_alone(baseline_lines, []) == 1
    # the same rule for the plain script: first step to the last saved epoch, per process
    assert breakdown.baseline_useful(baseline_lines) == pytest.approx(1.0 + 2.0)


def test_steps_redone_and_heartbeat_progress():
    assert breakdown.steps_redone([{"reached": 17, "saved": 10}, {"reached": 5, "saved": 10},
                                   {"reached": 23, "saved": 20}]) == 10
    assert breakdown.heartbeat_progress({"attempt": 2, "epoch": 3, "batch": 4}, 2, 10) == 34
    assert breakdown.heartbeat_progress({"attempt": 1, "epoch": 3, "batch": 4}, 2, 10) is None


def test_kill_schedule_is_seeded_and_spaced():
    a = arms.kill_schedule(7, 20.0, 4)
    assert a == arms.kill_schedule(7, 20.0, 4) != arms.kill_schedule(8, 20.0, 4)
    gaps = [t - s for s, t in zip((0.0,) + a, a)]
    assert all(15.0 <= g <= 25.0 for g in gaps)


def test_kill_schedule_until_a_time_keeps_killing_to_the_end_of_the_run():
    """The goodput run is killed every ~20 s until it ends: the schedule covers its timeout,
    so the number of kills follows from the run's length."""
    long = arms.kill_schedule(7, 20.0, until_s=400.0)
    assert long[:4] == arms.kill_schedule(7, 20.0, 4)  # the same draws, the same times
    assert long[-1] <= 400.0 < long[-1] + 25.0 and len(long) >= 400.0 / 25.0
    with pytest.raises(ValueError, match="exactly one"):
        arms.kill_schedule(7, 20.0, 4, until_s=100.0)


def test_kill_plan_on_schedule_or_after_a_checkpoint():
    sched = arms.KillPlan(offsets=(10.0, 30.0))
    assert not sched.due(105.0, 100.0, kills=0, checkpointed=True)
    assert sched.due(110.0, 100.0, kills=0, checkpointed=False)
    assert not sched.due(120.0, 100.0, kills=1, checkpointed=False)
    assert not sched.due(200.0, 100.0, kills=2, checkpointed=False)
    after = arms.KillPlan(after_checkpoint=1)
    assert after.due(0, 0, kills=0, checkpointed=True)
    assert not after.due(0, 0, kills=0, checkpointed=False)
    assert not after.due(0, 0, kills=1, checkpointed=True)


def test_summary_and_markdown_of_recorded_results():
    with open(os.path.join(FIXTURES, "results.json")) as f:
        results = json.load(f)
    s = report.summarise(results)
    o = results["overhead"]["digits"]
    assert s["overhead"]["digits"]["wall_ratio_vs_backup"] == pytest.approx(
        o["orchestrator"][0]["wall_s"] / o["keras_fit_backup"][0]["wall_s"])
    run = results["goodput"]["arms"]["standby_auto"][0]  # one repetition: its useful / wall
    assert s["goodput"]["arms"]["standby_auto"]["goodput"] == pytest.approx(
        run["useful_s"] / run["wall_s"])
    assert s["recovery"]["digits/kill, standby auto"]["n"] == 1
    # detected once the heartbeat was silent hang_timeout
    hang = s["recovery"]["digits/hang, standby auto"]
    assert hang["detected"] == pytest.approx(results["config"]["hang_timeout_s"], abs=1.0)
    assert s["faults"]["hang/auto"]["paths"] == ["warm"]
    assert s["largest_recovery_cost"]["auto"]["phase"] in breakdown.POINTS
    # the fault-free ratio with the standby off and on, per job; issue 27: no recovery > 1.0x
    assert len(s["targets"]) == 13
    results["summary"] = s
    md = report.markdown(results)
    assert "### Issue #12 targets" in md and "### 1. Overhead with no faults" in md
    assert "### 3. Goodput under a seeded SIGKILL schedule" in md
    assert "| raise | auto | raise=storage@step=5000 | 1 |" in md
    digits_row = next(line for line in md.splitlines() if line.startswith("| digits |"))
    assert stats.fmt_ratio(s["overhead"]["digits"]["wall_ratio_vs_backup"]) in digits_row


def test_benchmarks_md_keeps_the_prose_around_the_generated_part(tmp_path):
    p = tmp_path / "BENCHMARKS.md"
    p.write_text(f"# Benchmarks\n\nintro\n\n{report.BEGIN}\nold\n{report.END}\n\nnotes\n")
    report.update_benchmarks(str(p), "new table")
    text = p.read_text()
    assert "intro" in text and "notes" in text and "new table" in text and "old" not in text


def test_export_time_is_the_exported_event_s_own_measure(journal):
    assert breakdown.export_time(journal) is None
    done = journal + [{"ts": 1017.3, "event": "exported", "path": "export", "step": 40,
                       "seconds": 0.8124}]
    assert breakdown.export_time(done) == pytest.approx(0.812)


def test_standby_summary_sets_each_recovery_against_its_own_run_s_cold_start():
    from bench import report

    def run(totals, cold, rss):
        return {"recoveries": [{"total": t} for t in totals], "startup": {"total": cold},
                "recovery_paths": ["warm"] * len(totals), "worker_peak_rss_mb": 670.0,
                "standby_rss_mb": rss, "rc": 0, "fingerprint": "f"}

    s = report.standby_summary({"standby": {"digits/auto": run([0.1, 0.3], 5.0, [650.0, 660.0]),
                                            "digits/off": run([6.0], 4.0, [])}})
    assert s["digits/auto"]["kill_to_first_step_s"] == 0.2
    assert s["digits/auto"]["ratio_vs_cold_start"] == 0.04
    assert s["digits/auto"]["standby_rss_mb"] == 655.0
    assert s["digits/off"]["ratio_vs_cold_start"] == 1.5 and s["digits/off"]["standby_rss_mb"] is None


def test_checkpoint_stall_figures_and_the_in_line_arm_side_by_side():
    with open(os.path.join(FIXTURES, "results.json")) as f:
        results = json.load(f)
    synth = results["overhead"]["synthetic"]
    base = synth["orchestrator"][0]
    synth["orchestrator"] = [dict(base, train_s=10.0, checkpoints={
        "writer": ["background"], "stall_ms": [1.5, 2.5, 30.0], "write_ms": [40.0, 50.0, 60.0],
        "skipped_busy": 1, "waited_ms": [12.0]})]
    synth["orchestrator_sync"] = [dict(base, train_s=12.5, checkpoints={
        "writer": ["inline"], "stall_ms": [45.0, 55.0], "write_ms": [44.0, 54.0],
        "skipped_busy": 0, "waited_ms": []})]
    synth["keras_fit_backup"] = [dict(synth["keras_fit_backup"][0], train_s=10.0)]
    s = report.summarise(results)
    o = s["overhead"]["synthetic"]
    assert o["stall_ms"]["orchestrator"]["median"] == 2.5
    assert o["stall_ms"]["orchestrator"]["spread"] == (1.5, 30.0)
    assert o["stall_ms"]["orchestrator_sync"]["median"] == 50.0
    assert o["train_ratio_vs_sync"] == pytest.approx(0.8)
    assert o["sync_train_ratio_vs_backup"] == pytest.approx(1.25)
    results["summary"] = s
    md = report.markdown(results)
    assert "### 1b. Checkpoints off the training thread" in md
    row = next(line for line in md.splitlines() if line.startswith("| synthetic | background"))
    assert "2.5 (1.5-30.0, n=3)" in row and "1.5, 2.5, 30.0" in row and "1 / 1" in row
    assert "| synthetic | in line | 50.0 (45.0-55.0, n=2)" in md
    assert "background / in line (paired): 0.800x" in md


def test_a_partial_run_summarises_the_parts_it_ran():
    with open(os.path.join(FIXTURES, "results.json")) as f:
        results = json.load(f)
    results["goodput"], results["recovery"] = {}, {}
    s = report.summarise(results)
    assert s["goodput"] == {} and s["recovery"] == {}
    results["summary"] = s
    assert "### 3. Goodput" not in report.markdown(results)


def test_a_self_inflicted_kill_dies_at_its_fault_event_and_the_journal_names_kind_and_path(
        journal):
    """``--fault kill@step=N``: death = the ``fault_injected`` event journaled before the
    signal; the recovery carries what the attempt died of and how the next one started."""
    ev = [dict(e) for e in journal]
    at = next(i for i, e in enumerate(ev) if e["event"] == "attempt_ended")
    ev.insert(at, {"ts": 1005.2, "event": "fault_injected", "source": "worker", "attempt": 1,
                   "fault": "kill@step=12", "step": 12})
    ev[at + 1]["kind"] = "killed"
    next(e for e in ev if e["event"] == "attempt_started" and e["attempt"] == 2)["path"] = "warm"
    ev.insert(-3, {"ts": 1011.0, "event": "fault_injected", "source": "worker", "attempt": 2,
                   "fault": "raise=storage@step=30", "step": 30})  # not a kill: no such death
    assert breakdown.injected_kill(ev, 1) == 1005.2
    assert breakdown.injected_kill(ev, 2) is None
    assert breakdown.injected_kill(journal, 1) is None
    assert breakdown.recovery_labels(ev, 1) == {"kind": "killed", "path": "warm"}
    assert breakdown.recovery_labels(ev, 2) == {"kind": None, "path": None}


def _orch_run(cold, recoveries, rc=0, fingerprint="w", wall=100.0, useful=80.0, kills=()):
    return {"rc": rc, "wall_s": wall, "useful_s": useful, "startup": {"total": cold},
            "fingerprint": fingerprint, "kills": list(kills),
            "recovery_paths": [p for _, _, p in recoveries],
            "failures": [{"kind": k} for k, _, _ in recoveries],
            "recoveries": [{"kind": k, "total": t, "path": p} for k, t, p in recoveries],
            "standby_rss_mb": [600.0], "worker_peak_rss_mb": 700.0}


def test_fault_recoveries_against_each_run_s_own_cold_start():
    rec = {"faults": {"kill": "kill@step=10", "raise": "raise=storage@step=20",
                      "hang": "hang@step=30"},
           "kinds": {"kill": "killed", "raise": "storage", "hang": "hang"},
           "runs": {"auto": [_orch_run(5.0, [("killed", 0.5, "warm"), ("storage", 1.5, "warm"),
                                             ("hang", 7.0, "warm")]),
                             _orch_run(10.0, [("killed", 2.0, "warm"), ("storage", 4.0, "cold"),
                                              ("hang", 10.0, "warm")])],
                    "off": [_orch_run(5.0, [("killed", 5.0, "cold")])]}}
    f = targets.fault_recoveries(rec, hang_timeout_s=6.0)
    kill = f["kill/auto"]  # ratios 0.1 and 0.2: each against its own run's cold start
    assert kill["ratio"] == pytest.approx(0.15) and kill["ratio_spread"] == (0.1, 0.2)
    assert kill["passed"] and kill["all_warm"] and kill["spec"] == "kill@step=10"
    raised = f["raise/auto"]  # 0.3 and 0.4: the median passes, one recovery was cold
    assert raised["ratio"] == pytest.approx(0.35) and raised["passed"]
    assert not raised["all_warm"] and raised["paths"] == ["warm", "cold"]
    hang = f["hang/auto"]  # (7 - 6) / 5 = 0.2 and (10 - 6) / 10 = 0.4
    assert hang["ratio"] == pytest.approx(0.3) and hang["passed"]
    assert f["kill/off"]["ratio"] == 1.0 and not f["kill/off"]["passed"]
    assert f["raise/off"]["n"] == 0 and f["raise/off"]["passed"] is None


def test_goodput_summary_counts_kills_warm_and_cold_and_checks_the_weights():
    auto = _orch_run(8.0, [("killed", 0.5, "warm"), ("killed", 8.0, "cold"),
                           ("killed", 0.7, "warm")], wall=160.0, useful=128.0,
                     kills=[{"reached": 30, "saved": 24}])
    off = _orch_run(8.0, [("killed", 8.0, "cold")] * 2, wall=200.0, useful=120.0,
                    fingerprint="w")
    loop = {"rc": 0, "wall_s": 210.0, "useful_s": 105.0, "fingerprint": "y",
            "kills": [{"reached": 5, "saved": 0}] * 3, "recoveries": [{"total": 9.0}] * 3}
    g = {"schedule_s": (18.0, 39.5), "reference": {},
         "arms": {"standby_auto": [auto], "standby_off": [off], "restart_loop": [loop]}}
    s = targets.goodput_summary(g)
    a = s["arms"]["standby_auto"]
    assert a["goodput"] == pytest.approx(0.8) and a["kills"] == 3
    assert (a["warm"], a["cold"]) == (2, 1) and a["steps_redone"] == 6
    assert a["kill_to_first_step_s"] == 0.7 and a["kill_ratio"] == pytest.approx(0.7 / 8.0, abs=1e-3)
    assert a["kill_ratio_spread"] == pytest.approx((0.5 / 8.0, 1.0), abs=1e-3)  # each kill
    assert a["fingerprint_equal"] == [None] and s["orchestrator_arms_agree"] is True
    lp = s["arms"]["restart_loop"]
    assert lp["kills"] == 3 and lp["warm"] is None and lp["goodput"] == pytest.approx(0.5)
    g["reference"] = {"orchestrator": {"rc": 0, "fingerprint": "w"},
                      "keras_fit_backup": {"rc": 0, "fingerprint": "y"}}
    s = targets.goodput_summary(g)
    assert s["arms"]["standby_off"]["fingerprint_equal"] == [True]
    assert s["arms"]["restart_loop"]["fingerprint_equal"] == [True]  # against fit + B&R's
    g["reference"]["keras_fit_backup"]["fingerprint"] = "z"
    assert targets.goodput_summary(g)["arms"]["restart_loop"]["fingerprint_equal"] == [False]
    off["fingerprint"] = "v"
    assert targets.goodput_summary(g)["orchestrator_arms_agree"] is False


def test_every_target_is_stated_with_its_figure_and_verdict():
    recovery = {"kinds": {"kill": "killed", "raise": "storage", "hang": "hang"}, "faults": {},
                "runs": {"auto": [_orch_run(5.0, [("killed", 0.5, "warm"),
                                                 ("storage", 2.5, "adopted"),
                                                 ("hang", 7.0, "cold")])]}}
    s = {"faults": targets.fault_recoveries(recovery, 6.0),
         "goodput": targets.goodput_summary(
             {"schedule_s": (20.0,), "arms": {"standby_auto": [_orch_run(
                 8.0, [("killed", 0.4, "warm")], wall=100.0, useful=74.0)]}}),
         "overhead": {"synthetic": {"train_ratio_vs_backup": 1.15,
                                    "nostandby_train_ratio_vs_backup": 1.01, "stall_ms": {
             "orchestrator": {"median": 25.0, "spread": (2.0, 40.0), "n": 3}}}}}
    rows = {r["what"]: r for r in targets.target_rows(s)}
    assert rows["kill -> next first step, digits"]["passed"] is True
    raised = rows["raised error (storage) -> next first step"]
    assert raised["passed"] is False and "adopted path in 1" in raised["measured"]  # 0.5x
    hang = rows["hang -> next first step"]
    assert hang["passed"] is True and "cold path in 1" in hang["measured"]
    assert rows["kill -> next first step, synthetic ResNet-20 (goodput run)"]["passed"]
    auto = rows["goodput, orchestrator, standby: auto"]
    assert auto["passed"] is False and auto["measured"].startswith("0.740")
    assert rows["goodput, orchestrator, standby: off"]["measured"] == "not measured"
    assert rows["fault-free training time vs fit + BackupAndRestore, synthetic, "
                "standby: off"]["passed"]
    auto_cost = rows["fault-free training time vs fit + BackupAndRestore, synthetic, "
                     "standby: auto (its warm-up beside the worker)"]
    assert auto_cost["measured"] == "1.150x" and auto_cost["passed"] is None
    assert rows["training-thread stall per checkpoint, ResNet-20, median"]["passed"] is False
    md = "\n".join(targets.targets_markdown({"targets": list(rows.values())}))
    assert "| goodput, orchestrator, standby: auto | >= 0.75 | 0.740" in md and "**FAIL**" in md


def test_the_last_error_of_a_plain_script_s_log(tmp_path):
    log = tmp_path / "out.log"
    log.write_text("Epoch 1/80\nTraceback (most recent call last):\n  File x\n"
                   "OSError: Unable to synchronously open file (bad object header version "
                   "number)\n[loop] exit 1; restart 21 in 1.0s\nKilled\n")
    assert arms.last_error(str(log)) == ("OSError: Unable to synchronously open file (bad "
                                         "object header version number)")
    log.write_text("Epoch 1/80\nall fine\n")
    assert arms.last_error(str(log)) is None
    assert arms.last_error(str(tmp_path / "absent.log")) is None


def test_backends_side_by_side_run_each_arm_on_both_before_the_next_arm():
    """The two backends' runs of an arm are neighbours in time; an arm one backend does not
    run is run once; the order repeats per repetition."""
    order = stats.side_by_side({"tensorflow": ["A", "B", "C"], "jax": ["B", "C"]}, 2)
    assert order[:5] == [(0, "tensorflow", "A"), (0, "tensorflow", "B"), (0, "jax", "B"),
                         (0, "tensorflow", "C"), (0, "jax", "C")]
    assert order[5:] == [(1, b, a) for _, b, a in order[:5]]
    assert stats.side_by_side({"jax": ["X"]}, 1) == [(0, "jax", "X")]


def test_parse_backends_keeps_the_order_given_and_refuses_unknown_names():
    import argparse

    from bench.__main__ import parse_backends

    assert parse_backends("tensorflow,jax") == ("tensorflow", "jax")
    assert parse_backends(" JAX , jax") == ("jax",)
    for bad in ("torch", "", "jax,torch"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_backends(bad)


def test_each_arm_says_its_backend_and_only_the_bench_s_compile_cache():
    """A shell's KERAS_BACKEND must not turn a TensorFlow arm into a JAX one, nor a shell's
    JAX_COMPILATION_CACHE_DIR make every JAX cold start warm."""
    shell = {"PATH": "/bin", "KERAS_BACKEND": "jax", "JAX_COMPILATION_CACHE_DIR": "/shared"}
    tf = arms.backend_env("tensorflow", base=shell)
    assert tf["KERAS_BACKEND"] == "tensorflow" and "JAX_COMPILATION_CACHE_DIR" not in tf
    assert tf["PATH"] == "/bin" and shell["KERAS_BACKEND"] == "jax"  # the shell's left alone
    jx = arms.backend_env("jax", compile_cache="/bench/c", base=shell)
    assert jx["KERAS_BACKEND"] == "jax" and jx["JAX_COMPILATION_CACHE_DIR"] == "/bench/c"


def test_the_backend_and_compile_cache_a_run_started_with_come_from_its_journal(journal):
    assert breakdown.backend_of(journal) is None  # a journal from before JAX: no word
    assert breakdown.compile_cache_at_start(journal) is None
    ev = [dict(e) for e in journal]
    ready = [e for e in ev if e["event"] == "worker_ready"]
    ready[0].update(backend="jax", compile_cache={"dir": "/c", "pulled": 0,
                                                  "entries_at_start": 0})
    ready[1].update(backend="jax", compile_cache={"dir": "/c", "pulled": 0,
                                                  "entries_at_start": 7})
    assert breakdown.backend_of(ev) == "jax"
    assert breakdown.compile_cache_at_start(ev)["entries_at_start"] == 0
    assert breakdown.compile_cache_at_start(ev, attempt=2)["entries_at_start"] == 7


def _cache_run(cold, entries, rc=0):
    return {"rc": rc, "startup": {"total": cold, "first_step": cold - 3.0},
            "compile_cache": None if entries is None else {"entries_at_start": entries}}


def test_compile_cache_summary_pairs_an_empty_cold_start_with_a_warm_one():
    cache = {"runs": {"digits": [{"empty": _cache_run(15.0, 0), "warm": _cache_run(6.0, 12)},
                                 {"empty": _cache_run(12.0, 0), "warm": _cache_run(6.0, 12)}],
                      "synthetic": [{"empty": _cache_run(25.0, 3), "warm": _cache_run(5.0, 40)}]}}
    c = report.cache_summary(cache)
    d = c["digits"]
    assert (d["empty_s"], d["warm_s"], d["n"]) == (13.5, 6.0, 2)
    assert d["ratio"] == pytest.approx((0.4 + 0.5) / 2)  # paired: 6/15 and 6/12
    assert d["ratio_spread"] == pytest.approx((0.4, 0.5))
    assert d["empty_phases"]["first_step"] == 10.5 and d["as_claimed"] and d["all_ok"]
    assert d["entries"] == [(0, 12), (0, 12)]
    assert not c["synthetic"]["as_claimed"]  # its 'empty' cache was not empty
    assert report.cache_summary({}) == {}


def test_jax_targets_are_issue_23_s_on_the_same_rows():
    rec = {"faults": {}, "kinds": {"kill": "killed", "raise": "storage", "hang": "hang"},
           "runs": {"auto": [_orch_run(10.0, [("killed", 0.8, "warm"), ("storage", 1.5, "warm"),
                                              ("hang", 6.5, "warm")])]}}
    tf, jx = (targets.fault_recoveries(rec, 6.0, lim) for lim in (targets.TENSORFLOW,
                                                                   targets.JAX))
    assert tf["kill/auto"]["passed"] and jx["kill/auto"]["passed"]  # 0.08x
    assert tf["raise/auto"]["passed"] and not jx["raise/auto"]["passed"]  # 0.15x
    assert jx["hang/auto"]["target"] == 0.10 and jx["hang/auto"]["passed"]  # 0.05x beyond
    g = targets.goodput_summary({"schedule_s": (20.0,), "arms": {"standby_auto": [_orch_run(
        10.0, [("killed", 0.8, "warm")], wall=100.0, useful=85.0)]}})
    rows = {lim.title: {r["what"]: r for r in targets.target_rows(
        {"faults": f, "goodput": g}, lim)} for lim, f in ((targets.TENSORFLOW, tf),
                                                         (targets.JAX, jx))}
    auto = "goodput, orchestrator, standby: auto"
    assert rows["Issue #12 targets"][auto]["passed"] is True  # 0.85 >= 0.75
    assert rows["Issue #23 targets, JAX"][auto]["passed"] is False  # 0.85 < 0.90
    assert rows["Issue #23 targets, JAX"][auto]["target"] == ">= 0.90"
    md = "\n".join(targets.targets_markdown(
        {"targets": list(rows["Issue #23 targets, JAX"].values())}, targets.JAX))
    assert md.startswith("### Issue #23 targets, JAX") and "<= 0.10x cold start" in md


def _jax_part(results):
    """The fixture's TensorFlow runs standing in for JAX's, with JAX's arms: overhead with
    standby: off and fit + B&R, goodput with the standby on and off, a compile-cache pair."""
    import copy

    tf = copy.deepcopy(results)
    for r in [r for job in tf["overhead"].values() for rs in job.values() for r in rs] + [
            r for rs in tf["goodput"]["arms"].values() for r in rs]:
        r["backend"] = "jax"
    over = {job: {"orchestrator_standby_off": [dict(runs["orchestrator"][0], train_s=9.0,
                                                    startup={"total": 20.0})],
                  "keras_fit_backup": [dict(runs["keras_fit_backup"][0], train_s=10.0)]}
            for job, runs in tf["overhead"].items()}
    good = dict(tf["goodput"], arms={a: tf["goodput"]["arms"][a]
                                     for a in ("standby_auto", "standby_off")})
    cache = {"runs": {"digits": [{"empty": dict(_cache_run(15.0, 0), backend="jax"),
                                  "warm": dict(_cache_run(6.0, 12), backend="jax")}]}}
    return {"jobs": tf["jobs"], "overhead": over, "goodput": good, "recovery": tf["recovery"],
            "cache": cache}


def test_a_jax_part_is_summarised_beside_tensorflow_s_with_its_own_targets():
    with open(os.path.join(FIXTURES, "results.json")) as f:
        results = json.load(f)
    results["jax"] = _jax_part(results)
    s = report.summarise(results)
    assert len(s["targets"]) == 13  # TensorFlow's table as it was (and issue 27's row)
    j = s["jax"]
    assert j["cold_start"]["digits/orchestrator"]["total"] == 20.0  # from standby: off's run
    assert j["overhead"]["digits"]["nostandby_train_ratio_vs_backup"] == pytest.approx(0.9)
    assert j["overhead"]["digits"]["train_ratio_vs_backup"] is None  # no default arm on JAX
    assert "orchestrator_standby_off" in j["overhead"]["synthetic"]["stall_ms"]
    assert j["trained_on"] == {"jax": 8, "None": 1}  # the recovery run has no word (fixture)
    assert j["cache"]["digits"]["ratio"] == pytest.approx(0.4)
    rows = {r["what"]: r for r in j["targets"]}
    assert rows["kill -> next first step, digits"]["target"] == "<= 0.10x cold start"
    assert rows["goodput, Keras fit + BackupAndRestore in a shell loop"]["measured"] == \
        "not measured"
    assert report._cell(0.5, 0.1, (0.05, 0.2)) == "0.50 s (0.100x, 0.050-0.200x)"  # min-max
    assert report._cell(0.5, 0.1, (0.1, 0.1)) == "0.50 s (0.100x)" and report._cell(None) == "-"
    side = {r[0]: r[1:] for r in report.side_by_side(s)}
    tf_cold = s["cold_start"]["digits/orchestrator"]["total"]
    assert side["cold start (launch -> first step), digits, orchestrator"] == [
        f"{tf_cold:.2f} s", "20.00 s"]
    assert side["cold start with a warm compile cache, digits (empty -> warm)"] == [
        "-", "15.00 s -> 6.00 s (0.400x)"]
    assert side["fault-free training vs fit + BackupAndRestore, digits, standby: off"][1] == \
        "0.900x"
    results["summary"] = s
    md = report.markdown(results)
    assert md.count("### Issue #12 targets") == 1 and "### Issue #23 targets, JAX" in md
    assert "### TensorFlow and JAX side by side" in md and "### 5. JAX" in md
    assert "#### 5.4 The compile cache" in md and "| digits | 1 | 15.00 | 6.00 | 0.400x" in md
    assert "-> Keras on JAX imported" in md
    results["backends"] = ["jax"]  # --backends jax: no TensorFlow tables, all empty
    md = report.markdown(results)
    assert "### Issue #12 targets" not in md and "### 1. Overhead" not in md
    assert "### Issue #23 targets, JAX" in md and "#### 5.4 The compile cache" in md
    del results["jax"], results["backends"]
    results["summary"] = report.summarise(results)
    assert "jax" not in results["summary"] and "### 5. JAX" not in report.markdown(results)


# ---------------------------------------------------------------- issue 27: the warm standby
def _ev(ts, event, **kw):
    return dict(ts=ts, event=event, **kw)


def test_kill_triggers_parse_and_a_typo_fails_at_once():
    assert arms.parse_trigger("first_step+1.5") == ("first_step", 1.5)
    assert arms.parse_trigger("checkpoint") == ("checkpoint", 0.0)
    with pytest.raises(ValueError, match="anchor"):
        arms.KillPlan(triggers=("checkpoint", "standby_redy"))


def test_kill_plan_fires_each_trigger_in_turn_from_its_anchor():
    plan = arms.KillPlan(triggers=("checkpoint+20", "first_step+1.5", "standby_ready"))
    a = {"first_step": 100.0, "checkpoint": 101.0, "standby_ready": None}
    assert not plan.due(120.9, 0.0, kills=0, checkpointed=True, anchors=a)
    assert plan.due(121.0, 0.0, kills=0, checkpointed=True, anchors=a)
    assert not plan.due(101.4, 0.0, kills=1, checkpointed=True, anchors=a)
    assert plan.due(101.5, 0.0, kills=1, checkpointed=False, anchors=a)
    assert not plan.due(500.0, 0.0, kills=2, checkpointed=True, anchors=a)  # not ready yet
    assert plan.due(130.0, 0.0, kills=2, checkpointed=True, anchors=dict(a, standby_ready=129.0))
    assert not plan.due(999.0, 0.0, kills=3, checkpointed=True, anchors=a)  # all fired
    assert not plan.due(999.0, 0.0, kills=0, checkpointed=True, anchors=None)


def test_kill_anchors_from_the_journal_and_the_fallback_where_no_standby_will_be_ready():
    events = [_ev(10.0, "attempt_started", attempt=2), _ev(20.0, "first_step", attempt=2),
              _ev(19.0, "checkpoint_committed", step=5),  # before the first step: not it
              _ev(21.2, "checkpoint_committed", step=10),
              _ev(22.0, "checkpoint_committed", step=15)]
    a = arms.kill_anchors(events, 2, now=21.5)
    assert (a["first_step"], a["checkpoint"], a["standby_ready"]) == (20.0, 21.2, None)
    # no standby started for attempt 3, and the attempt has trained STANDBY_WAIT_S: none will be
    a = arms.kill_anchors(events, 2, now=20.0 + arms.STANDBY_WAIT_S)
    assert a["standby_ready"] == 21.2 and a["fallback"] == "no standby for attempt 3"
    warming = events + [_ev(20.5, "standby_started", for_attempt=3, pid=7)]
    a = arms.kill_anchors(warming, 2, now=60.0)
    assert a["standby_ready"] is None and a["fallback"] is None  # it warms up: wait for it
    ready = warming + [_ev(31.0, "standby_ready", for_attempt=3, pid=7)]
    assert arms.kill_anchors(ready, 2, now=31.5)["standby_ready"] == 31.0
    gone = warming + [_ev(25.0, "standby_discarded", for_attempt=3, pid=7)]
    a = arms.kill_anchors(gone, 2, now=25.5)
    assert a["standby_ready"] == 21.2 and a["fallback"] == "the standby for attempt 3 was discarded"
    assert arms.kill_anchors(events, 3, now=99.0)["first_step"] is None


def _standby_journal():
    """Attempt 1 trains 10 steps/s, 5 steps/s while the standby for attempt 2 warms up
    (started at 11, ready at 17), and is killed; the standby is promoted."""
    ev = [_ev(1.0, "attempt_started", attempt=1, pid=5, path="cold"),
          _ev(10.0, "first_step", attempt=1),
          _ev(10.5, "standby_decided", for_attempt=2, mode="warm", reason="standby: on (x)"),
          _ev(11.0, "standby_started", for_attempt=2, pid=9, mode="warm")]
    ev += [_ev(11.0 + 2 * i, "checkpoint_committed", step=10 * (i + 1)) for i in range(4)]
    ev += [_ev(17.0, "standby_ready", for_attempt=2, pid=9, phases_s={"tf_imported": 4.0})]
    ev += [_ev(17.0 + i, "checkpoint_committed", step=40 + 10 * i) for i in range(1, 4)]
    ev += [_ev(20.5, "attempt_ended", attempt=1, exit_code=-9, kind="killed"),
           _ev(20.6, "standby_promoted", attempt=2, pid=9),
           _ev(20.6, "attempt_started", attempt=2, pid=9, path="warm"),
           _ev(21.0, "first_step", attempt=2),
           _ev(21.1, "standby_decided", for_attempt=3, mode=None, reason="auto: " + "x" * 300)]
    return ev


def test_standby_warm_ups_decisions_and_the_worker_s_slowdown_from_the_journal():
    events = _standby_journal()
    [sb] = breakdown.standby_warmups(events)
    assert sb["for_attempt"] == 2 and sb["mode"] == "warm" and sb["warm_up_s"] == 6.0
    assert sb["outcome"] == "promoted" and sb["phases_s"] == {"tf_imported": 4.0}
    assert (sb["steps_per_s_during"], sb["steps_per_s_after"]) == (5.0, 10.0)
    assert sb["slowdown"] == 2.0
    # commits of another attempt do not count; nothing after: no slowdown
    assert breakdown.training_rates(events, 2, 0.0, 0.0)["slowdown"] is None
    assert breakdown.training_rates(events, 1, 0.0, 0.0)["after"] == pytest.approx(60 / 9.0,
                                                                                 abs=0.01)
    assert [d["mode"] for d in breakdown.standby_decisions(events)] == ["warm", None]


def _kills_run(mode, paths, totals, cold=10.0, triggers=arms.KillPlan(
        triggers=("checkpoint+20", "first_step+1.5", "standby_ready")).triggers):
    recs = [{"kind": "killed", "attempt": i + 1, "total": t, "path": p, "trigger": trig,
             "fallback": "no standby for attempt 4" if mode == "off" and i == 2 else None}
            for i, (t, p, trig) in enumerate(zip(totals, paths, triggers))]
    return {"rc": 0, "startup": {"total": cold}, "recovery_paths": paths, "recoveries": recs,
            "standby_decisions": breakdown.standby_decisions(_standby_journal()),
            "standbys": breakdown.standby_warmups(_standby_journal()), "steps_per_s": 7.8}


def test_recovery_by_kind_of_kill_side_by_side_and_the_1x_target():
    results = {"kills": {"triggers": ["checkpoint+20", "first_step+1.5", "standby_ready"],
                         "runs": {"auto": _kills_run("auto", ["cold", "adopted", "warm"],
                                                     [8.0, 10.5, 0.5]),
                                  "off": _kills_run("off", ["cold", "cold", "cold"],
                                                    [8.0, 8.2, 8.1])}}}
    ks = standby_report.kills_summary(results["kills"])
    assert [x["ratio"] for x in ks["runs"]["auto"]["rows"]] == [0.8, 1.05, 0.05]
    md = "\n".join(standby_report.kills_markdown(ks, "job"))
    assert "| (b) first_step+1.5 | 10.50 s (1.050x), adopted | 8.20 s (0.820x), cold |" in md
    assert "killed after a checkpoint: no standby for attempt 4" in md
    assert "| recovery paths (journal) | 1 warm, 1 adopted, 1 cold | 3 cold |" in md
    row = standby_report.recovery_target_row(results)
    assert row["passed"] is False and "worst 1.050x (kills: first_step+1.5, adopted" in \
        row["measured"] and "1 of 3 over" in row["measured"]
    results["kills"]["runs"]["auto"]["recoveries"][1]["total"] = 9.0
    assert standby_report.recovery_target_row(results)["passed"] is True
    # the goodput arms' recoveries of the default count too
    results["goodput"] = {"arms": {"standby_auto": [_kills_run("auto", ["cold"], [12.0])]}}
    row = standby_report.recovery_target_row(results)
    assert row["passed"] is False and "(goodput ~20 s, cold: 12.00 s" in row["measured"]
    assert standby_report.recovery_target_row({})["passed"] is None


def test_a_cold_recovery_is_cut_into_the_orchestrator_s_part_and_the_worker_s_start_up():
    run = _kills_run("off", ["cold", "cold", "warm"], [8.2, 7.5, 0.5], cold=8.0)
    run["startup"] = {"detected": None, "stopped": None, "process_started": 0.4,
                      "python_ready": 0.3, "tf_imported": 3.4, "model_built": 0.5,
                      "restored": 0.0, "first_step": 3.4, "total": 8.0}
    run["recoveries"][0].update(detected=0.12, stopped=0.0, process_started=0.02,
                                python_ready=0.3, tf_imported=3.7, model_built=0.5,
                                restored=0.08, first_step=3.48)
    rows = standby_report.cold_path_rows(run)
    # the cold start, then the two cold recoveries (the warm one is not a cold path)
    assert [r["label"] for r in rows] == ["cold start", "recovery of attempt 1 (checkpoint+20)",
                                          "recovery of attempt 2 (first_step+1.5)"]
    assert (rows[0]["before_worker_s"], rows[0]["worker_start_s"]) == (0.4, 4.2)
    assert (rows[1]["before_worker_s"], rows[1]["restore_s"], rows[1]["worker_start_s"],
            rows[1]["first_step_s"], rows[1]["ratio"]) == (0.14, 0.08, 4.5, 3.48, 1.025)
    assert rows[2]["before_worker_s"] is None and rows[2]["ratio"] == 0.938
    ks = standby_report.kills_summary({"triggers": ["checkpoint+20", "first_step+1.5",
                                                    "standby_ready"], "runs": {"off": run}})
    md = "\n".join(standby_report.kills_markdown(ks, "job"))
    assert "| off: recovery of attempt 1 (checkpoint+20) | 0.14 | 0.08 | 4.50 | 3.48 | 8.20 " \
           "| 1.025x |" in md
    assert "| off: cold start | 0.40 | 0.00 | 4.20 | 3.40 | 8.00 | 1.000x |" in md
    # a run whose recoveries were all warm has no row there
    ks["runs"]["off"]["cold_path"] = ks["runs"]["off"]["cold_path"][:1]
    assert "Where a cold recovery" not in "\n".join(standby_report.kills_markdown(ks, "job"))


def test_the_policy_s_decisions_are_listed_per_run_with_long_reasons_cut():
    results = {"kills": {"runs": {"auto": _kills_run("auto", ["cold", "warm"], [8.0, 0.5])}},
               "goodput": {"arms": {"standby_auto": [_kills_run("auto", ["warm"], [0.4])],
                                    "restart_loop": [{"recoveries": []}]}}}
    md = standby_report.decisions_markdown(results)
    assert "**kills, standby: auto** (recovery paths: cold, warm)" in md
    assert "**goodput ~20 s, orchestrator, standby: auto** (recovery paths: warm)" in md
    assert "- attempt 2: warm — standby: on (x)" in md
    cut = next(line for line in md if line.startswith("- attempt 3: none — auto: "))
    assert cut.endswith("…") and len(cut) == len("- attempt 3: none — ") + 160
    assert "- standby for attempt 2 (warm): promoted, warm-up 6.00 s" in md
    assert not any("Keras fit" in line for line in md)  # the shell loop has no policy
    assert standby_report.decisions_markdown({}) == []


def test_warm_up_tiers_one_against_another():
    on = _kills_run("on", ["warm"], [0.6], triggers=("standby_ready+5",))
    off = dict(_kills_run("off", ["cold"], [8.0], triggers=("standby_ready+5",)), standbys=[])
    ts = standby_report.tiers_summary({"trigger": "standby_ready+5", "runs": {"on": on,
                                                                              "off": off}})
    assert ts["on"]["warm_up_s"] == 6.0 and ts["on"]["slowdown"] == 2.0
    assert ts["on"]["ratio"] == 0.06 and ts["off"]["warm_up_s"] is None
    md = "\n".join(standby_report.tiers_markdown(ts, "digits", "standby_ready+5"))
    assert "| on | warm | 6.00 | tf_imported 4.0 | 5.0 / 10.0 (2.000x) | 7.8 | 0.60 |" in md
    assert "| off | - | - | - | - | 7.8 | 8.00 | 10.00 | 0.800x | cold | 0 |" in md


def test_goodput_counts_adopted_recoveries_apart():
    run = _orch_run(10.0, [("killed", 0.5, "warm"), ("killed", 0.6, "warm"),
                           ("killed", 9.0, "adopted"), ("killed", 8.0, "cold")])
    g = targets.goodput_summary({"schedule_s": (10.0,), "arms": {"standby_auto": [run]}})
    a = g["arms"]["standby_auto"]
    assert (a["warm"], a["adopted"], a["cold"]) == (2, 1, 1)
    md = "\n".join(targets.goodput_markdown({"goodput": g}, 1, 120.0, "job"))
    assert "every 120 s" in md and "| 2 / 1 / 1 |" in md


def test_issue_27_s_parts_and_jobs_per_mode(tmp_path):
    from bench import __main__ as bench_main

    full = bench_main.prepare_jobs(bench_main.FULL, str(tmp_path / "full"))
    kills = report.read_job(full["kills_auto"])
    assert kills["standby"] == "auto" and kills["epochs"] == bench_main.FULL.kills_epochs
    assert kills["data"]["args"]["synthetic"] and report.read_job(full["kills_off"])[
        "standby"] == "off"
    assert report.read_job(full["goodput_long_off"])["epochs"] == 190
    assert {report.read_job(full[f"tiers_{m}"])["standby"] for m in
            ("import_only", "on", "off")} == {"import_only", "on", "off"}
    arms.KillPlan(triggers=bench_main.KILL_TRIGGERS + (bench_main.FULL.tiers_trigger,))
    # ~2 kills at ~120 s within the run's timeout
    assert len(arms.kill_schedule(bench_main.FULL.seed, 120.0,
                                  until_s=bench_main.FULL.goodput_long_timeout_s)) >= 2
    quick = bench_main.prepare_jobs(bench_main.QUICK, str(tmp_path / "quick"))
    assert "kills_auto" in quick and "goodput_long_auto" not in quick \
        and "tiers_on" not in quick
    assert {"kills", "goodput_2min", "tiers"} <= set(bench_main.DEFAULT_PARTS)


def test_issue_27_s_sections_in_the_generated_markdown():
    with open(os.path.join(FIXTURES, "results.json")) as f:
        results = json.load(f)
    triggers = ["checkpoint+20", "first_step+1.5", "standby_ready"]
    results["kills"] = {"triggers": triggers, "runs": {
        "auto": _kills_run("auto", ["cold", "adopted", "warm"], [8.0, 9.0, 0.5]),
        "off": _kills_run("off", ["cold", "cold", "cold"], [8.0, 8.2, 8.1])}}
    long_run = dict(_orch_run(10.0, [("killed", 0.5, "warm")]),
                    standby_decisions=[{"for_attempt": 2, "mode": "warm", "reason": "r2"}])
    results["goodput_2min"] = {"schedule_s": [100.06, 208.7], "every_s": 120.0,
                               "arms": {"standby_auto": [long_run], "standby_off": [long_run]}}
    results["tiers"] = {"trigger": "standby_ready+5", "runs": {
        "on": _kills_run("on", ["warm"], [0.6], triggers=("standby_ready+5",))}}
    results["summary"] = s = report.summarise(results)
    assert s["targets"][-1]["passed"] is True  # 0.9x at worst
    md = report.markdown(results)
    assert "#### Recovery by kind of kill, standby: auto vs off" in md
    assert md.index("### 3. Goodput") < md.index("### 3b. Goodput under a seeded SIGKILL "
                                                 "every ~2 min") < md.index("#### The standby")
    assert "**goodput ~2 min, orchestrator, standby: off** (recovery paths: warm)" in md
    assert "#### Warm-up tiers, one against another" in md and "| on | warm | 6.00 |" in md
    assert "no kill recovery slower than 1.0x" in md
    assert "| synthetic/kill at first_step+1.5, standby off (n=1) |" in md  # broken down


def test_bigstate_counts_what_a_step_changes_trained_whole_or_with_the_backbone_frozen():
    from bench import bigstate

    args = {"features": 4, "width": 8, "hidden": 2, "classes": 3}
    backbone, head = 4 * 8 + 8 + 8 * 8 + 8, 8 * 3 + 3
    whole = bigstate.model_bytes(args, frozen=False)
    assert whole["weights"] == 4 * (backbone + head)
    assert whole["changed"] == 4 * 3 * (backbone + head) + 16 == whole["state"]
    frozen = bigstate.model_bytes(args, frozen=True)
    assert frozen["changed"] == 4 * 3 * head + 16
    assert frozen["state"] == 4 * (backbone + head + 2 * head) + 16


def test_bigstate_targets_judge_our_arm_against_the_plain_ones_of_the_same_run():
    from bench import bigstate

    def plain(train_s, rss, ms, size):
        return {"rc": 0, "train_s": train_s, "peak_rss_mb": rss, "fingerprint": "f",
                "saves": {"ms": ms, "bytes": [size] * len(ms)}}

    gb = 10**9
    ours = {"rc": 0, "train_s": 10.4, "worker_peak_rss_mb": 1400.0, "fingerprint": "w",
            "checkpoints": {"stall_ms": [30.0, 10.0, 20.0], "write_ms": [900, 800, 1000]},
            "state_bytes": [gb, gb, gb], "bytes_uploaded": []}
    killed = {"rc": 0, "fingerprint": "w", "startup": {"total": 8.0},
              "recoveries": [{"total": 10.0, "restored": 2.5, "path": "warm"}],
              "dd_s": 0.4, "dd_bytes": gb, "standby_rss_mb": [900.0], "checkpoints": {
                  "stall_ms": [], "write_ms": []}}
    part = {"tensorflow": {"jobs": {"trained": {
        "keras_fit": plain(9.5, 1000.0, [], 0), "keras_fit_backup": plain(10.0, 1100.0,
                                                                          [400.0], gb),
        "orchestrator": ours, "orchestrator_killed": killed}},
        "model": {"trained": {"weights": gb // 3, "state": gb, "changed": gb}}}}
    x = bigstate.summary(part)["tensorflow"]["trained"]
    assert x["orchestrator"]["stall_ms"] == 20.0 and x["keras_fit_backup"]["stall_ms"] == 400.0
    assert x["recovery"]["ratio"] == 1.25 and x["recovery"]["exact"] is True
    rows = {r["what"]: r for r in targets.bigstate_rows(x)}
    assert rows["training time vs fit + BackupAndRestore"]["passed"] is True  # 1.04
    assert rows["training time vs plain fit"]["passed"] is True  # 1.095
    assert rows["median stall per checkpoint, ms per GB of state"]["passed"] is True
    assert rows["bytes per checkpoint vs bytes changed"]["passed"] is True
    assert rows["worker peak RSS vs plain fit's"]["passed"] is False  # 1.4x
    assert rows["kill -> next first step vs cold start"]["passed"] is False  # 1.25x
    md = "\n".join(bigstate.markdown(bigstate.summary(part), targets.bigstate_rows))
    assert "#### trained, tensorflow" in md and "**FAIL**" in md and "1.250x" in md


def test_bigstate_dd_reads_the_blobs_a_checkpoint_names_not_only_its_folder(tmp_path):
    """Format 2 keeps a checkpoint's arrays in its tier's blobs/, shared between checkpoints:
    ``dd`` of the folder alone read a few hundred bytes (the bench said "0 MiB")."""
    import numpy as np

    from bench import bigstate
    from orchestrator.checkpoint.store import CheckpointStore

    tier = str(tmp_path / "checkpoints")
    store = CheckpointStore(tier)
    same = np.arange(1000, dtype="float32")
    store.commit(1, None, {"epoch": 1, "batch": 0, "metrics": {}},
                 arrays={"a": same, "b": np.ones(500, dtype="float32")})
    store.commit(2, None, {"epoch": 2, "batch": 0, "metrics": {}},
                 arrays={"a": same, "b": np.zeros(500, dtype="float32")})
    newest = store.list()[-1]
    files = bigstate.restore_files(tier, newest)
    named = [f for f in files if f.startswith(os.path.join(tier, "blobs"))]
    assert len(named) == 2 and all(os.path.exists(f) for f in files)
    assert sum(os.path.getsize(f) for f in named) == same.nbytes + 500 * 4

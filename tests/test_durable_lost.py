"""What a recycled runtime's write-back cache took with it (checkpoint/lost.py), and goodput's
charge for it (ops/timeline.py)."""
from orchestrator.checkpoint.lost import durable_lost
from orchestrator.checkpoint.store import Checkpoint
from orchestrator.ops import timeline

OUTER = [
    {"ts": 900.0, "event": "runtime_requested", "session": "orc-1", "kind": "cpu"},
    {"ts": 910.0, "event": "runtime_allocated", "session": "orc-1"},
    {"ts": 950.0, "event": "remote_run_started", "session": "orc-1"},
    {"ts": 1400.0, "event": "runtime_ended", "session": "orc-1", "why": "lost", "step": 1515},
    {"ts": 1410.0, "event": "runtime_requested", "session": "orc-2", "kind": "cpu"},
    {"ts": 1420.0, "event": "runtime_allocated", "session": "orc-2"},
]


def _have(step, committed_at):
    return Checkpoint(step, f"/d/{step:010d}", {"committed_at": committed_at})


def test_steps_the_outer_journal_knew_and_drive_does_not_hold_are_lost():
    lost = durable_lost([], OUTER, _have(1000, committed_at=1100.0))
    assert lost == {"steps": [1001, 1515], "lost_s": 300.0, "known_from": "runtime orc-1"}


def test_the_run_s_own_journal_counts_where_it_reached_the_cloud():
    events = [{"ts": 1200.0, "event": "checkpoint_committed", "step": 1200},
              {"ts": 1300.0, "event": "checkpoint_durable", "step": 1400}]
    lost = durable_lost(events, [], _have(1200, committed_at=1200.0))
    assert lost["steps"] == [1201, 1400] and lost["lost_s"] == 100.0
    assert lost["known_from"] == "journal"


def test_nothing_lost_when_the_tier_holds_the_last_progress_and_said_once():
    assert durable_lost([], OUTER, _have(1515, committed_at=1390.0)) is None
    said = [{"ts": 1430.0, "event": "durable_lost", "steps": [1001, 1515]}]
    assert durable_lost(said, OUTER, _have(1000, committed_at=1100.0)) is None


def test_nothing_in_the_tier_at_all_loses_everything_since_the_runtime_started():
    lost = durable_lost([], OUTER, None)
    assert lost["steps"] == [1, 1515] and lost["lost_s"] == 450.0


def test_goodput_charges_the_lost_training():
    events = [
        {"ts": 1000.0, "event": "run_started", "epochs": 2},
        {"ts": 1000.0, "event": "attempt_started", "attempt": 1},
        {"ts": 1010.0, "event": "first_step", "attempt": 1},
        {"ts": 1110.0, "event": "checkpoint_committed", "step": 100},
        {"ts": 2000.0, "event": "run_resumed", "epochs": 2},
        {"ts": 2000.0, "event": "durable_lost", "steps": [51, 100], "lost_s": 40.0},
    ]
    a = timeline.account(timeline.build(events, now=2000.0))
    assert a["useful_s"] == 100.0 - 40.0
    assert a["by_cause_s"]["durable_lost"] == 40.0
    assert a["lost_to_faults_s"] >= 40.0


def test_a_state_file_that_reached_the_cloud_without_its_checkpoint_tells_the_loss():
    states = [{"step": 1000, "written_at": 1100.0}, {"step": 1200, "written_at": 1250.0}]
    lost = durable_lost([], [], _have(1000, committed_at=1100.0), states)
    assert lost == {"steps": [1001, 1200], "lost_s": 150.0, "known_from": "state file"}

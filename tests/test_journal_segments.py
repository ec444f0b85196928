"""The run directory's journal in closed segments on a write-back cache (core/journal.py,
supervise/controlmirror.py): every event reaches closed files, readers see them all, in order."""
import os

from helpers import FakeClock
from orchestrator.core.journal import Journal, segment_paths
from orchestrator.core.outage import Outage
from orchestrator.core.rundir import RunDir
from orchestrator.supervise.controlmirror import ControlMirror


def _mirror(tmp_path, control="local-control", clock=None):
    rd = RunDir(str(tmp_path / "run"), str(tmp_path / control))
    os.makedirs(rd.root, exist_ok=True)
    rd.make()
    (tmp_path / "run" / "run.json").write_text("{}")
    clock = clock or FakeClock()
    return rd, ControlMirror(rd, Outage(Journal(rd.journal), rd.root), clock=clock,
                             segment_s=10.0), clock


def _names(path):
    return [e["event"] for e in Journal(str(path)).events()]


def test_the_run_directory_s_journal_is_closed_into_segments_read_in_order(tmp_path):
    rd, m, clock = _mirror(tmp_path)
    m.merge_on_start()
    local = Journal(rd.journal)
    durable = os.path.join(rd.root, "events.jsonl")
    names = []
    for i in range(7):
        names.append(f"e{i}")
        local.append(f"e{i}")
        assert m.sync()
        clock.advance(6.0)
    assert len(segment_paths(durable)) == 2   # closed once 10 s of lines are there
    assert _names(durable) == names            # segments, then the live file
    assert m.stop(flush_timeout=1.0)
    with open(durable, "rb") as f:
        assert f.read() == b""                 # the end: everything in closed files
    assert _names(durable) == names and len(segment_paths(durable)) == 3


def test_a_new_runtime_reads_the_history_from_the_segments(tmp_path):
    rd, m, clock = _mirror(tmp_path)
    m.merge_on_start()
    for i in range(4):
        Journal(rd.journal).append(f"e{i}")
        m.sync()
        clock.advance(11.0)
    m.stop(flush_timeout=1.0)
    # a recycled runtime: a fresh local control folder, the same run directory
    rd2, m2, _ = _mirror(tmp_path, control="other-control")
    assert m2.merge_on_start()["from_run_dir"] == 4
    assert _names(rd2.journal) == ["e0", "e1", "e2", "e3"]


def test_a_rotation_cut_short_leaves_each_event_once(tmp_path):
    rd, m, clock = _mirror(tmp_path)
    m.merge_on_start()
    for i in range(3):
        Journal(rd.journal).append(f"e{i}")
        m.sync()
    durable = os.path.join(rd.root, "events.jsonl")
    os.makedirs(os.path.join(rd.root, "events"))
    with open(durable, "rb") as f, open(os.path.join(rd.root, "events", "000001.jsonl"),
                                        "wb") as g:
        g.write(f.read())  # the segment written, the live file not emptied yet
    assert _names(durable) == ["e0", "e1", "e2"]


def test_status_reads_a_run_whose_live_journal_never_reached_the_cloud(tmp_path):
    from orchestrator.ops.status import run_status

    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "events" / "000001.jsonl").write_text(
        '{"ts": 1000, "event": "run_started", "epochs": 3}\n'
        '{"ts": 1001, "event": "attempt_started", "attempt": 1}\n')
    s = run_status(str(run), now=1010)
    assert s["epochs"] == 3 and s["attempt"] == 1


def test_another_journal_in_the_folder_never_reads_the_run_s_segments(tmp_path):
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "000001.jsonl").write_text('{"ts": 1, "event": "run_started"}\n')
    Journal(str(tmp_path / "runtimes.jsonl")).append("runtime_requested")
    assert _names(tmp_path / "runtimes.jsonl") == ["runtime_requested"]
    assert _names(tmp_path / "events.jsonl") == ["run_started"]

"""The control state on the local disk, mirrored to the run directory (supervise/controlmirror)."""
import os

from orchestrator import cli
from orchestrator.core.journal import Journal
from orchestrator.core.rundir import RunDir
from orchestrator.core import outage as outage_mod
from orchestrator.core.outage import Outage
from orchestrator.supervise.controlmirror import ControlMirror


def _mirror(tmp_path):
    rd = RunDir(str(tmp_path / "run"), str(tmp_path / "local-control"))
    os.makedirs(rd.root, exist_ok=True)
    rd.make()
    (tmp_path / "run" / "run.json").write_text("{}")
    return rd, ControlMirror(rd, Outage(Journal(rd.journal), rd.root))


def _names(path):
    return [e["event"] for e in Journal(str(path)).events()]


def test_a_new_vm_starts_from_the_run_directory_s_journal(tmp_path):
    rd, m = _mirror(tmp_path)
    durable = Journal(os.path.join(rd.root, "events.jsonl"))
    for name in ("run_started", "attempt_started", "epoch_completed"):
        durable.append(name)
    assert m.merge_on_start() == {"to_run_dir": 0, "from_run_dir": 3, "set_aside": None}
    assert _names(rd.journal) == ["run_started", "attempt_started", "epoch_completed"]


def test_events_a_surviving_vm_held_back_reach_the_run_directory_in_order(tmp_path):
    rd, m = _mirror(tmp_path)
    local = Journal(rd.journal)
    for name in ("run_started", "attempt_started"):
        local.append(name)
    durable_path = os.path.join(rd.root, "events.jsonl")
    with open(rd.journal, "rb") as f, open(durable_path, "wb") as g:
        g.write(f.read())  # what reached Drive before it went away
    for name in ("epoch_completed", "attempt_ended"):
        local.append(name)
    assert m.merge_on_start()["to_run_dir"] == 2
    with open(rd.journal, "rb") as f, open(durable_path, "rb") as g:
        assert f.read() == g.read()


def test_an_earlier_run_s_local_state_is_set_aside_for_a_new_run(tmp_path):
    rd, m = _mirror(tmp_path)
    Journal(rd.journal).append("run_started", job="old")
    os.remove(os.path.join(rd.root, "run.json"))  # the user deleted the run directory
    merged = m.merge_on_start()
    assert merged["set_aside"] and _names(os.path.join(merged["set_aside"], "events.jsonl")) \
        == ["run_started"]
    assert _names(rd.journal) == [] and not os.path.exists(os.path.join(rd.root, "events.jsonl"))


def test_an_outage_is_journaled_once_and_its_end_with_what_was_held_back(tmp_path, said):
    rd, m = _mirror(tmp_path)
    m.merge_on_start()
    journal = Journal(rd.journal)
    journal.append("first_step")
    assert m.sync()
    away = tmp_path / "run-away"
    os.rename(rd.root, away)
    (tmp_path / "run").write_text("the mount is gone")
    journal.append("epoch_completed")
    os.makedirs(os.path.join(rd.attempts), exist_ok=True)
    with open(rd.attempt_log(1), "ab") as f:
        f.write(b"epoch 1\n")
    assert not m.sync() and not m.sync()
    (tmp_path / "run").unlink()
    os.rename(away, rd.root)
    assert m.sync()
    names = _names(os.path.join(rd.root, "events.jsonl"))
    assert names.count("run_dir_unreachable") == 1 and names[-1] == "run_dir_restored"
    restored = Journal(rd.journal).events()[-1]
    assert restored["held_back"] == {"events": 2, "log_bytes": 8, "files": 0}
    with open(rd.journal, "rb") as f, open(os.path.join(rd.root, "events.jsonl"), "rb") as g:
        assert f.read() == g.read()
    with open(os.path.join(rd.root, "attempts", "1.log"), "rb") as f:
        assert f.read() == b"epoch 1\n"
    assert len(said) == 2  # one line when it went, one when it came back


def test_run_with_a_run_directory_that_never_answers_exits_4_with_a_clear_message(
        tmp_path, monkeypatch, capsys, fake_job):
    job = fake_job(epochs=1)
    (tmp_path / "run").write_text("a file where the run directory should be: a mount gone")
    monkeypatch.setattr(outage_mod, "START_RETRY_S", 0.5)
    rc = cli.main(["run", job])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_RUN_DIR
    assert str(tmp_path / "run") in err and "cannot be written" in err and "Traceback" not in err


def test_each_rank_s_heartbeat_is_mirrored_for_status(tmp_path):
    # a group's rank k beats (or is relayed) into rank-k/ of the control folder; its journal
    # there is the rank's own and stays local
    rd, m = _mirror(tmp_path)
    Journal(rd.journal).append("first_step")
    for rank in (1, 2):
        os.makedirs(rd.for_rank(rank))
        with open(os.path.join(rd.for_rank(rank), "heartbeat.json"), "w") as f:
            f.write('{"rank": %d}' % rank)
    Journal(os.path.join(rd.for_rank(1), "events.jsonl")).append("fault_injected")
    os.makedirs(os.path.join(rd.control, "rank-x"))  # not a rank's folder
    assert m.sync()
    for rank in (1, 2):
        with open(os.path.join(rd.root, f"rank-{rank}", "heartbeat.json")) as f:
            assert f.read() == '{"rank": %d}' % rank
    assert not os.path.exists(os.path.join(rd.root, "rank-1", "events.jsonl"))
    assert not os.path.exists(os.path.join(rd.root, "rank-x"))

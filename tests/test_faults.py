"""Fault specs, once-per-run firing, and the faulty checkpoint store (no TensorFlow)."""
import errno
import json
import os
import subprocess
import sys

import pytest

import ckarrays
from helpers import ROOT
from orchestrator.checkpoint import blobs
from orchestrator.recovery import faults
from orchestrator.checkpoint.store import CheckpointStore
from orchestrator.core.journal import Journal


@pytest.mark.parametrize("text,what,arg,at,n,dur", [
    ("kill@step=5", "kill", None, "step", 5, None),
    ("hang@step=12", "hang", None, "step", 12, None),
    ("raise=out_of_memory@step=3", "raise", "out_of_memory", "step", 3, None),
    ("exit=3@step=7", "exit", "3", "step", 7, None),
    ("corrupt-checkpoint@epoch=2", "corrupt-checkpoint", None, "epoch", 2, None),
    ("storage-down@step=4,for=2.5", "storage-down", None, "step", 4, 2.5),
    ("kill@checkpoint=3", "kill", None, "checkpoint", 3, None),
    ("kill@export=1", "kill", None, "export", 1, None),
    ("delay-checkpoint@checkpoint=2,for=1.5", "delay-checkpoint", None, "checkpoint", 2, 1.5),
    ("disk-full@checkpoint=4", "disk-full", None, "checkpoint", 4, None),
    ("slow-steps@step=1,for=0.05", "slow-steps", None, "step", 1, 0.05),
])
def test_fault_specs_parse(text, what, arg, at, n, dur):
    f = faults.parse(text)
    assert (f.what, f.arg, f.at, f.n, f.duration, f.rank) == (what, arg, at, n, dur, None)


@pytest.mark.parametrize("text,what,n,dur,rank", [
    ("hang@step=70,rank=0", "hang", 70, None, 0),
    ("kill@step=5,rank=1", "kill", 5, None, 1),
    ("slow-steps@step=60,for=0.1,rank=1", "slow-steps", 60, 0.1, 1),
    ("slow-steps@step=60,rank=1,for=0.1", "slow-steps", 60, 0.1, 1),
    ("kill@checkpoint=2,rank=0", "kill", 2, None, 0),
])
def test_a_rank_selector_parses(text, what, n, dur, rank):
    f = faults.parse(text)
    assert (f.what, f.n, f.duration, f.rank) == (what, n, dur, rank)
    assert f.fires_on(rank) and not f.fires_on(rank + 1)
    assert faults.parse("hang@step=7").fires_on(3)  # no selector: any rank


@pytest.mark.parametrize("text,expected", [
    ("kill@5", "expected kill@step=N"),
    ("raise=hang@step=2", "KIND one of"),
    ("raise=nonsense@step=2", "KIND one of"),
    ("exit=x@step=1", "exit=CODE needs an integer"),
    ("hang@epoch=1", "hang fires @step=N"),
    ("raise=out_of_memory@export=1", "raise fires @step=N"),
    ("storage-down@step=3", "(and they need it)"),
    ("delay-checkpoint@checkpoint=3", "(and they need it)"),
    ("kill@step=3,for=2", "goes with storage-down, delay-checkpoint and slow-steps only"),
    ("slow-steps@step=3", "(and they need it)"),
    ("slow-steps@epoch=3,for=1", "slow-steps fires @step=N"),
    ("disk-full@step=3", "disk-full fires @checkpoint=N"),
    ("hang@step=70,rank=x", "',rank=R' needs a worker's rank (0 for the chief"),
    ("hang@step=70,rank=-1", "',rank=R' needs a worker's rank"),
    ("hang@step=70,rank=", "',rank=R' needs a worker's rank"),
    ("hang@step=70,rank=0,rank=1", "',rank=' given twice"),
    ("hang@step=70,node=2", "unknown option 'node=2' after the moment; expected ,for=SECONDS "
                            "or ,rank=R"),
    ("storage-down@step=3,for=x", "',for=SECONDS' needs a number of seconds, got 'x'"),
    ("hang@step=70,rank=0,for=2", "goes with storage-down, delay-checkpoint and slow-steps"),
])
def test_bad_fault_specs_say_what_is_expected(text, expected):
    with pytest.raises(faults.FaultSpecError) as e:
        faults.parse(text)
    assert expected in str(e.value) and repr(text) in str(e.value)


def test_a_rank_the_run_does_not_have_is_refused_before_it_starts():
    faults.check_ranks(["hang@step=7,rank=1", "kill@step=3"], workers=2)
    with pytest.raises(faults.FaultSpecError) as e:
        faults.check_ranks(["hang@step=7,rank=2"], workers=2)
    assert str(e.value) == ("--fault 'hang@step=7,rank=2': ',rank=2' names no worker of this "
                            "run: it has 2 worker(s), ranks 0 to 1")


def test_only_the_selected_rank_fires_and_claims_are_shared_by_every_rank(tmp_path):
    # two ranks on two nodes claim in one folder (a group's: the run directory)
    journals = {r: Journal(str(tmp_path / f"r{r}.jsonl")) for r in (0, 1)}
    fired = {0: [], 1: []}
    for attempt in (1, 2):
        for rank in (1, 0):  # rank 1 reaches the step first: the hang is not its
            inj = faults.Injector(["hang@step=3,rank=0", "exit=0@step=4"], str(tmp_path),
                                  attempt, journals[rank], rank=rank)
            inj._fire = fired[rank].append
            for step in range(1, 6):
                inj.at_step(step)
    assert [f.text for f in fired[0]] == ["hang@step=3,rank=0"]
    assert [f.text for f in fired[1]] == ["exit=0@step=4"]  # unselected: the first rank there
    assert [(e["fault"], e["rank"]) for e in journals[0].events("fault_injected")] == \
        [("hang@step=3,rank=0", 0)]
    assert [(e["fault"], e["rank"]) for e in journals[1].events("fault_injected")] == \
        [("exit=0@step=4", 1)]


@pytest.mark.integration
def test_cli_rejects_a_bad_fault_before_starting(tmp_path):
    p = subprocess.run([sys.executable, "-m", "orchestrator", "run", "nojob.yaml", "--fault",
                        "boom@step=1"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "--fault 'boom@step=1'" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_fault_fires_once_per_run_not_once_per_attempt(tmp_path):
    journal = Journal(str(tmp_path / "events.jsonl"))
    fired = []
    for attempt in (1, 2, 3):
        inj = faults.Injector(["exit=0@step=3"], str(tmp_path), attempt, journal)
        inj._fire = fired.append  # record instead of exiting
        for step in range(1, 6):
            inj.at_step(step)
    assert [f.text for f in fired] == ["exit=0@step=3"]
    events = journal.events("fault_injected")
    assert [(e["fault"], e["attempt"], e["step"]) for e in events] == [("exit=0@step=3", 1, 3)]
    assert json.loads((tmp_path / "faults" / "exit_0_step_3.json").read_text())["attempt"] == 1


def test_slow_steps_slow_every_step_from_n_in_every_attempt_and_are_journaled_once(tmp_path):
    journal = Journal(str(tmp_path / "events.jsonl"))
    slept = []
    for attempt in (1, 2):
        inj = faults.Injector(["slow-steps@step=3,for=0.05"], str(tmp_path), attempt, journal)
        inj.sleep = slept.append
        for step in range(1, 6):
            inj.at_step(step)
    assert slept == [0.05] * 6  # steps 3, 4, 5 of both attempts
    events = journal.events("fault_injected")
    assert [(e["attempt"], e["step"], e["per_step_s"]) for e in events] == [(1, 3, 0.05)]


def test_raise_builds_the_real_exception_with_a_catalogue_message():
    e = faults.build_exception("storage")
    assert type(e) is OSError and e.errno == errno.ENOTCONN
    assert str(e) == "[Errno 107] Transport endpoint is not connected"
    e = faults.build_exception("user_error")
    assert type(e) is ValueError and "Please provide a TPU Name" in str(e)


def _commit(store, step, epoch=None):
    return store.commit(step, None, {"epoch": epoch or step},
                        arrays=ckarrays.arrays_of("x" * 64 + str(step)))


def test_corrupt_checkpoint_makes_that_checkpoint_fail_verification(tmp_path):
    inj = faults.Injector(["corrupt-checkpoint@epoch=2"], str(tmp_path), 1)
    store = inj.wrap_store(CheckpointStore(str(tmp_path / "ck")))
    _commit(store, 1)
    c2 = _commit(store, 2)
    assert "checksum mismatch" in store.verify(c2.path)
    assert store.latest_valid().epoch == 1
    _commit(store, 3)  # later commits are left alone: it fired once
    assert store.latest_valid().epoch == 3


def test_storage_down_fails_every_store_call_until_it_is_back(tmp_path):
    inj = faults.Injector(["storage-down@step=2,for=60"], str(tmp_path), 1)
    store = inj.wrap_store(CheckpointStore(str(tmp_path / "ck")))
    _commit(store, 1)
    inj.at_step(2)
    with pytest.raises(OSError) as e:
        _commit(store, 2)
    assert e.value.errno == errno.ENOTCONN and "Transport endpoint" in str(e.value)
    later = faults.Injector(["storage-down@step=2,for=60"], str(tmp_path), 2)
    with pytest.raises(OSError):  # the next attempt finds it down too (durable record)
        later.wrap_store(CheckpointStore(str(tmp_path / "ck"))).latest_valid()
    rec = tmp_path / "faults" / "storage-down_step_2_for_60.json"
    data = json.loads(rec.read_text())
    rec.write_text(json.dumps(dict(data, until=data["time"])))  # the outage ends
    assert later.wrap_store(CheckpointStore(str(tmp_path / "ck"))).latest_valid().epoch == 1


@pytest.mark.integration
def test_kill_at_checkpoint_dies_after_the_payload_and_before_the_rename(tmp_path):
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from orchestrator.recovery import faults\n"
            "from orchestrator.checkpoint.store import CheckpointStore\n"
            "from test_faults import _commit\n"
            "inj = faults.Injector(['kill@checkpoint=2'], %r, 1)\n"
            "store = inj.wrap_store(CheckpointStore(%r))\n"
            "for s in (1, 2, 3): _commit(store, s)\n"
            % (os.path.join(ROOT, "tests"), str(tmp_path), str(tmp_path / "ck")))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == -9, p.stderr
    store = CheckpointStore(str(tmp_path / "ck"))
    assert [c.step for c in store.list()] == [1]
    tmp = [d for d in os.listdir(tmp_path / "ck") if d.startswith(".tmp-0000000002")]
    assert len(tmp) == 1 and os.listdir(tmp_path / "ck" / tmp[0]) == ["refs"]  # no manifest
    named = (tmp_path / "ck" / tmp[0] / "refs").read_text().split()
    assert len(named) == 1 and os.path.exists(tmp_path / "ck" / blobs.blob_key(named[0]))
    record = json.loads((tmp_path / "faults" / "kill_checkpoint_2.json").read_text())
    assert record["step"] == 2 and record["tmp"].endswith(tmp[0])

"""A commit told with the committing rank's heartbeat (core/heartbeat.py), relayed from its node
(supervise/relay.py), heard by the attempt's loop (attempt.py) and journaled by the ledger
(supervise/ledger.py) once a copy the supervisor reads verifies with the commit's digest: once,
whatever else tells of it (a later beat, the scans). No process, no Ray, no real waiting: the
chief's node is a folder of its own (its local tier and control folder), the run directory's
``checkpoints/`` the one both see. The three-node cluster is the e2e test's
(tests/test_e2e_multiworker.py)."""
import json
import os
import queue
import shutil

from helpers import FakeClock, TwoNodeEngine, group_attempt
from orchestrator.checkpoint.tiers import TieredStore
from orchestrator.core import heartbeat
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.recovery.faults import corrupt_payload
from orchestrator.core.rundir import RunDir
from orchestrator.supervise.ledger import CheckpointLedger
from orchestrator.supervise.messages import Beat, Committed, Exited
from orchestrator.supervise.relay import Delivery, RankFiles

SPE = 44  # steps an epoch


class Console:
    def __init__(self):
        self.epochs = []

    def epoch_completed(self, epoch, *rest):
        self.epochs.append(epoch)


def _commit(store, step, loss=0.5):
    """A checkpoint of ``step`` in ``store``'s local tier, as the worker's commit makes it."""
    epoch = step // SPE
    history = [{"epoch": e, "loss": loss} for e in range(1, epoch + 1)]

    def payload(d):
        with open(os.path.join(d, "state.npz"), "wb") as f:
            f.write(f"state of step {step}, loss {loss}".encode())

    return store.commit(step, payload, {"epoch": epoch, "batch": step % SPE, "history": history,
                                        "attempt": 2})


def _sides(tmp_path):
    run = RunDir(str(tmp_path / "run")).make()
    node = TieredStore(str(tmp_path / "node" / "local"), run.checkpoints)   # the chief's
    here = TieredStore(str(tmp_path / "here" / "local"), run.checkpoints)   # the supervisor's
    journal = Journal(run.journal)
    console, progress = Console(), []
    ledger = CheckpointLedger(here, journal, console, on_progress=lambda: progress.append(1),
                              on_scanned=lambda: None)
    return run, node, here, journal, ledger, console, progress


def _committed(journal):
    return [e["step"] for e in journal.events(Event.CHECKPOINT_COMMITTED)]


def _told(writer, store, c):
    writer.committed(c.step, c.epoch, c.path, store.digest(c.path))


def test_a_commit_told_from_another_node_is_journaled_once_its_durable_copy_verifies(tmp_path):
    run, node, here, journal, ledger, console, progress = _sides(tmp_path)
    control = tmp_path / "node" / "control"
    control.mkdir(parents=True)
    writer = heartbeat.HeartbeatWriter(str(control), attempt=2, interval=3600)
    writer.beat(force=True, phase="training", epoch=0, batch=43, step=43)
    rank = RankFiles(str(control), str(control / "2.log"), True, clock=FakeClock())
    q = queue.Queue()
    deliver = Delivery(0, run.control, run.attempt_log(2), journal, q)
    cur = rank.cursor()

    c = _commit(node, SPE)  # the end of epoch 1, on the chief's node
    _told(writer, node, c)  # a beat at once, with the commit (the interval is an hour)
    cur, updates = rank.next(cur, timeout=1.0)
    deliver(updates)
    beat = q.get_nowait()
    assert isinstance(beat, Beat) and beat.record["commits"] == [
        {"step": SPE, "epoch": 1, "path": c.path, "digest": node.digest(c.path)}]
    assert beat.record["phase"] == "training" and beat.record["step"] == 43  # where it was
    ledger.heard(beat.record["commits"])
    assert _committed(journal) == [] and list(ledger.pending) == [SPE]  # no copy here yet

    d = here.durable.commit_copy(c)  # the node's durable mirror copies it, says so
    deliver({"journal": (json.dumps({"event": Event.CHECKPOINT_DURABLE, "step": SPE,
                                     "path": d.path}) + "\n").encode()})
    assert q.get_nowait() == Committed(d.path)
    ledger.heard([])  # the next beat (or the scan that Committed starts)
    assert _committed(journal) == [SPE] and console.epochs == [1] and progress == [1]
    e = journal.events(Event.CHECKPOINT_COMMITTED)[0]
    assert e["path"] == d.path and e["epoch"] == 1
    assert [x["epoch"] for x in journal.events(Event.EPOCH_COMPLETED)] == [1]

    # told again with every later beat, scanned at the attempt's end: still once
    ledger.heard(beat.record["commits"])
    ledger.attempt_ended()
    assert _committed(journal) == [SPE] and len(journal.events(Event.EPOCH_COMPLETED)) == 1
    assert progress == [1] and not ledger.pending


def test_a_copy_with_another_digest_or_a_bad_checksum_is_not_the_commit_told_of(tmp_path,
                                                                                said):
    run, node, here, journal, ledger, console, progress = _sides(tmp_path)
    told = _commit(node, 2 * SPE, loss=0.25)
    stale = _commit(TieredStore(str(tmp_path / "old"), run.checkpoints), 2 * SPE, loss=0.75)
    here.durable.commit_copy(stale)  # an earlier attempt's copy of the same step
    m = {"step": told.step, "epoch": 2, "path": told.path, "digest": node.digest(told.path)}
    assert node.digest(told.path) != here.digest(stale.path)
    ledger.heard([m])
    assert _committed(journal) == [] and progress == [] and ledger.pending
    assert any("is not the commit its rank told of" in line for line in said)

    # the right copy replaces it, but damaged on the way: refused by the store's verify
    bad = here.durable.commit_copy(told)
    with open(os.path.join(bad.path, "state.npz"), "ab") as f:
        f.write(b"!")
    ledger.heard([])
    assert _committed(journal) == []
    here.durable.commit_copy(told)  # copied again, whole (the copy verifies, then counts)
    ledger.heard([])
    assert _committed(journal) == [2 * SPE] and progress == [1]


class ChiefBeats(TwoNodeEngine):
    """Rank 0 commits twice (the second beat carries both), then both ranks exit 0."""

    def __init__(self, beats):
        super().__init__()
        self.beats = beats

    def started(self, m):
        if m.rank == 1:
            for record in self.beats:
                self.events.put(Beat(0, record))
            for x in self.members:
                self.events.put(Exited(x, 0))


def test_the_attempt_hands_its_own_beats_commits_to_the_ledger(tmp_path):
    run, node, here, journal, ledger, console, progress = _sides(tmp_path)
    first, second = _commit(here, SPE), _commit(here, SPE + 20)  # the chief here: local tier
    commits = [{"step": c.step, "epoch": c.epoch, "path": c.path,
                "digest": here.digest(c.path)} for c in (first, second)]
    beats = [{"attempt": 3, "time": 1.0, "commits": commits[:1]},
             {"attempt": 3, "time": 2.0, "commits": commits},
             {"attempt": 2, "time": 3.0, "commits": [dict(commits[0], step=999)]}]  # not ours
    attempt, _ = group_attempt(RunDir(run.root), ChiefBeats(beats))
    heard = []
    outcome = attempt.wait(on_checkpoint=lambda: None, duties=[],
                           on_commits=lambda cs: (heard.append(len(cs)), ledger.heard(cs)))
    assert outcome.exit_code == 0 and heard == [1, 2]
    assert _committed(journal) == [SPE, SPE + 20]
    assert [e["epoch"] for e in journal.events(Event.EPOCH_COMPLETED)] == [1]


def test_a_beat_carries_its_writer_s_last_commits(tmp_path):
    writer = heartbeat.HeartbeatWriter(str(tmp_path), attempt=1, interval=3600)
    assert "commits" not in (writer.beat(force=True, phase="training", step=1) and
                             heartbeat.read(str(tmp_path)))
    for step in range(1, heartbeat.COMMITS_KEPT + 3):
        writer.committed(step, 0, f"/ckpt/{step}", f"d{step}")
    rec = heartbeat.read(str(tmp_path))
    assert [c["step"] for c in rec["commits"]] == list(range(3, heartbeat.COMMITS_KEPT + 3))
    assert rec["phase"] == "training" and rec["step"] == 1
    writer.beat(force=True, phase="epoch_end", step=2)  # every later beat carries them too
    assert heartbeat.read(str(tmp_path))["commits"] == rec["commits"]


def test_the_epoch_reached_is_read_from_the_tiers_once_then_from_what_the_ledger_journals(
        tmp_path, monkeypatch):
    """Between a worker's death and the next start the loop asks the epoch reached and whether
    the run is complete six times; a listing and verify of the tiers took 60-95 ms there, the
    last commit's blobs hashed again. The tiers are read once; each commit the ledger journals
    (verified as it is) is the newest from then on; only a run's end is read afresh."""
    run, node, here, journal, ledger, console, progress = _sides(tmp_path)
    reads = []
    real = here.latest_valid
    monkeypatch.setattr(here, "latest_valid", lambda **kw: (reads.append(1), real(**kw))[1])
    assert ledger.latest_epoch() == 0 and len(reads) == 1  # the run's start reads the tiers
    _commit(here.local, 2 * SPE)
    ledger.attempt_ended()  # the scan at an attempt's end journals it
    assert [ledger.latest_epoch() for _ in range(5)] == [2] * 5
    assert not ledger.completed(3) and len(reads) == 1
    ledger.attempt_ended()  # a scan that learns nothing reads nothing again
    assert ledger.latest_epoch() == 2 and not ledger.completed(3) and len(reads) == 1
    c = _commit(here.local, 3 * SPE)
    assert ledger.latest_epoch() == 2 and len(reads) == 1  # nothing learned yet
    ledger.heard([{"step": c.step, "epoch": c.epoch, "path": c.path,
                   "digest": here.local.digest(c.path)}])
    assert ledger.latest_epoch() == 3 and len(reads) == 1
    assert ledger.completed(3) and len(reads) == 2  # the end: read afresh, once
    assert ledger.completed(3) and len(reads) == 2
    assert ledger.latest().step == 3 * SPE and len(reads) == 3  # the checkpoint itself: fresh


def test_a_run_whose_last_checkpoint_no_longer_verifies_is_not_completed(tmp_path):
    """The end is confirmed from the tiers: a last commit journaled and then lost (its copies
    deleted) leaves the run at the one before, to train again."""
    run, node, here, journal, ledger, console, progress = _sides(tmp_path)
    assert ledger.latest_epoch() == 0
    _commit(here.local, 2 * SPE)
    c = _commit(here.local, 3 * SPE)
    ledger.attempt_ended()
    assert ledger.latest_epoch() == 3
    shutil.rmtree(c.path)
    assert not ledger.completed(3) and ledger.latest_epoch() == 2


def test_the_epoch_resumed_from_is_verified_again_once_an_attempt_ended(tmp_path):
    """A copy journaled intact and then corrupted (by the worker that died, or beside it) is
    not what the next attempt resumes from: once an attempt ended, the newest known copy is
    verified again, and the one before it is the epoch resumed from."""
    run, node, here, journal, ledger, console, progress = _sides(tmp_path)
    assert ledger.resumable_epoch() == 0
    _commit(here.local, 2 * SPE)
    c = _commit(here.local, 3 * SPE)
    ledger.scan()
    assert ledger.resumable_epoch() == 3
    corrupt_payload(c.path)
    assert ledger.latest_epoch() == 3  # the ledger's last word, until an attempt ends
    ledger.attempt_ended()
    assert ledger.resumable_epoch() == 2 and ledger.latest_epoch() == 2
    assert _committed(journal) == [2 * SPE, 3 * SPE]  # journaled once, as it was then

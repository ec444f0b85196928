"""Restore across nodes (#29 item 4), its first step: before a group restarts, the last chief's
node (not the supervisor's; its actor lives until the next placement) makes durable what it
still holds only on its own disk, so that the restore, which reads this node's tiers and the
run directory, finds it (supervise/rayengine.py: ``NodeMirror.again``, ``gather_from``). No Ray
here: real tiers in a folder, a fake actor. The actor on a real node is the e2e test's."""
import os
from types import SimpleNamespace

import ckarrays

from orchestrator.checkpoint.store import Retention
from orchestrator.core.journal import Journal
from orchestrator.supervise.rayengine import NodeMirror, durable_steps, gather_from


def _commit(store, step):
    store.commit(step, None, {"epoch": 1, "batch": step, "metrics": {}},
                 arrays=ckarrays.arrays_of(f"step {step}", repeat=1000))


def _node(tmp_path):
    """The chief's node mirror, as its actor starts it, over two checkpoints made durable and
    closed at the rank's exit."""
    journal = Journal(str(tmp_path / "node-journal.jsonl"))
    m = NodeMirror(str(tmp_path / "local"), str(tmp_path / "drive" / "checkpoints"),
                   Retention(keep=10), journal=journal.path)
    for step in (20, 40):
        _commit(m.mirror.store.local, step)
    m.close(timeout=30)
    assert durable_steps(m.mirror.store) == {20, 40}
    return m


def test_the_chief_s_node_copies_what_its_exit_left_and_says_what_is_still_pending(tmp_path):
    m = _node(tmp_path)
    _commit(m.mirror.store.local, 60)  # left behind by the flush at the exit
    assert m.again(timeout=30) == {"copied": [60], "pending": []}
    assert durable_steps(m.mirror.store) == {20, 40, 60}
    assert m.again(timeout=30) == {"copied": [], "pending": []}  # nothing more to do
    _commit(m.mirror.store.local, 80)
    drive = tmp_path / "drive"
    os.rename(drive, tmp_path / "away")  # the run directory unreachable: a file in its place
    drive.write_text("not a folder")
    assert m.again(timeout=0.5) == {"copied": [], "pending": [80]}


class ActorDied(Exception):
    pass


class FakeRay:
    exceptions = SimpleNamespace(RayError=ActorDied)

    @staticmethod
    def get(ref, timeout=None):
        if isinstance(ref, Exception):
            raise ref
        return ref


def _chief(answer):
    return SimpleNamespace(make_durable=SimpleNamespace(remote=lambda timeout: answer))


def test_what_the_chief_s_node_copied_or_could_not_is_journaled_and_nothing_else(tmp_path,
                                                                                said):
    journal = Journal(str(tmp_path / "events.jsonl"))
    for nothing in (None, {"copied": [], "pending": []}):  # not a chief's mirror, or all done
        assert gather_from(FakeRay, _chief(nothing), "127.0.0.2", 5.0, journal) is None
    assert journal.events() == [] and said == []
    got = gather_from(FakeRay, _chief({"copied": [60], "pending": []}), "127.0.0.2", 5.0,
                      journal)
    assert got == {"copied": [60], "pending": []} and said == []
    gather_from(FakeRay, _chief({"copied": [], "pending": [80]}), "127.0.0.2", 5.0, journal)
    gather_from(FakeRay, _chief(ActorDied("The actor died because its node has died.\nmore")),
                "127.0.0.3", 5.0, journal)
    events = journal.events("checkpoints_gathered")
    assert [(e["node"], e.get("copied"), e.get("pending"), e.get("reason")) for e in events] == [
        ("127.0.0.2", [60], [], None), ("127.0.0.2", [], [80], None),
        ("127.0.0.3", None, None, "ActorDied: The actor died because its node has died.")]
    assert len(said) == 2 and all("restores from the newest durable one" in s for s in said)


def test_the_restore_step_is_chosen_after_the_chief_s_node_copied_what_only_it_had(tmp_path):
    """The supervisor's side: the group's restore step is taken once the engine gathered (a
    Ray engine whose last chief copied step 60, which only its node had), and the step is
    journaled as committed like any other."""
    from orchestrator.checkpoint.tiers import TieredStore
    from orchestrator.supervise.ledger import CheckpointLedger
    from orchestrator.supervise.supervisor import Supervisor

    here = TieredStore(str(tmp_path / "local"), str(tmp_path / "drive" / "checkpoints"))
    node = TieredStore(str(tmp_path / "node-local"), here.durable.root)
    for step in (40, 60):
        _commit(node.local, step)
    here.durable.commit_copy(node.local.list()[0])  # step 40: made durable before the exit
    journal = Journal(str(tmp_path / "events.jsonl"))
    console = SimpleNamespace(epoch_completed=lambda *a: None)
    ledger = CheckpointLedger(here, journal, console, lambda: None, lambda: None)
    ledger.scan()

    def gather(timeout):
        here.durable.commit_copy(node.local.list()[-1])
        return {"copied": [60], "pending": []}

    sup = SimpleNamespace(ledger=ledger, engine=SimpleNamespace(gather=gather),
                          spec=SimpleNamespace(engine="ray",
                                               checkpoint=SimpleNamespace(flush_timeout=5.0)),
                          checkpoints=SimpleNamespace(flush=lambda timeout: []))
    assert Supervisor._group_restore_step(sup) == "60"
    assert [e["step"] for e in journal.events("checkpoint_committed")] == [40, 60]

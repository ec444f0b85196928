"""A node that leaves the cluster takes its ranks (#29 item 3): the engine asks the cluster
whether the node of a dead actor is gone (``rayengine.node_gone``), and the attempt journals
``node_lost`` with the node and every rank it took, then stops the group as after any rank's
failure. No Ray here: a fake ``ray.nodes()`` and a fake engine. The real node stopped and
started again mid-run is the three-node e2e test's (tests/test_e2e_multiworker.py)."""
import signal

from helpers import FakeClock, TwoNodeEngine, group_attempt
from orchestrator.core.rundir import RunDir
from orchestrator.supervise.messages import Exited
from orchestrator.supervise.rayengine import node_gone


class FakeRay:
    def __init__(self, *views):
        self.views = list(views)  # what ray.nodes() says at each call (the last one stays)

    def nodes(self):
        return self.views.pop(0) if len(self.views) > 1 else self.views[0]


def test_a_node_is_gone_when_the_cluster_says_dead_or_no_longer_lists_it():
    alive = [{"NodeID": "a", "Alive": True}, {"NodeID": "b", "Alive": True}]
    dead = [{"NodeID": "a", "Alive": True}, {"NodeID": "b", "Alive": False}]
    clock = FakeClock()
    assert node_gone(FakeRay(dead), "b", clock=clock) and clock.slept == []
    assert node_gone(FakeRay([{"NodeID": "a", "Alive": True}]), "b", clock=clock)
    # the actor's death is seen before the node's: asked again until the cluster knows
    assert node_gone(FakeRay(alive, alive, dead), "b", clock=clock) and clock.slept == [0.5, 0.5]
    # an actor killed on a live node is no node lost: asked until the bound, then no
    clock = FakeClock()
    assert not node_gone(FakeRay(alive), "b", wait_s=3.0, clock=clock)
    assert sum(clock.slept) == 3.0


class NodeLeaves(TwoNodeEngine):
    """Two ranks on two nodes; rank 1's node leaves as soon as the group starts."""

    def started(self, m):
        if m.rank == 1:
            m.info.update(lost="ActorDiedError: The actor died because its node has died.",
                          node_lost={"node": m.node, "node_id": "node-b"})
            self.events.put(Exited(m, -signal.SIGKILL))

    def kill(self, m, grace):
        self.events.put(Exited(m, -signal.SIGKILL))


def test_a_lost_node_is_journaled_with_its_ranks_and_the_group_stops(tmp_path, said):
    rd = RunDir(str(tmp_path / "run")).make()
    attempt, journal = group_attempt(rd, NodeLeaves())
    outcome = attempt.wait(on_checkpoint=lambda: None, duties=[])
    assert outcome.exit_code == -signal.SIGKILL
    failed = journal.events("group_member_failed")
    assert [(e["rank"], e["node"], e["stopping"]) for e in failed] == [(1, "127.0.0.3", [0])]
    assert failed[0]["lost"].startswith("ActorDiedError")
    lost = journal.events("node_lost")
    assert [(e["attempt"], e["node"], e["node_id"], e["ranks"]) for e in lost] == \
        [(3, "127.0.0.3", "node-b", [1])]
    assert said == ["attempt 3: node 127.0.0.3 left the cluster with rank(s) 1: stopping the "
                    "group; the next one waits for capacity up to 120 s"]

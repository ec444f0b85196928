"""Which rank's failure is the group's when several exit non-zero (supervise/group.py's
``first_failed``): the one that exited first where it ran, not the first the engine tells of.
On Ray the exits of ranks on two nodes reach the supervisor in Ray's order: a JAX rank that
raised and left was told after its peer, whose collective it broke (gloo: connection reset by
peer), and the group's failure was classified from the peer's error. No Ray here: a fake
engine that tells the exits in the wrong order. The three-node run is the e2e test's."""
import signal

from helpers import TwoNodeEngine, group_attempt
from orchestrator.core.osutil import write_json_atomic
from orchestrator.core.rundir import RunDir
from orchestrator.supervise.group import Member, first_failed
from orchestrator.supervise.messages import Exited


def _m(rank, code, at):
    return Member(rank, "h", "log", "err", exit_code=code, exited_at=at)


def test_of_the_ranks_that_failed_on_their_own_the_first_to_exit_is_the_cause():
    peer = _m(0, 1, 10.02)  # heard first: its collective broke when rank 1 left
    cause = _m(1, 1, 10.00)
    assert first_failed(peer, [cause], stopped_at=10.5) is cause
    killed = _m(1, -signal.SIGKILL, 10.6)  # still running at the stop: the stop's doing
    assert first_failed(peer, [killed], stopped_at=10.5) is peer
    assert first_failed(_m(0, 1, 10.02), [_m(1, 1, 10.03)], stopped_at=10.5).rank == 0
    lost = _m(0, -signal.SIGKILL, None)  # an actor dead with its node: the order heard
    assert first_failed(lost, [cause], stopped_at=10.5) is lost
    assert first_failed(peer, [_m(1, 1, None)], stopped_at=10.5) is peer


def test_the_moment_of_failure_is_the_error_record_s_when_there_is_one(tmp_path):
    """Beside two busy loops the rank that raised (its record at 10.00) exited after its peer,
    whose collective it broke (record 10.01, exit 10.02): the records tell the order."""
    cause_rec, peer_rec = str(tmp_path / "1.r1.error.json"), str(tmp_path / "1.error.json")
    write_json_atomic(cause_rec, {"time": 10.00, "type": "OSError"})
    write_json_atomic(peer_rec, {"time": 10.01, "type": "JaxRuntimeError"})
    peer = Member(0, "h", "log", peer_rec, exit_code=1, exited_at=10.02)
    cause = Member(1, "h", "log", cause_rec, exit_code=1, exited_at=10.40)  # a slow teardown
    assert first_failed(peer, [cause], stopped_at=10.5) is cause


class LateEngine(TwoNodeEngine):
    """Two ranks: rank 1 raises and exits first, rank 0's collective breaks 20 ms later, and
    the engine tells rank 0's exit first (Ray's order)."""

    def __init__(self, rd):
        super().__init__()
        self.rd = rd

    def started(self, m):
        if m.rank == 1:
            write_json_atomic(self.rd.error_record(3, 0), {
                "attempt": 3, "type": "JaxRuntimeError", "message": "Gloo all-reduce failed"})
            write_json_atomic(self.rd.error_record(3, 1), {
                "attempt": 3, "type": "OSError", "message": "storage"})
            self.events.put(Exited(self.members[0], 1, 1000.02))
            self.events.put(Exited(m, 1, 1000.00))


def test_the_group_s_failure_is_the_rank_that_left_first_though_told_second(tmp_path):
    rd = RunDir(str(tmp_path / "run")).make()
    attempt, journal = group_attempt(rd, engine := LateEngine(rd))
    outcome = attempt.wait(on_checkpoint=lambda: None, duties=[])
    assert outcome.exit_code == 1 and outcome.error["message"] == "storage"
    failed = journal.events("group_member_failed")
    assert [(e["rank"], e["node"], e["stopping"]) for e in failed] == [(1, "127.0.0.3", [])]
    assert failed[0]["also_failed"] == [0]
    assert engine.killed == [1]  # not heard of when rank 0's exit was: stopped

"""Real TensorFlow, two CPU workers under MultiWorkerMirroredStrategy.

Placed by the local engine (two processes here, on loopback) and by Ray: a cluster of three
nodes on this machine. A hang of one rank (local: it stalls the group; the silent heartbeat
stops it), and on Ray a hang of rank 0, a SIGKILL of rank 1, then rank 1's node stopped and
started again, each in the middle of an epoch: the group is stopped each time, restarted from
the newest checkpoint (the last time once the node is back), and ends with the weights of an
uninterrupted 2-worker run. Where Ray is not installed the Ray tests are skipped with the
reason.

The Ray cluster (``ray_cluster``) is as real machines are, on one:

- a head with no CPUs (no rank runs there; the supervisor is its driver), and two worker nodes
  of one CPU each, so that the two ranks land on two nodes;
- each worker node in a mount namespace of its own (``unshare --mount``, root in the tests'
  container) with a tmpfs on ``/tmp``: its own local disk (tests/fakes/ray_node.py). The
  supervisor's local control folder and each node's local checkpoint tier are then invisible to
  the others; only the run directory, made outside ``/tmp``, is shared. Heartbeats, journal
  lines, logs and stack dumps reach the supervisor through Ray only, and the durable copies are
  made on the chief's node (supervise/relay.py, rayengine.py).

Every packet on loopback. Ray 2.60 maps ``127.0.0.1`` (and ``localhost``) to the machine's
interface address wherever a node or a driver names it, unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which keeps it but refuses any node but the head. So no
node is on ``127.0.0.1``: the head is on ``127.0.0.4`` and the worker nodes on ``127.0.0.2`` and
``127.0.0.3``, each with an explicit ``--node-ip-address`` and the variable unset. The GCS is
reached at the head's exact address. A driver finds its own node by the source address of a
socket towards the GCS, which for any ``127.x`` is ``127.0.0.1``, where no node is: the
supervisor is told its node (``ORCHESTRATOR_RAY_NODE_ADDRESS=127.0.0.4``, passed to Ray as the
driver's node address). Checked with ``ss -tnp`` while the group trains
(``_cluster_connections``): every TCP connection of the cluster's processes (the nodes, their
Ray processes, the ranks) and of the supervisor is between 127.0.0.x addresses (measured: 64
in one run, none elsewhere); some of Ray's servers listen on every interface, and nothing connects to
them but from loopback.

On JAX (``backend: jax``) the same group is one ``jax.distributed`` program under
``keras.distribution.DataParallel``: the 2-process run, one of whose ranks fails, ends with the
weights of one uninterrupted process with two CPU devices, placed by the local engine and on the
three-node cluster (the coordinator on rank 0's node address, every connection on loopback).
"""
import contextlib
import fcntl
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from helpers import NO_EXPORT, ROOT, SOAK, live, once_per_session, wait_while_running
from orchestrator.core import heartbeat
from orchestrator.core.journal import Journal
from orchestrator.core.procid import ProcessIdentity, signal_proven
from orchestrator.ops.status import format_status, run_status

pytestmark = pytest.mark.e2e

JOB = """
name: digits-2w
model: digits_job:build_model
data: digits_job:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}
epochs: 2
batch_size: 16
seed: 3
deterministic: true
workers: 2
checkpoint: {every_epochs: 1, every_steps: 20}
heartbeat_interval: 0.05
restarts: {backoff: {initial: 0.1}}
""" + NO_EXPORT


def _job(tmp_path, extra=""):
    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), tmp_path)
    p = tmp_path / "job.yaml"
    p.write_text(JOB + extra)
    return str(p)


def _run(job, run_dir, *args, env=None):
    return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                             str(run_dir), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


@contextlib.contextmanager
def _stopped_if_failing(p):
    """A test that fails while the supervisor ``p`` runs stops it (the supervisor we started:
    it stops its group, on the cluster too) and shows what it said."""
    try:
        yield
    except BaseException:
        p.terminate()
        print(p.communicate(timeout=300)[0])
        raise


def _wait(p, cond, what):
    """Until the run reaches a moment, for as long as its supervisor runs (helpers)."""
    return wait_while_running(p, cond, what=what)


@pytest.fixture
def reference(tmp_path_factory):
    """The uninterrupted 2-worker run's final weights (run once for the session)."""
    def run(tmp):
        p = _run(_job(tmp), tmp / "run")
        out, _ = p.communicate(timeout=900)  # a cap only: the supervisor bounds its own waits
        assert p.returncode == 0, out
        done = Journal(str(tmp / "run" / "events.jsonl")).events("run_completed")[0]
        ready = Journal(str(tmp / "run" / "events.jsonl")).events("worker_ready")[0]
        assert ready["replicas"] == 2 and ready["global_batch"] == 32  # 16 per replica x 2
        return done["weights_sha256"]
    return once_per_session(tmp_path_factory, "two-worker-reference", run)


# The suite's Ray: its own authentication mode and token, whatever an earlier run left in
# ~/.ray; every node on a loopback address of its own (the module's docstring says why).
RAY_TOKEN = "orchestrator-suite-" + os.urandom(8).hex()
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
HEAD, NODES = "127.0.0.4", ("127.0.0.2", "127.0.0.3")
# A node stopped (SIGTERM to its `ray start --block`) goes at once, as `ray stop` on it would:
# Ray 2.60 otherwise drains it first for up to 30 s, its actors and ranks running on meanwhile
# (measured: the whole rest of the run trained on a node being stopped).
NODE_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


@pytest.fixture(scope="module")
def reference_jax(tmp_path_factory):
    """The uninterrupted run on JAX as one process with 2 CPU devices: the 2-worker group
    (2 processes x 1 device), killed and restarted, must end exactly there."""
    tmp = tmp_path_factory.mktemp("ref-jax-1x2")
    job = _job(tmp, "backend: jax\nstandby: off\n")
    env = dict(os.environ, ORCHESTRATOR_CPU_DEVICES="2")
    p = _run(job, tmp / "run", "--workers", "1", env=env)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    journal = Journal(str(tmp / "run" / "events.jsonl"))
    ready = journal.events("worker_ready")[0]
    assert ready["backend"] == "jax" and ready["replicas"] == 2, ready
    assert ready["global_batch"] == 32 and ready["steps_per_epoch"] == 1438 // 32
    return journal.events("run_completed")[0]["weights_sha256"]


def _stop(proc) -> None:
    """A Ray node we started, by its pid (SIGTERM: ``--block`` drains and stops its
    processes), never by ``ray stop``, which stops every Ray of the machine."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # what did not stop with it
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class RayCluster:
    """The cluster's address and the processes of its nodes (the head first), each node started
    and stopped by its pid: ``stop_node`` is a machine leaving the cluster (SIGTERM to its
    ``ray start --block``, as ``ray stop`` on it), ``start_node`` the same machine back, a new
    Ray node at the same address with an empty /tmp."""

    def __init__(self, tmp, env):
        self.tmp, self.env, self.address = tmp, env, None
        self.head, self.nodes = None, {}  # ip -> the node's process (the latest)
        self.stopped: list = []

    @property
    def procs(self) -> list:
        return [self.head, *self.nodes.values()]

    def start_head(self) -> None:
        with open(self.tmp / "head.log", "wb") as log:
            self.head = subprocess.Popen(
                [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                 "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={self.tmp}",
                 "--port=0", f"--node-ip-address={HEAD}"], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        current = self.tmp / "ray_current_cluster"
        wait_while_running(self.head, lambda: current.exists() and current.read_text().strip(),
                           what=f"the Ray head up (its log: {self.tmp / 'head.log'})")
        self.address = current.read_text().strip()
        assert self.address.startswith(f"{HEAD}:"), self.address

    def start_node(self, ip: str, wait: bool = True) -> None:
        log = self.tmp / f"node-{ip}-{len(self.stopped)}.log"
        with open(log, "wb") as out:
            self.nodes[ip] = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", sys.executable,
                 os.path.join(ROOT, "tests", "fakes", "ray_node.py"), ip, self.address, "1"],
                env=dict(self.env, PYTHONUNBUFFERED="1", **NODE_ENV), stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.joined(ip)

    def joined(self, ip: str) -> None:
        """Until the node says it joined (`ray start` does once it is registered): a run that
        asked for placement before then waited out its 120 s placement bound."""
        log = self.tmp / f"node-{ip}-{len(self.stopped)}.log"
        wait_while_running(self.nodes[ip], lambda: "Ray runtime started" in log.read_text(
            errors="replace"), what=f"the Ray node {ip} joined (its log: {log})")

    def stop_node(self, ip: str) -> None:
        self.stopped.append(self.nodes[ip])
        _stop(self.nodes[ip])

    def stop(self) -> None:
        for p in reversed([p for p in self.procs if p is not None]):
            _stop(p)


@contextlib.contextmanager
def _one_cluster_at_a_time(tmp_path_factory):
    """The session's test processes (pytest-xdist) start their module's cluster one after the
    other: the nodes' loopback addresses are fixed, and two clusters on them collided (seen in a
    suite run: three processes each started one, and no node joined). pytest-xdist's
    ``--dist loadgroup`` would keep the tests in one process, but not under pytest 9 (it renames
    ``item._nodeid``, which pytest 9 no longer reads)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-USER/pytest-N, shared by the session's processes
    with open(root / "ray_cluster.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when closed, or with this process
        yield


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """The three-node loopback cluster with token authentication (the module's docstring),
    stopped by its processes' pids at the end."""
    pytest.importorskip("ray", reason="the ray engine needs Ray: pip install 'orchestrator[ray]'")
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("the cluster's nodes need unshare --mount and root (a private /tmp each)")
    env = dict(os.environ, **RAY_ENV, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=RAY_TOKEN)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    cluster = RayCluster(tmp_path_factory.mktemp("ray"), env)
    with _one_cluster_at_a_time(tmp_path_factory):
        try:
            cluster.start_head()
            for ip in NODES:
                cluster.start_node(ip, wait=False)
            for ip in NODES:  # every worker node joined before a test asks for placement
                cluster.joined(ip)
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture
def shared_dir():
    """The job and its run directory outside /tmp: the one folder every node sees."""
    path = tempfile.mkdtemp(prefix="orchestrator-e2e-", dir="/var/tmp")
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _ray_env(address, **more):
    """The supervisor's: the cluster's address and its token, not its mode (the supervisor
    finds the cluster's mode itself, supervise/rayconnect.py), and its own node's address."""
    env = dict(os.environ, **RAY_ENV, RAY_ADDRESS=address, RAY_AUTH_TOKEN=RAY_TOKEN,
               ORCHESTRATOR_RAY_NODE_ADDRESS=HEAD, **more)
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    return env


def _descendants(roots) -> set[int]:
    """The pids of ``roots`` and of every process below them (the cluster's, the ranks)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{d}/stat", encoding="ascii", errors="replace") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
    found, more = set(), set(roots)
    while more:
        found |= more
        more = {pid for pid, ppid in parents.items() if ppid in more and pid not in found}
    return found


def _cluster_connections(roots) -> list[tuple[str, str]]:
    """(local, peer) address of every TCP connection held by ``roots`` and their processes,
    from ``ss -tnp`` (the module's docstring: every one must be on loopback)."""
    pids = _descendants(roots)
    out = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True, check=True).stdout
    pairs = []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 6 and any(int(pid) in pids for pid in re.findall(r"pid=(\d+)", line)):
            pairs.append(tuple(c.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
                               for c in cols[3:5]))  # IPv4 as ss shows it on a v6 socket
    return pairs


def _fault_in_epoch_2(job, run, fault, kind, reference):
    """The group run with ``fault`` (at step 70, in the middle of epoch 2, past the mid-epoch
    checkpoint of step 60, in whichever rank claims it first): attempt 1 ends as ``kind``, the
    group is stopped, attempt 2 resumes mid-epoch and ends with the ``reference`` weights.
    One fault per test: a group attempt costs a framework start per rank, on a suite bound by
    its 2 cores (the SIGKILLed rank is the Ray test's: what follows a dead rank is the
    engine's, the same for both)."""
    p = _run(job, run, "--engine", "local", "--fault", fault)
    out, _ = p.communicate(timeout=900)  # a cap only: the supervisor bounds its own waits
    assert p.returncode == 0, out
    events = Journal(str(run / "events.jsonl")).events()
    assert [e["kind"] for e in events if e["event"] == "attempt_ended"] == [kind, None]
    starts = [e for e in events if e["event"] == "attempt_started"]
    assert [[w["rank"] for w in e["workers"]] for e in starts] == [[0, 1], [0, 1]]
    ready = [e for e in events if e["event"] == "worker_ready"]
    assert len(ready) == 2 and ready[1]["resumed_from_step"] > ready[0]["steps_per_epoch"]
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2]
    assert next(e for e in events if e["event"] == "run_completed")["weights_sha256"] == \
        reference
    return events


@SOAK  # a group's failure on the local engine: the JAX rank's error below
def test_local_engine_a_hung_rank_stops_the_group_and_it_ends_bit_identical(tmp_path,
                                                                            reference):
    """A rank hangs; the other blocks in a collective, rank 0's heartbeat stops, the group is
    dumped and killed, and the next attempt completes. (hang_timeout 20 s: the first step took
    12 s with the suite's four processes on 2 cores, when it counted as training.)"""
    events = _fault_in_epoch_2(_job(tmp_path, "hang_timeout: 20\n"), tmp_path / "run",
                               "hang@step=70", "hang", reference)
    hang = next(e for e in events if e["event"] == "hang_detected")
    assert hang["attempt"] == 1 and len(hang["workers"]) == 2


@SOAK  # a lost node and the group's restart on Ray: the chief-lost case below
def test_ray_three_nodes_a_hung_rank_0_a_killed_rank_1_a_lost_node_end_bit_identical(
        shared_dir, reference, ray_cluster):
    """On the three-node cluster (no rank on the head, a private /tmp per node): rank 0 hangs
    in the middle of epoch 2. Its silence reaches the supervisor through Ray, the group's stacks
    come back from both nodes, and it restarts. In the next attempt rank 1 is SIGKILLed in the
    middle of the epoch: the group restarts again, from the copies made durable on the chief's
    node. In the third, rank 1's node leaves the cluster (stopped as `ray stop` would): the node
    is journaled as lost with its rank, the next group waits for capacity until the node is
    back, and the run ends with the weights of the uninterrupted run. The journal says which
    node each rank was on, the hang, the kill and the lost node. (hang_timeout 20 s: the first
    step's trace counts as training; slow steps from step 60 leave the test time to act in the
    middle of the epoch. The hang is rank 0's alone: `,rank=0`, its claim in the run directory
    that both nodes see. The node stopped is rank 1's: a lost chief's node would take the
    checkpoints not yet durable with it, and the resume step would vary from run to run.)"""
    cluster = ray_cluster
    address = cluster.address
    job, run = _job(shared_dir, "hang_timeout: 20\n"), shared_dir / "run"
    ctl = live(job, run)
    journal = Journal(ctl.journal)
    p = _run(job, run, "--engine", "ray", "--fault", "hang@step=70,rank=0",
             "--fault", "slow-steps@step=60,for=0.2", env=_ray_env(address))
    with _stopped_if_failing(p):
        _wait(p, lambda: next(journal.iter("hang_detected"), None), what="the hang")
        second = _wait(p, lambda: next((e for e in journal.iter("attempt_started")
                                        if e["attempt"] == 2), None), what="attempt 2")
        beat = _wait(p, lambda: (lambda b: b if b.get("attempt") == 2 and b.get("step", 0) > 62
                                 else None)(heartbeat.read(ctl.control) or {}),
                     what="attempt 2 past step 62, relayed")
        connections = _cluster_connections([x.pid for x in cluster.procs] + [p.pid])
        rank1 = second["workers"][1]
        assert signal_proven(ProcessIdentity.from_record(rank1["pid"], rank1["identity"]),
                             signal.SIGKILL, group=False) is None
        third = _wait(p, lambda: next((e for e in journal.iter("attempt_started")
                                       if e["attempt"] == 3), None), what="attempt 3")
        beat3 = _wait(p, lambda: (lambda b: b if b.get("attempt") == 3 and b.get("step", 0) > 62
                                  else None)(heartbeat.read(ctl.control) or {}),
                      what="attempt 3 past step 62, relayed")
        gone = third["workers"][1]["node"]
        cluster.stop_node(gone)  # the machine leaves the cluster mid-epoch
        _wait(p, lambda: next((e for e in journal.iter("group_placing")
                               if e["attempt"] == 4), None), what="attempt 4 placing")
        cluster.start_node(gone)  # ... and comes back: the placement waiting for it goes on
    out, _ = p.communicate(timeout=900)  # a cap only: the supervisor bounds its own waits
    assert p.returncode == 0, out
    assert beat["step"] < 88, beat  # killed in the middle of epoch 2 (44 steps an epoch)
    assert beat3["step"] < 88, beat3  # its node stopped in the middle of epoch 2 too
    assert len(connections) > 10 and all(
        a.startswith("127.0.0.") and b.startswith("127.0.0.") for a, b in connections), \
        connections
    events = Journal(str(run / "events.jsonl")).events()
    starts = [e for e in events if e["event"] == "attempt_started"]
    assert len(starts) == 4
    for e in starts:  # a rank on each worker node, none on the head, each named
        assert sorted(w["node"] for w in e["workers"]) == sorted(NODES), e
    hang = next(e for e in events if e["event"] == "hang_detected")
    assert hang["attempt"] == 1 and 20 <= hang["last_heartbeat_age_s"] < 40, hang
    assert {w["node"] for w in hang["workers"]} == set(NODES)
    hung = [e for e in events if e["event"] == "fault_injected" and e["fault"].startswith("hang")]
    assert [(e["attempt"], e["rank"]) for e in hung] == [(1, 0)], hung  # rank 0's journal only
    others = Journal(os.path.join(ctl.for_rank(1), "events.jsonl")).events("fault_injected")
    assert not [e for e in others if e["fault"].startswith("hang")], others  # relayed from node
    failed = [e for e in events if e["event"] == "group_member_failed"]
    assert [(e["attempt"], e["rank"], e["exit_code"], e["stopping"]) for e in failed] == \
        [(2, 1, -signal.SIGKILL, [0]), (3, 1, -signal.SIGKILL, [0])]
    assert failed[0]["node"] == rank1["node"] and "lost" not in failed[0]  # its actor lived
    assert failed[1]["node"] == gone and failed[1]["lost"], failed[1]
    lost = [e for e in events if e["event"] == "node_lost"]
    assert [(e["attempt"], e["node"], e["ranks"]) for e in lost] == [(3, gone, [1])], lost
    placed = next(e for e in events if e["event"] == "group_placed" and e["attempt"] == 4)
    assert placed["placed"] and placed["wait_s"] > 1, placed  # it waited for the node
    assert "waiting up to 120 s for Ray to place 2 worker(s)" in out
    assert [e["kind"] for e in events if e["event"] == "attempt_ended"] == \
        ["hang", "killed", "killed", None]
    ready = [e for e in events if e["event"] == "worker_ready"]  # rank 0's, relayed
    assert [e["attempt"] for e in ready] == [1, 2, 3, 4]
    assert ready[1]["resumed_from_step"] == 60 and 60 <= ready[2]["resumed_from_step"] < 88
    assert 60 <= ready[3]["resumed_from_step"] < 88
    assert any(e["event"] == "checkpoint_durable" for e in events)  # from the chief's node
    for log in ("1.log", "1.r1.log"):  # both ranks' stacks, relayed from their nodes
        assert "most recent call first" in (run / "attempts" / log).read_text(), log
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2]
    assert next(e for e in events if e["event"] == "run_completed")["weights_sha256"] == \
        reference
    connected = [e for e in events if e["event"] == "engine_connected"]
    assert [(e["address"], e["auth"]) for e in connected] == [(address, "token")]
    s = run_status(str(run))  # status and the report show the group
    assert [w["rank"] for w in s["workers"]] == [0, 1]
    assert "workers: rank 0 pid" in format_status(s)
    # every rank's last beat of attempt 4, relayed from its node, with the node
    assert sorted(r["node"] for r in s["ranks"]) == sorted(NODES), s["ranks"]
    assert all(r["heartbeat_age_s"] is not None and r["phase"] for r in s["ranks"]), s["ranks"]
    assert "    rank 1 on 127.0.0." in format_status(s)


def test_ray_without_the_clusters_token_is_one_line_and_an_exit(tmp_path, ray_cluster):
    """No token here for a cluster that requires one (nothing in the environment, an empty
    home): refused at once with one line and exit 2, journaled; no endless retry."""
    home = tmp_path / "home"
    home.mkdir()
    env = _ray_env(ray_cluster.address, HOME=str(home))
    del env["RAY_AUTH_TOKEN"]
    job, run = _job(tmp_path), tmp_path / "run"
    p = _run(job, run, "--engine", "ray", env=env)
    out, _ = p.communicate(timeout=120)  # the bound is the connection's, 60 s by default
    assert p.returncode == 2, out
    lines = [ln for ln in out.splitlines() if "token" in ln]
    assert len(lines) == 1 and "requires token authentication and no token was found" \
        in lines[0], out
    gone = Journal(str(live(job, run).journal)).events("engine_unavailable")
    assert len(gone) == 1 and "no token was found" in gone[0]["reason"]


def test_ray_a_placement_that_cannot_be_satisfied_is_one_line_and_an_exit(tmp_path,
                                                                          ray_cluster):
    """Three workers of one CPU each, on two worker nodes of one CPU: Ray cannot place them.
    At the placement bound (3 s here; 120 s by default, the same wait a group lost with its node
    waits for capacity in) the run stops with one line and exit 2, journaled; no worker started,
    no hang."""
    job, run = _job(tmp_path), tmp_path / "run"
    p = _run(job, run, "--engine", "ray", "--workers", "3",
             env=_ray_env(ray_cluster.address, ORCHESTRATOR_RAY_PLACEMENT_TIMEOUT="3"))
    out, _ = p.communicate(timeout=120)  # the bounds are the connection's and the placement's
    assert p.returncode == 2, out
    lines = [ln for ln in out.splitlines() if "could not place" in ln]
    assert lines == ["orchestrator: Ray could not place 3 worker(s) of {'CPU': 1.0} each within "
                     "3 s (ray status shows what it has)"], out
    journal = Journal(live(job, run).journal)
    placed = journal.events("group_placed")
    assert len(placed) == 1 and not placed[0]["placed"] and placed[0]["wait_s"] >= 2.5, placed
    assert journal.events("group_placing")[0]["timeout_s"] == 3
    assert not journal.events("attempt_started")


def test_jax_local_engine_a_rank_s_error_stops_the_group_and_it_ends_bit_identical(
        tmp_path, reference_jax):
    """JAX, 2 processes x 1 device. A rank raises a storage error: it leaves at once (not
    after JAX's 300 s shutdown barrier, which the hang clock would call a hang) and the group is
    stopped. Attempt 2 joins a new coordination service and ends as 1 process x 2 devices
    would have, uninterrupted."""
    events = _fault_in_epoch_2(_job(tmp_path, "backend: jax\nhang_timeout: 20\n"),
                               tmp_path / "run", "raise=storage@step=70", "storage",
                               reference_jax)
    failed = [e for e in events if e["event"] == "group_member_failed"]
    assert len(failed) == 1 and failed[0]["attempt"] == 1, failed
    coordinators = [e["distributed"]["coordinator"] for e in events
                    if e["event"] == "worker_ready"]
    assert len(set(coordinators)) == 2, coordinators
    assert all(c.startswith("127.0.0.1:") for c in coordinators)


@SOAK  # JAX's group on the local engine above; Ray's groups with the chief-lost case below
def test_ray_jax_three_nodes_a_failed_rank_1_ends_bit_identical(shared_dir, reference_jax,
                                                                 ray_cluster):
    """JAX on the three-node cluster: the 2 ranks are one ``jax.distributed`` program whose
    coordination service runs in rank 0 on its node's own address (127.0.0.2 or .3, a port
    taken free there), every connection on 127.0.0.x. Rank 1 raises a storage error in the
    middle of epoch 2: it leaves at once, the group is stopped, and the next group (a new
    coordinator) resumes from the checkpoint made durable on the chief's node and ends as
    1 process x 2 devices would have, uninterrupted. The journal names each rank's node."""
    job, run = _job(shared_dir, "backend: jax\nhang_timeout: 20\n"), shared_dir / "run"
    ctl = live(job, run)
    p = _run(job, run, "--engine", "ray", "--fault", "raise=storage@step=70,rank=1",
             env=_ray_env(ray_cluster.address))
    with _stopped_if_failing(p):
        _wait(p, lambda: (lambda b: b if b.get("step", 0) > 2 else None)(
            heartbeat.read(ctl.control) or {}), what="the group training, relayed")
        connections = _cluster_connections([x.pid for x in ray_cluster.procs] + [p.pid])
    out, _ = p.communicate(timeout=900)  # a cap only: the supervisor bounds its own waits
    assert p.returncode == 0, out
    assert len(connections) > 10 and all(
        a.startswith("127.0.0.") and b.startswith("127.0.0.") for a, b in connections), \
        connections
    events = Journal(str(run / "events.jsonl")).events()
    assert [e["kind"] for e in events if e["event"] == "attempt_ended"] == ["storage", None]
    starts = [e for e in events if e["event"] == "attempt_started"]
    for e in starts:  # a rank on each worker node, none on the head, each named
        assert sorted(w["node"] for w in e["workers"]) == sorted(NODES), e
    placed = [e for e in events if e["event"] == "group_placed"]
    ready = [e for e in events if e["event"] == "worker_ready"]  # rank 0's, relayed
    assert [e["attempt"] for e in ready] == [1, 2] and len(placed) == 2
    for start, place, r in zip(starts, placed, ready):  # rank 0's node, its own port
        coordinator = r["distributed"]["coordinator"]
        assert coordinator == place["addresses"][0], (coordinator, place)
        assert coordinator.startswith(start["workers"][0]["node"] + ":"), (coordinator, start)
    failed = [e for e in events if e["event"] == "group_member_failed"]
    assert [(e["attempt"], e["rank"], e["node"]) for e in failed] == \
        [(1, 1, starts[0]["workers"][1]["node"])], failed
    assert ready[0]["steps_per_epoch"] < ready[1]["resumed_from_step"] < 70, ready[1]
    assert any(e["event"] == "checkpoint_durable" for e in events)  # from the chief's node
    assert [e["epoch"] for e in events if e["event"] == "epoch_completed"] == [1, 2]
    assert next(e for e in events if e["event"] == "run_completed")["weights_sha256"] == \
        reference_jax


def _epochs_heard_live(run) -> list[tuple[int, float]]:
    """(epoch, seconds from the commit that completed it to its ``epoch_completed`` line) for
    every epoch: the commit is the first checkpoint of the run directory's tier that holds the
    epoch (its manifest's ``committed_at``, written on the chief's node), read through the
    store's public listing."""
    from orchestrator.checkpoint.store import CheckpointStore

    events = Journal(str(run / "events.jsonl")).events("epoch_completed")
    copies = CheckpointStore(str(run / "checkpoints")).list()
    out = []
    for e in events:
        first = min((c for c in copies if c.epoch >= e["epoch"]), key=lambda c: c.step)
        out.append((e["epoch"], round(e["ts"] - first.manifest["committed_at"], 3)))
    return out


@pytest.mark.parametrize("chief_node_stopped", [pytest.param(False, marks=SOAK), True],
                         ids=["no-fault", "chief-lost"])  # the epoch before the loss is one
def test_ray_three_nodes_each_epoch_is_journaled_as_its_checkpoint_commits(
        shared_dir, ray_cluster, chief_node_stopped):
    """The chief on another node than the supervisor's (#38): its commits reach the
    supervisor with its heartbeat, through Ray, and each ``epoch_completed`` is journaled
    within 2 s of the checkpoint that completed the epoch, not at the attempt's end; `status`
    shows the epoch meanwhile. With the chief's node stopped in the middle of epoch 2 (and
    started again, so that a group can be placed), the same for the epoch the next group
    completes. (``keep: 20``: every commit stays in the run directory, to be compared; slow
    steps from step 50 give the test time to act in the middle of epoch 2.)"""
    text = JOB.replace("checkpoint: {every_epochs: 1, every_steps: 20}",
                       "checkpoint: {every_epochs: 1, every_steps: 20, keep: 20}")
    shutil.copy(os.path.join(ROOT, "jobs", "digits", "digits_job.py"), shared_dir)
    job, run = shared_dir / "job.yaml", shared_dir / "run"
    job.write_text(text + "hang_timeout: 20\n")
    ctl = live(job, run)
    journal = Journal(ctl.journal)
    faults = ["--fault", "slow-steps@step=50,for=0.2"] if chief_node_stopped else []
    p = _run(str(job), run, "--engine", "ray", *faults, env=_ray_env(ray_cluster.address))
    with _stopped_if_failing(p):
        first = _wait(p, lambda: next(journal.iter("epoch_completed"), None), what="epoch 1")
        s = run_status(str(run))  # while the group trains epoch 2
        assert s["state"] == "running" and s["epoch"] >= 1, s
        assert f"epoch {s['epoch']}/2, step {s['step']}" in format_status(s)
        if chief_node_stopped:
            start = next(journal.iter("attempt_started"))
            _wait(p, lambda: (lambda b: b if b.get("attempt") == 1 and b.get("step", 0) > 52
                              else None)(heartbeat.read(ctl.control) or {}),
                  what="attempt 1 past step 52, relayed")
            chief = start["workers"][0]["node"]
            ray_cluster.stop_node(chief)  # the chief's machine leaves mid-epoch 2
            _wait(p, lambda: next((e for e in journal.iter("group_placing")
                                   if e["attempt"] == 2), None), what="attempt 2 placing")
            ray_cluster.start_node(chief)
    out, _ = p.communicate(timeout=900)  # a cap only: the supervisor bounds its own waits
    assert p.returncode == 0, out
    assert first["epoch"] == 1
    events = Journal(str(run / "events.jsonl")).events()
    ended = [e["kind"] for e in events if e["event"] == "attempt_ended"]
    assert len(ended) == 1 + chief_node_stopped and ended[-1] is None, ended
    starts = [e for e in events if e["event"] == "attempt_started"]
    assert all(w["node"] != HEAD for e in starts for w in e["workers"])  # the chief is away
    steps = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    assert len(steps) == len(set(steps)), steps  # each commit journaled once
    heard = _epochs_heard_live(run)
    assert [e for e, _ in heard] == [1, 2], heard
    assert all(0 <= lag < 2.0 for _, lag in heard), heard

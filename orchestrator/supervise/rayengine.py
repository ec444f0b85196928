"""Ray places the workers of a group: one placement-group bundle per rank, one actor in each.

Why plain actors and not Ray Train's ``TensorflowTrainer``: the trainer owns the worker loop
(it runs a function it was given inside its own workers, restarts them under its own
``FailureConfig`` and keeps its own checkpoints), so our worker process - its error record and
exit status that the classifier reads, its SIGTERM save, its heartbeat that the hang clock
watches, its exact mid-epoch resume - would have to be rebuilt inside it, and our recovery policy
would be a second one next to Ray's. It also fails on Keras 3 under MWMS as shipped
(ray-project/ray#47464). What we take from Ray is what it is for: placement (a placement group
holding each rank's ``worker_resources``), the addresses of the placed workers, and its fault
detection (an actor whose process or node died raises ``RayActorError`` on its pending call).

Each actor (``WorkerHost``) runs our worker as a child process in its own process group on its
node, with the supervisor's environment plus what Ray set for the bundle (the GPUs it holds),
and answers: where it runs, wait for the exit (with the error record and the end of the log,
for a rank on another node), a signal to the group, a stop. Connecting: ``address:`` in the job,
else ``RAY_ADDRESS``, else a local Ray started by ``ray.init()``.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import threading
import time

from orchestrator.core.clock import SYSTEM
from orchestrator.core.events import Event
from orchestrator.core.rundir import ENV_RAY_NODE_ADDRESS, JOURNAL_FILE
from orchestrator.supervise import rayconnect, relay

from orchestrator.supervise.procs import identity_record, spawn
from orchestrator.supervise.group import EngineUnavailable, Member, free_port
from orchestrator.supervise.messages import Exited

log = logging.getLogger(__name__)

# What Ray sets in an actor for the resources of its bundle; the worker must see the same.
RAY_DEVICE_ENV = ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_HOST_BOUNDS",
                  "NEURON_RT_VISIBLE_CORES")


# Bounds of the two waits before a group's first step, in seconds (journaled with each wait).
CONNECT_TIMEOUT_ENV = "ORCHESTRATOR_RAY_CONNECT_TIMEOUT"
from orchestrator.core.rundir import ENV_RAY_PLACEMENT_TIMEOUT as PLACEMENT_TIMEOUT_ENV  # noqa: E402


class RayUnavailable(EngineUnavailable):
    """engine: ray was asked for and Ray is not installed or cannot be reached."""


def _host_class(ray):
    # threaded: the supervisor's relay call, a signal or a stop are answered while wait() waits
    @ray.remote(max_restarts=0, max_concurrency=8)
    class WorkerHost:
        """Runs one rank's worker process on the node Ray placed this actor on, relays its
        control state (relay.py) and, on a node that is not the supervisor's, makes the
        durable copies of the checkpoints it commits there (``NodeMirror``)."""

        def __init__(self):
            self.proc = None
            self.files = None
            self.mirror = None

        def place(self) -> tuple[str, str, str, str, str]:
            """(host name, host:port for TF_CONFIG, the node's address, its node_key, Ray's
            id of the node: a node that comes back at the same address is another)."""
            return _place(ray)

        def start(self, cmd: list, env: dict, cwd: str, log: str, control: str, files: bool,
                  tiers: tuple | None) -> tuple:
            """(pid, identity, relay cursor): taken here, on its node, where its /proc is.
            ``files``: this node is not the supervisor's (relay the journal and the log);
            ``tiers``: (local root, durable root, retention) for this node's durable copies."""
            self.files, self.mirror, self.proc, cursor = _start_rank(cmd, env, cwd, log,
                                                                     control, files, tiers)
            return self.proc.pid, identity_record(self.proc), cursor

        def relay(self, cursor, timeout: float) -> tuple:
            """What changed in the rank's control state since ``cursor`` (relay.RankFiles)."""
            return self.files.next(cursor, timeout)

        def wait(self, error_record: str, log: str) -> tuple:
            """(exit status, when it exited here, its error record, the end of its log)."""
            return _exit_report(self.proc, self.mirror, error_record, log)

        def make_durable(self, timeout: float) -> dict | None:
            """This node's checkpoints not durable yet, copied now (``NodeMirror.again``);
            None where this rank made no durable copies (not the chief, or on the
            supervisor's node)."""
            return None if self.mirror is None else self.mirror.again(timeout)

        def signal(self, sig: int) -> None:
            if self.proc is not None and self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass  # it exited meanwhile: wait() reports it

        def stop(self, grace: float) -> None:
            if self.proc is None or self.proc.poll() is not None:
                return
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            self.signal(signal.SIGKILL)
            self.proc.wait()

    return WorkerHost


def _place(ray) -> tuple[str, str, str, str, str]:
    """Where ``WorkerHost.place`` runs, as it answers it."""
    ip = ray.util.get_node_ip_address()  # 127.0.0.1 for a one-node Ray on loopback
    return (socket.gethostname(), f"{ip}:{free_port(ip)}", ip, relay.node_key(),
            ray.get_runtime_context().get_node_id())


def _start_rank(cmd: list, env: dict, cwd: str, log: str, control: str, files: bool,
                tiers: tuple | None) -> tuple:
    """On a rank's node (``WorkerHost.start``): its relay, its node's durable mirror (where
    ``tiers``), then its worker in the bundle's devices: (files, mirror, process, cursor)."""
    env = dict(env, **{k: v for k, v in os.environ.items() if k in RAY_DEVICE_ENV})
    os.makedirs(os.path.dirname(log), exist_ok=True)
    os.makedirs(control, exist_ok=True)
    rank_files = relay.RankFiles(control, log, files)
    cursor = rank_files.cursor()
    mirror = None
    if tiers is not None:
        mirror = NodeMirror(*tiers, journal=os.path.join(control, JOURNAL_FILE))
    return rank_files, mirror, spawn(cmd, env, cwd, log), cursor


def _exit_report(proc, mirror, error_record: str, log: str) -> tuple:
    """On a rank's node (``WorkerHost.wait``): (exit status, when it exited there, its error
    record, the end of its log), its node's last checkpoints made durable first."""
    rc = proc.wait()
    at = time.time()  # the ranks' order of exit: Ray tells the exits in its own
    if mirror is not None:  # its last checkpoints durable before the exit is told
        mirror.close()
    record = tail = None
    try:
        with open(error_record, encoding="utf-8") as f:
            record = f.read()
    except OSError:
        record = None
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 64 * 1024))
            tail = f.read()
    except OSError:
        tail = None
    return rc, at, record, tail


class NodeMirror:
    """The durable mirror (checkpoint/mirror.py) run on a rank's node, over that node's local
    tier: only there can its checkpoints be read. Its events go into the rank's journal on the
    node, relayed with the rest; each commit there wakes it (a watchdog event, as at home)."""

    def __init__(self, local_root: str, durable_root: str, retention, journal: str):
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        from orchestrator.checkpoint.mirror import DurableMirror
        from orchestrator.checkpoint.tiers import TieredStore
        from orchestrator.core.journal import Journal
        from orchestrator.supervise.slot import PLACED

        os.makedirs(local_root, exist_ok=True)
        self.mirror = DurableMirror(TieredStore(local_root, durable_root), Journal(journal),
                                    retention).start()
        mirror = self.mirror

        class Wake(FileSystemEventHandler):
            def on_created(self, event):
                mirror.notify()

            def on_moved(self, event):
                mirror.notify()

        self.observer = Observer()
        self.observer.schedule(Wake(), local_root, recursive=True, event_filter=PLACED)
        self.observer.start()

    def close(self, timeout: float = 120.0) -> None:
        self.observer.stop()
        self.mirror.flush(timeout)
        self.mirror.stop()

    def again(self, timeout: float) -> dict:
        """One more pass of the same copy, after the rank's exit: what the flush at the exit
        left on this node (the run directory away then, its bound run out) made durable now
        if it can be, with the same verification. ``copied``: the steps that became durable;
        ``pending``: those still only here (a copy marked durable once is not counted: with
        the run directory away, nothing says it went)."""
        from orchestrator.checkpoint.mirror import DurableMirror
        from orchestrator.checkpoint.tiers import is_durable

        store = self.mirror.store
        before = durable_steps(store)
        mirror = DurableMirror(store, self.mirror.journal, self.mirror.retention).start()
        try:
            pending = set(mirror.flush(timeout))
        finally:
            mirror.stop()
        pending -= {c.step for c in store.local.list() if is_durable(c)}
        return {"copied": sorted(durable_steps(store) - before), "pending": sorted(pending)}


def durable_steps(store) -> set[int]:
    """The steps of ``store``'s durable tier that read back intact."""
    return {c.step for c in store.durable_list()
            if store.durable.verify(c.path, cached=True) is None}


class RayEngine:
    name = "ray"

    def __init__(self, address: str | None, resources: dict, journal=None,
                 tiers: tuple | None = None):
        """Connect as Ray's driver (rayconnect.py: bounded by ``CONNECT_TIMEOUT_ENV``, in the
        cluster's authentication mode), journaled either way. ``tiers``: (local root, durable
        root, retention) of the run's checkpoints, for the durable copies made on a rank's
        node. ``ENV_RAY_NODE_ADDRESS`` names this node's address where Ray cannot find it."""
        if importlib.util.find_spec("ray") is None:
            raise RayUnavailable("engine: ray needs Ray: pip install 'orchestrator[ray]'")
        self.resources, self.journal = dict(resources), journal
        address = address or os.environ.get("RAY_ADDRESS") or None
        timeout = float(os.environ.get(CONNECT_TIMEOUT_ENV, "60"))
        node = os.environ.get(ENV_RAY_NODE_ADDRESS) or None
        here = {"_node_ip_address": node} if node else {}
        try:
            info = rayconnect.connect(address, timeout, include_dashboard=False,
                                      log_to_driver=False, configure_logging=False, **here)
        except rayconnect.ConnectError as exc:
            self._journal(Event.ENGINE_UNAVAILABLE, address=address, reason=str(exc))
            raise RayUnavailable(str(exc)) from exc
        self._journal(Event.ENGINE_CONNECTED, timeout_s=timeout, **info)
        import ray

        self.ray = ray
        self.Host = _host_class(ray)
        self.pg = None
        self.hosts: list = []
        self.nodes: list = []  # (address, node_key, node id) of each placed rank
        self.tiers = tiers
        self.here = relay.node_key()

    def open(self, size: int) -> list[tuple[str, str]]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.close()
        self.pg = placement_group([dict(self.resources)] * size, strategy="SPREAD")
        timeout = self.placement_timeout()
        if not self.pg.wait(min(1.0, timeout)):  # not at once: say what it waits for
            log.info(f"waiting up to {timeout:.0f} s for Ray to place {size} worker(s) of "
                     f"{self.resources} each (a node lost or busy; ray status shows them)")
            if not self.pg.wait(max(0.0, timeout - 1.0)):
                raise RayUnavailable(f"Ray could not place {size} worker(s) of "
                                     f"{self.resources} each within {timeout:.0f} s (ray "
                                     f"status shows what it has)")
        cpus = self.resources.get("CPU", 0)
        gpus = self.resources.get("GPU", 0)
        other = {k: v for k, v in self.resources.items() if k not in ("CPU", "GPU")}
        self.hosts = [self.Host.options(
            num_cpus=cpus, num_gpus=gpus, resources=other or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=i)).remote() for i in range(size)]
        places = self.ray.get([h.place.remote() for h in self.hosts])
        self.nodes = [(ip, key, node_id) for _, _, ip, key, node_id in places]
        return [(host, addr) for host, addr, *_ in places]

    @staticmethod
    def placement_timeout() -> float:
        return float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "120"))

    def _journal(self, event: str, **fields) -> None:
        if self.journal is not None:
            self.journal.append(event, engine=self.name, **fields)

    def spawn(self, m: Member, cmd: list[str], env: dict, cwd: str, events) -> None:
        host = self.hosts[m.rank]
        m.handle = host
        m.node, key, node_id = self.nodes[m.rank]
        away = key != self.here  # its control folder is not ours: relay its files too
        tiers = self.tiers if away and m.rank == 0 else None  # the chief commits checkpoints
        control = m.control or os.path.dirname(os.path.dirname(m.log))
        m.pid, m.identity, cursor = self.ray.get(host.start.remote(
            cmd, env, cwd, m.log, control, away, tiers))
        pending = host.wait.remote(m.error_record, m.log)
        deliver = relay.Delivery(m.rank, control, m.log, self.journal, events)

        def relay_until_exit(cur):
            """The rank's beats, journal and log, until its exit; then what it left last."""
            while True:
                call = host.relay.remote(cur, 2.0)
                ready, _ = self.ray.wait([pending, call], num_returns=1)
                exited = pending in ready
                try:
                    cur, updates = self.ray.get(call)
                    deliver(updates)
                    if exited:
                        deliver(self.ray.get(host.relay.remote(cur, 0.0))[1])
                        return
                except self.ray.exceptions.RayError:
                    return  # its actor or node died: the exit's watch says so

        def watch():
            relay_until_exit(cursor)
            try:
                rc, at, record, tail = self.ray.get(pending)
            except self.ray.exceptions.RayError as exc:  # the actor's process or node died
                rc, at, record, tail = -signal.SIGKILL, None, None, None
                m.info["lost"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                if node_gone(self.ray, node_id):  # attempt.py journals node_lost
                    m.info["node_lost"] = {"node": m.node, "node_id": node_id}
            _keep_remote(m, record, tail)
            events.put(Exited(m, rc, at))

        threading.Thread(target=watch, name=f"ray-rank-{m.rank}", daemon=True).start()

    def signal(self, m: Member, sig: int) -> None:
        m.handle.signal.remote(sig)

    def kill(self, m: Member, grace: float) -> None:
        """Stop its worker through its actor; the actor stays until the next placement (its
        wait() tells the exit, the relay drains and the node's durable copies are made)."""
        try:
            self.ray.get(m.handle.stop.remote(grace), timeout=grace + 30)
        except self.ray.exceptions.RayError as exc:  # its node died: so did its worker
            m.info.setdefault("lost", f"{type(exc).__name__} while stopping it")
            self.ray.kill(m.handle)

    def gather(self, timeout: float) -> dict | None:
        """Before the next group is placed: the last group's chief, where its node is not
        this one, makes durable what it holds only there (``gather_from``): a restore reads
        this node's tiers and the run directory, never another node's disk."""
        if not self.hosts or self.nodes[0][1] == self.here:
            return None
        return gather_from(self.ray, self.hosts[0], self.nodes[0][0], timeout, self.journal)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for h in self.hosts:
            self.ray.kill(h)
        self.hosts = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


# How long the cluster may take to call a node dead once its rank's actor is: a node stopped
# (`ray stop`, a drained VM) is dead at once; one that vanished is after GCS health checks.
NODE_DEATH_WAIT_S = 10.0


def node_gone(ray, node_id: str, wait_s: float = NODE_DEATH_WAIT_S, poll_s: float = 0.5,
              clock=None) -> bool:
    """Whether the node ``node_id`` left the cluster (dead, or no longer listed), asked of the
    cluster's own view (``ray.nodes()``) until ``wait_s``: an actor that died on a live node
    (its process killed) is not a node lost."""
    clock = clock or SYSTEM
    deadline = clock.monotonic() + wait_s
    while True:
        try:
            node = next((n for n in ray.nodes() if n.get("NodeID") == node_id), None)
        except Exception:  # noqa: BLE001 - the GCS itself unreachable: not this node's fact
            return False
        if node is None or not node.get("Alive", False):
            return True
        if clock.monotonic() >= deadline:
            return False
        clock.sleep(poll_s)


def gather_from(ray, chief, node: str, timeout: float, journal) -> dict | None:
    """Ask the actor of a group's chief, alive after its rank's exit until the next placement,
    to copy its node's checkpoints that are not durable yet (``make_durable``, bounded by
    ``timeout``), so that the restore that follows finds the newest verified one. Journaled
    as ``checkpoints_gathered`` when it copied something, left something, or could not be
    asked (its node gone: what was only there is lost with it); None when there was nothing."""
    try:
        got = ray.get(chief.make_durable.remote(timeout), timeout=timeout + 30)
    except ray.exceptions.RayError as exc:  # its node died, or it did not answer in time
        got = {"reason": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"}
    if not got or not (got.get("copied") or got.get("pending") or got.get("reason")):
        return None
    if journal is not None:
        journal.append(Event.CHECKPOINTS_GATHERED, node=node, **got)
    if got.get("pending"):
        log.warning(f"the last chief's node {node} holds checkpoint step(s) {got['pending']} "
                    f"that it could not copy to the run directory within {timeout:.0f} s: the "
                    f"group restores from the newest durable one")
    elif got.get("reason"):
        log.warning(f"could not ask the last chief's node {node} for checkpoints the run "
                    f"directory may lack ({got['reason']}): the group restores from the newest "
                    f"durable one")
    return got


def _keep_remote(m: Member, record: str | None, tail: bytes | None) -> None:
    """A rank on another node left its error record and log there: keep the copies the actor
    returned where the supervisor reads them (same node: the files are already here)."""
    if record is not None and not os.path.exists(m.error_record):
        with open(m.error_record, "w", encoding="utf-8") as f:
            f.write(record)
    if tail is not None and not os.path.exists(m.log):
        with open(m.log, "wb") as f:
            f.write(tail)

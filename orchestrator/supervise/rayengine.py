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
import os
import signal
import threading

from orchestrator.core.events import Event
from orchestrator.supervise import rayconnect

from orchestrator.supervise.procs import identity_record, spawn
from orchestrator.supervise.group import EngineUnavailable, Member, free_port
from orchestrator.supervise.messages import Exited

# What Ray sets in an actor for the resources of its bundle; the worker must see the same.
RAY_DEVICE_ENV = ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_HOST_BOUNDS",
                  "NEURON_RT_VISIBLE_CORES")


# Bounds of the two waits before a group's first step, in seconds (journaled with each wait).
CONNECT_TIMEOUT_ENV = "ORCHESTRATOR_RAY_CONNECT_TIMEOUT"
from orchestrator.core.rundir import ENV_RAY_PLACEMENT_TIMEOUT as PLACEMENT_TIMEOUT_ENV  # noqa: E402


class RayUnavailable(EngineUnavailable):
    """engine: ray was asked for and Ray is not installed or cannot be reached."""


def _host_class(ray):
    @ray.remote(max_restarts=0)
    class WorkerHost:
        """Runs one rank's worker process on the node Ray placed this actor on."""

        def __init__(self):
            self.proc = None

        def place(self) -> tuple[str, str]:
            import socket

            ip = ray.util.get_node_ip_address()  # 127.0.0.1 for a one-node Ray on loopback
            return socket.gethostname(), f"{ip}:{free_port(ip)}"

        def start(self, cmd: list, env: dict, cwd: str, log: str) -> tuple:
            """(pid, identity): taken here, on its node, where its /proc is."""
            env = dict(env, **{k: v for k, v in os.environ.items() if k in RAY_DEVICE_ENV})
            os.makedirs(os.path.dirname(log), exist_ok=True)
            self.proc = spawn(cmd, env, cwd, log)
            return self.proc.pid, identity_record(self.proc)

        def wait(self, error_record: str, log: str) -> tuple:
            rc = self.proc.wait()
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
            return rc, record, tail

        def signal(self, sig: int) -> None:
            if self.proc is not None and self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass  # it exited meanwhile: wait() reports it

        def stop(self, grace: float) -> None:
            import subprocess

            if self.proc is None or self.proc.poll() is not None:
                return
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            self.signal(signal.SIGKILL)

    return WorkerHost


class RayEngine:
    name = "ray"

    def __init__(self, address: str | None, resources: dict, say=print, journal=None):
        """Connect as Ray's driver (rayconnect.py: bounded by ``CONNECT_TIMEOUT_ENV``, in the
        cluster's authentication mode), journaled either way."""
        if importlib.util.find_spec("ray") is None:
            raise RayUnavailable("engine: ray needs Ray: pip install 'orchestrator[ray]'")
        self.resources, self.say, self.journal = dict(resources), say, journal
        address = address or os.environ.get("RAY_ADDRESS") or None
        timeout = float(os.environ.get(CONNECT_TIMEOUT_ENV, "60"))
        try:
            info = rayconnect.connect(address, timeout, include_dashboard=False,
                                      log_to_driver=False, configure_logging=False)
        except rayconnect.ConnectError as exc:
            self._journal(Event.ENGINE_UNAVAILABLE, address=address, reason=str(exc))
            raise RayUnavailable(str(exc)) from exc
        self._journal(Event.ENGINE_CONNECTED, timeout_s=timeout, **info)
        import ray

        self.ray = ray
        self.Host = _host_class(ray)
        self.pg = None
        self.hosts: list = []

    def open(self, size: int) -> list[tuple[str, str]]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.close()
        self.pg = placement_group([dict(self.resources)] * size, strategy="SPREAD")
        timeout = self.placement_timeout()
        if not self.pg.wait(timeout):
            raise RayUnavailable(f"Ray could not place {size} worker(s) of {self.resources} "
                                 f"each within {timeout:.0f} s (ray status shows what it has)")
        cpus = self.resources.get("CPU", 0)
        gpus = self.resources.get("GPU", 0)
        other = {k: v for k, v in self.resources.items() if k not in ("CPU", "GPU")}
        self.hosts = [self.Host.options(
            num_cpus=cpus, num_gpus=gpus, resources=other or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=i)).remote() for i in range(size)]
        return [tuple(p) for p in self.ray.get([h.place.remote() for h in self.hosts])]

    @staticmethod
    def placement_timeout() -> float:
        return float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "120"))

    def _journal(self, event: str, **fields) -> None:
        if self.journal is not None:
            self.journal.append(event, engine=self.name, **fields)

    def spawn(self, m: Member, cmd: list[str], env: dict, cwd: str, events) -> None:
        host = self.hosts[m.rank]
        m.handle = host
        m.pid, m.identity = self.ray.get(host.start.remote(cmd, env, cwd, m.log))
        pending = host.wait.remote(m.error_record, m.log)

        def watch():
            try:
                rc, record, tail = self.ray.get(pending)
            except self.ray.exceptions.RayError as exc:  # the actor's process or node died
                rc, record, tail = -signal.SIGKILL, None, None
                m.info["lost"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            _keep_remote(m, record, tail)
            events.put(Exited(m, rc))

        threading.Thread(target=watch, name=f"ray-rank-{m.rank}", daemon=True).start()

    def signal(self, m: Member, sig: int) -> None:
        m.handle.signal.remote(sig)

    def kill(self, m: Member, grace: float) -> None:
        try:
            self.ray.get(m.handle.stop.remote(grace), timeout=grace + 30)
        except self.ray.exceptions.RayError as exc:  # its node died: so did its worker
            m.info.setdefault("lost", f"{type(exc).__name__} while stopping it")
        finally:
            self.ray.kill(m.handle)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for h in self.hosts:
            self.ray.kill(h)
        self.hosts = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def _keep_remote(m: Member, record: str | None, tail: bytes | None) -> None:
    """A rank on another node left its error record and log there: keep the copies the actor
    returned where the supervisor reads them (same node: the files are already here)."""
    if record is not None and not os.path.exists(m.error_record):
        with open(m.error_record, "w", encoding="utf-8") as f:
            f.write(record)
    if tail is not None and not os.path.exists(m.log):
        with open(m.log, "wb") as f:
            f.write(tail)

"""Accelerator probes for the supervisor, none of which imports TensorFlow or touches the chip.

The supervisor must never hold the accelerator (on a TPU VM, libtpu takes a lock file and a
second process cannot initialise it), so it looks from outside: a TPU node by TCP reachability
of its gRPC address, a TPU VM by its device files and who holds libtpu's lock or a chip
(core/tpuvm.py: ``/proc/locks`` and ``/proc/*/fd``, not the lock file itself), a GPU by
``nvidia-smi``, a CPU always. ``wait_until_ok`` probes with exponential backoff (tenacity).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_exponential

from orchestrator.core import tpuvm

OK, UNAVAILABLE, BUSY = "ok", "unavailable", "busy"
TPU_DEVICE_GLOBS = tpuvm.DEVICE_GLOBS


@dataclass(frozen=True)
class ProbeResult:
    accelerator: str   # tpu_node | tpu_vm | gpu | cpu
    state: str         # ok | unavailable | busy
    detail: str

    @property
    def ok(self) -> bool:
        return self.state == OK

    def as_dict(self) -> dict:
        return {"accelerator": self.accelerator, "state": self.state, "detail": self.detail}


def tpu_node_address(env) -> tuple[str, int] | None:
    """host, port of the TPU node's gRPC endpoint (COLAB_TPU_ADDR or TPU_NAME=grpc://h:p)."""
    raw = env.get("COLAB_TPU_ADDR") or env.get("TPU_NAME") or ""
    raw = raw.split("://", 1)[-1]
    host, _, port = raw.rpartition(":")
    if host and port.isdigit():
        return host, int(port)
    return None


def probe_tpu_node(host: str, port: int, timeout: float = 3.0) -> ProbeResult:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ProbeResult("tpu_node", OK, f"{host}:{port} accepts connections")
    except OSError as exc:
        return ProbeResult("tpu_node", UNAVAILABLE, f"{host}:{port}: {exc}")


def probe_tpu_vm(device_globs=TPU_DEVICE_GLOBS, lockfile: str | None = None,
                 own_pgid: int | None = None, proc_locks: str = tpuvm.PROC_LOCKS) -> ProbeResult:
    """Device files, then who holds the TPU: a lock on libtpu's lock file (``/proc/locks``) or
    a chip's device file open, by a process other than our own worker's group. A lock file
    nobody holds is free: libtpu's ``lockf`` takes it. Never the JAX or TensorFlow import,
    which would take the TPU from the worker."""
    devices = tpuvm.device_files(device_globs)
    if not devices:
        return ProbeResult("tpu_vm", UNAVAILABLE, f"no TPU device files ({', '.join(device_globs)})")
    use = tpuvm.tpu_use(device_globs, None if lockfile is None else [lockfile], proc_locks)
    holders = []
    for pid in use.holders():
        try:
            if own_pgid is not None and pid > 0 and os.getpgid(pid) == own_pgid:
                continue  # our own worker holds it: that is the point
        except ProcessLookupError:
            continue
        holders.append(pid)
    chips = tpuvm.pci_chips()
    seen = f"{len(devices)} device file(s)" + (f", {' '.join(chips)} on PCI" if chips else "")
    if holders:
        return ProbeResult("tpu_vm", BUSY, f"{seen}; the TPU is held by "
                           + ", ".join(use.describe(p) if p > 0 else "an open-file-description "
                                       "lock" for p in holders))
    left = f"no lock on {', '.join(use.locks)}" if use.locks else "no libtpu lock file"
    return ProbeResult("tpu_vm", OK, f"{seen}; the TPU is free ({left})")


def probe_gpu(env=None, timeout: float = 20.0) -> ProbeResult:
    env = dict(os.environ if env is None else env)
    exe = shutil.which("nvidia-smi", path=env.get("PATH"))
    if exe is None:
        return ProbeResult("gpu", UNAVAILABLE, "nvidia-smi not found")
    cmd = [exe, "--query-gpu=index,name,memory.used,memory.total",
           "--format=csv,noheader,nounits"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return ProbeResult("gpu", UNAVAILABLE, f"nvidia-smi did not answer within {timeout:g} s")
    lines = [ln.strip() for ln in p.stdout.splitlines() if ln.strip()]
    if p.returncode != 0 or not lines:
        why = (p.stdout + p.stderr).strip().splitlines()
        return ProbeResult("gpu", UNAVAILABLE,
                           f"nvidia-smi exit {p.returncode}: {why[0] if why else 'no GPU listed'}")
    return ProbeResult("gpu", OK, "; ".join(lines))


def probe_cpu() -> ProbeResult:
    return ProbeResult("cpu", OK, f"{os.cpu_count()} CPU(s)")


def for_strategy(strategy: str, env=None, own_pgid: Callable[[], int | None] = lambda: None
                 ) -> Callable[[], ProbeResult]:
    """The probe for what a worker of ``strategy`` (auto|tpu|gpu|cpu) will run on here."""
    env = dict(os.environ if env is None else env)
    node = tpu_node_address(env)
    tpu_named = bool(env.get("TPU_NAME") or env.get("COLAB_TPU_ADDR"))  # e.g. TPU_NAME=local
    has_tpu_vm = tpu_named or bool(tpuvm.device_files())
    if strategy in ("auto", "tpu") and node:
        return lambda: probe_tpu_node(*node)
    if strategy == "tpu" or (strategy == "auto" and has_tpu_vm):
        return lambda: probe_tpu_vm(own_pgid=own_pgid())
    if strategy == "gpu" or (strategy == "auto" and shutil.which("nvidia-smi",
                                                                 path=env.get("PATH"))):
        return lambda: probe_gpu(env)
    return probe_cpu


def wait_until_ok(probe: Callable[[], ProbeResult], initial: float, maximum: float,
                  timeout: float, sleep: Callable[[float], None] = time.sleep
                  ) -> tuple[ProbeResult, float, int]:
    """Probe until it answers ok or ``timeout`` s passed; returns (last result, s, probes)."""
    t0, count = time.monotonic(), [0]

    def once():
        count[0] += 1
        return probe()

    retrying = Retrying(retry=retry_if_result(lambda r: not r.ok),
                        wait=wait_exponential(multiplier=initial, max=maximum),
                        stop=stop_after_delay(timeout), sleep=sleep,
                        retry_error_callback=lambda rs: rs.outcome.result())
    result = retrying(once)
    return result, round(time.monotonic() - t0, 3), count[0]

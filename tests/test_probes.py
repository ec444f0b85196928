"""Accelerator probes from outside: TCP, device files + lock holder, nvidia-smi, CPU."""
import os
import socket
import stat
import time

import pytest

from orchestrator.core import tpuvm
from orchestrator.recovery import probes
from test_tpuvm import held, lockf


def test_tpu_node_probe_is_tcp_reachability_of_the_grpc_address():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    env = {"COLAB_TPU_ADDR": f"127.0.0.1:{port}"}
    assert probes.tpu_node_address(env) == ("127.0.0.1", port)
    assert probes.tpu_node_address({"TPU_NAME": "grpc://10.0.0.2:8470"}) == ("10.0.0.2", 8470)
    probe = probes.for_strategy("auto", env)
    assert probe().as_dict() == {"accelerator": "tpu_node", "state": "ok",
                                 "detail": f"127.0.0.1:{port} accepts connections"}
    srv.close()
    r = probe()
    assert (r.accelerator, r.state) == ("tpu_node", "unavailable") and str(port) in r.detail


@pytest.mark.integration
def test_tpu_vm_probe_sees_devices_and_who_holds_the_libtpu_lock(tmp_path):
    """libtpu's lock is a POSIX lock (lockf) on its lock file, seen in /proc/locks; a file that
    is only open, or left behind, is free. A process with a chip's device file open uses the
    TPU (what libtpu names in "already in use by process with pid N")."""
    dev = tmp_path / "accel0"
    lock = tmp_path / "libtpu_lockfile"
    globs = (str(tmp_path / "accel*"),)
    r = probes.probe_tpu_vm(globs, str(lock))
    assert r.state == "unavailable" and "no TPU device files" in r.detail
    dev.write_text("")
    assert probes.probe_tpu_vm(globs, str(lock)).state == "ok"
    lock.write_text("")  # left behind by a worker that is gone: libtpu's lockf takes it
    with held(f"f = open({str(lock)!r})"):
        r = probes.probe_tpu_vm(globs, str(lock))
        assert r.state == "ok" and r.detail.endswith(f"the TPU is free (no lock on {lock})")
    with held(lockf(lock)) as holder:
        assert tpuvm.lock_holders(str(lock)) == [holder.pid]
        r = probes.probe_tpu_vm(globs, str(lock))
        assert r.state == "busy" and f"pid {holder.pid} (" in r.detail and "python -c" in r.detail
        # our own worker (its process group) holding it is not "busy"
        own = probes.probe_tpu_vm(globs, str(lock), own_pgid=os.getpgid(holder.pid))
        assert own.state == "ok"
    assert probes.probe_tpu_vm(globs, str(lock)).state == "ok"  # the kernel dropped its lock
    with held(f"f = open({str(dev)!r})") as user:
        r = probes.probe_tpu_vm(globs, str(lock))
        assert r.state == "busy" and f"pid {user.pid} (" in r.detail


def _fake_nvidia_smi(tmp_path, script: str) -> dict:
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir(exist_ok=True)
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{exe.parent}{os.pathsep}/usr/bin:/bin"}


@pytest.mark.integration
def test_gpu_probe_runs_nvidia_smi(tmp_path):
    env = _fake_nvidia_smi(tmp_path, 'echo "0, NVIDIA A100-SXM4-40GB, 3, 40960"\n')
    r = probes.for_strategy("auto", env)()
    assert (r.accelerator, r.state, r.detail) == ("gpu", "ok", "0, NVIDIA A100-SXM4-40GB, 3, 40960")
    env = _fake_nvidia_smi(tmp_path, 'echo "NVIDIA-SMI has failed because it couldn\'t '
                                     'communicate with the NVIDIA driver."; exit 9\n')
    r = probes.probe_gpu(env)
    assert r.state == "unavailable" and "exit 9: NVIDIA-SMI has failed" in r.detail
    r = probes.probe_gpu({"PATH": str(tmp_path / "empty")})
    assert r.state == "unavailable" and r.detail == "nvidia-smi not found"


def test_cpu_is_always_there_and_is_the_fallback_probe(tmp_path):
    probe = probes.for_strategy("cpu", {"PATH": str(tmp_path)})
    assert probe().ok and probe().accelerator == "cpu"


def test_wait_until_ok_backs_off_exponentially_and_stops_at_the_timeout():
    answers = iter(["unavailable", "unavailable", "unavailable", "ok"])
    slept = []
    r, _, count = probes.wait_until_ok(
        lambda: probes.ProbeResult("gpu", next(answers), "x"), initial=1, maximum=3,
        timeout=60, sleep=slept.append)
    assert r.ok and count == 4 and slept == [1, 2, 3]
    t0 = time.monotonic()
    r, waited, count = probes.wait_until_ok(lambda: probes.ProbeResult("gpu", "unavailable", "x"),
                                            initial=0.05, maximum=0.1, timeout=0.5)
    assert not r.ok and count >= 3 and 0.5 <= waited < 3 and time.monotonic() - t0 < 3


def test_a_tpu_vm_s_local_chips_win_over_a_stale_tpu_node_address(monkeypatch, tmp_path):
    """Colab's TPU runtimes are TPU VMs now: an old COLAB_TPU_ADDR left in the environment must
    not send the worker to a gRPC node (doctor checks in the same order)."""
    from orchestrator.train import accelerators

    monkeypatch.delenv("TPU_NAME", raising=False)
    monkeypatch.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    monkeypatch.setattr(tpuvm, "DEVICE_GLOBS", (str(tmp_path / "accel*"),
                                                str(tmp_path / "vfio" / "[0-9]*")))
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "vfio").write_text("")  # the VFIO container node: no TPU
    assert accelerators.tpu_address() == "grpc://10.0.0.2:8470"
    (tmp_path / "vfio" / "0").write_text("")  # a v5e chip's group
    assert accelerators.tpu_address() == "local"

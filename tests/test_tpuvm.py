"""A TPU VM on the JAX backend, up to the boundary (no TPU here): the import-only standby never
initialises JAX, libtpu's lock is read from /proc/locks and cleared only when no process holds
it, the reinit action on JAX does that, and a JAX worker on a TPU VM names the TPU platform.

What stands in for the TPU: device files in a temp dir (``/dev/accel0``, ``/dev/vfio/0``),
lock files taken with ``lockf`` by processes we start (libtpu's own call), ``/proc/locks``
lines in the kernel's format, and a sysfs PCI tree with Google's ids."""
import contextlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import ROOT
from orchestrator.core import tpuvm
from orchestrator.core.kinds import Action
from orchestrator.core.rundir import ENV_REINIT
from orchestrator.recovery.actions import Remedies
from orchestrator.recovery.policy import Decision

# The standby's own serve(), import-only, on the digits job on JAX: where it would wait for the
# promotion line, report what JAX and Keras hold (and pretend the pipe closed: it exits 0). It
# keeps its priority: at nice 19 beside two busy loops its imports took 221 s; what it imports is
# the point here, and the priority is test_standby's.
_STANDBY = r"""
import json, sys, threading, time
from orchestrator.core import logs
from orchestrator.core.rundir import RunDir
from orchestrator.core.specload import load
from orchestrator.train import promotion, standby
from orchestrator.train.preemption import PreemptionNotice

def report(stream):
    from jax._src import xla_bridge
    with open("/proc/self/maps") as f:
        maps = f.read()
    print("STATE " + json.dumps({
        "imported": [m for m in ("jax", "keras", "tensorflow") if m in sys.modules],
        "keras_backend": sys.modules["keras"].backend.backend(),
        "backends_initialized": xla_bridge.backends_are_initialized(),
        "plugins_discovered": xla_bridge._plugins_registered,
        "libtpu_loaded": "libtpu" in maps}), flush=True)
    return None

promotion.wait_for_promotion = lambda stream: threading.Event().wait()  # no line comes
standby.Promotion.wait = lambda self: report(None)  # where it waits for the line
standby.lower_priority = lambda: 0
logs.configure()  # as the worker's main does: its [standby] lines on stdout
spec = load(sys.argv[1], run_dir=sys.argv[2], backend="jax")
sys.exit(standby.serve(spec, RunDir.for_spec(spec).make(), 2, "import_only",
                       PreemptionNotice(), time.time()))
"""


@pytest.mark.integration
def test_an_import_only_standby_on_jax_initialises_no_jax_backend(tmp_path):
    """libtpu is loaded, and its lock taken, when JAX initialises its backends: at the first
    device query, not at ``import jax``. The standby's whole warm-up up to its wait must leave
    JAX's backend registry empty (no platform initialised, no PJRT plugin even discovered)."""
    pytest.importorskip("jax")
    job = os.path.join(ROOT, "jobs", "digits", "job.yaml")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="")
    p = subprocess.run([sys.executable, "-c", _STANDBY, job, str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=240, env=env,
                       stdin=subprocess.DEVNULL)
    states = [ln[len("STATE "):] for ln in p.stdout.splitlines() if ln.startswith("STATE ")]
    assert p.returncode == 0 and states, p.stdout + p.stderr
    state = json.loads(states[0])
    assert state == {"imported": ["jax", "keras"], "keras_backend": "jax",
                     "backends_initialized": False, "plugins_discovered": False,
                     "libtpu_loaded": False}, p.stderr
    assert "[standby] ready (import_only)" in p.stdout and "[standby] discarded" in p.stdout


def _configure(monkeypatch, tmp_path, strategy: str, fallback: str | None = None) -> str | None:
    from orchestrator.train.backends.jax_backend import JaxBackend

    for name in ("JAX_PLATFORMS", "ORCHESTRATOR_STRATEGY", "XLA_FLAGS"):
        monkeypatch.setenv(name, "")  # restored after the test, whatever configure sets
        monkeypatch.delenv(name)
    if fallback:
        monkeypatch.setenv("ORCHESTRATOR_STRATEGY", fallback)
    spec = SimpleNamespace(strategy=strategy, deterministic=False, run_dir=str(tmp_path / "run"),
                           checkpoint=SimpleNamespace(local_dir=str(tmp_path / "l" / "ckpt")))
    JaxBackend().configure(spec, None, standby=False)
    return os.environ.get("JAX_PLATFORMS")


def test_a_jax_worker_on_a_tpu_vm_names_the_tpu_platform_so_a_held_tpu_fails_loudly(
        monkeypatch, tmp_path):
    """Unnamed, JAX's TPU backend fails quietly (xla_bridge registers it fail_quietly) and the
    worker would train on the CPU of a TPU VM whose chip another process holds."""
    dev = tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    monkeypatch.setattr(tpuvm, "DEVICE_GLOBS", (f"{dev}/accel*", f"{dev}/vfio/[0-9]*"))
    assert _configure(monkeypatch, tmp_path, "auto") is None  # no chip: JAX chooses
    (dev / "vfio" / "0").write_text("")
    assert _configure(monkeypatch, tmp_path, "auto") == "tpu,cpu"
    assert _configure(monkeypatch, tmp_path, "tpu") == "tpu,cpu"
    assert _configure(monkeypatch, tmp_path, "gpu") is None
    assert _configure(monkeypatch, tmp_path, "auto", fallback="cpu") == "cpu"  # recovery's


# /proc/locks as fs/locks.c writes it: id, [-> for a waiter], class, mode, access, pid,
# major:minor:inode (hex, hex, decimal), start, end
_PROC_LOCKS = """\
1: POSIX  ADVISORY  WRITE 4242 fe:00:{ino} 0 EOF
1: -> POSIX  ADVISORY  WRITE 4343 fe:00:{ino} 0 EOF
2: FLOCK  ADVISORY  WRITE 77 fe:00:999999999 0 EOF
3: OFDLCK ADVISORY  WRITE -1 00:2e:{ino2} 0 EOF
"""


def test_lock_holders_are_read_from_the_kernel_s_lock_table(tmp_path):
    lock, other = tmp_path / "libtpu_lockfile", tmp_path / "other"
    lock.write_text("")
    other.write_text("")
    table = tmp_path / "locks"
    table.write_text(_PROC_LOCKS.format(ino=os.stat(lock).st_ino, ino2=os.stat(other).st_ino))
    assert tpuvm.lock_holders(str(lock), str(table)) == [4242]  # not the waiter 4343
    assert tpuvm.lock_holders(str(other), str(table)) == [-1]   # an OFD lock: held, no pid
    assert tpuvm.lock_holders(str(tmp_path / "absent"), str(table)) == []
    assert tpuvm.lock_holders(str(lock), str(tmp_path / "no-procfs")) is None


def test_pci_chips_names_the_tpu_generation_from_sysfs(tmp_path):
    for slot, vendor, device in (("0000:00:04.0", "0x1ae0", "0x0063"),
                                 ("0000:00:05.0", "0x1ae0", "0x0001"),   # not a TPU
                                 ("0000:00:06.0", "0x10de", "0x0063")):  # another vendor
        (tmp_path / slot).mkdir()
        (tmp_path / slot / "vendor").write_text(vendor + "\n")
        (tmp_path / slot / "device").write_text(device + "\n")
    assert tpuvm.pci_chips(str(tmp_path)) == ["v5e"]


@contextlib.contextmanager
def held(script: str):
    """A process of ours that holds something (a lock, an open device file) until the block
    ends; then it is SIGKILLed, as a preempted worker is (our own child: no one else's)."""
    p = subprocess.Popen([sys.executable, "-c", script + "\nprint('held', flush=True)\n"
                          "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        yield p
    finally:
        p.kill()
        p.wait()


def lockf(path) -> str:
    # what libtpu does (tpu_initialize_util.cc: open, then lockf(fd, F_TLOCK, 0))
    return (f"import fcntl, os; fd = os.open({str(path)!r}, os.O_CREAT | os.O_RDWR, 0o600); "
            "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)")


@pytest.fixture
def tpu_vm(tmp_path):
    dev = tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    (dev / "vfio" / "0").write_text("")
    return SimpleNamespace(globs=(f"{dev}/vfio/[0-9]*",), chip=dev / "vfio" / "0",
                           lock=tmp_path / "libtpu_lockfile")


@pytest.mark.integration
def test_a_stale_lock_file_is_removed_only_when_no_process_holds_it(tpu_vm):
    clear = lambda: tpuvm.clear_stale_locks(tpu_vm.globs, [str(tpu_vm.lock)])  # noqa: E731
    assert clear() == ("no libtpu lock file", [])
    with held(lockf(tpu_vm.lock)) as holder:
        summary, records = clear()
        assert [r["action"] for r in records] == ["left"] and tpu_vm.lock.exists()
        assert f"held by pid {holder.pid} (" in summary and "python -c" in summary
    assert tpu_vm.lock.exists()  # the file outlives its holder; the kernel dropped the lock
    with held(f"f = open({str(tpu_vm.chip)!r})") as user:  # a chip still open somewhere
        summary, records = clear()
        assert [r["action"] for r in records] == ["left"] and tpu_vm.lock.exists()
        assert f"a TPU device is open in pid {user.pid}" in summary
    summary, records = tpuvm.clear_stale_locks(tpu_vm.globs, [str(tpu_vm.lock)],
                                               proc_locks="/nonexistent/locks")
    assert [r["action"] for r in records] == ["left"] and "cannot be read" in summary
    summary, records = clear()
    assert [r["action"] for r in records] == ["removed"] and not tpu_vm.lock.exists()
    assert "no process holds a lock on it" in summary


def test_a_lock_held_by_the_supervisor_itself_is_named_as_such(tpu_vm):
    """A notebook kernel that ran jax.devices() holds libtpu for its life; the supervisor may
    be that kernel. Its lock is left, and the detail says whose it is."""
    import fcntl

    fd = os.open(tpu_vm.lock, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        summary, records = tpuvm.clear_stale_locks(tpu_vm.globs, [str(tpu_vm.lock)])
        assert [r["action"] for r in records] == ["left"]
        assert f"pid {os.getpid()}, this very process" in summary
    finally:
        os.close(fd)


def _remedies(backend: str) -> Remedies:
    spec = SimpleNamespace(backend=backend, batch_size=32, strategy="auto")
    return Remedies(spec, dict, own_pgid=lambda: None, sleep=lambda s: None)


def test_reinit_on_jax_clears_a_stale_libtpu_lock_and_sets_no_tensorflow_reinit(
        tpu_vm, monkeypatch):
    monkeypatch.setattr(tpuvm, "DEVICE_GLOBS", tpu_vm.globs)
    monkeypatch.setattr(tpuvm, "lock_files", lambda: [str(tpu_vm.lock)])
    tpu_vm.lock.write_text("")
    decision = Decision(Action.REINIT_ACCELERATOR, "accelerator_context", "ladder rung 2")
    r = _remedies("jax")
    detail, fields = r.apply(decision, {})
    assert not tpu_vm.lock.exists()
    assert [(x["path"], x["action"]) for x in fields["libtpu_lock"]] == [
        (str(tpu_vm.lock), "removed")]
    assert detail.startswith("the next attempt is a fresh JAX process; libtpu lock: ")
    assert ENV_REINIT not in r.worker_env({}, consume=True)
    tf = _remedies("tensorflow")
    tpu_vm.lock.write_text("")
    detail, fields = tf.apply(decision, {})
    assert tpu_vm.lock.exists() and fields == {}  # TensorFlow: the worker reinitialises
    assert tf.worker_env({}, consume=True)[ENV_REINIT] == "1"

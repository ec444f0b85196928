"""A TPU VM seen from outside: its chips' device files and libtpu's one-process lock.

Colab's TPU runtimes are TPU VMs: the chips are devices of the VM itself, ``/dev/accel*``
(v2-v4) or ``/dev/vfio/N`` (v5e, v6e). libtpu admits one process: before it opens the chips it
takes a POSIX record lock (``lockf(fd, F_TLOCK)``) on ``/tmp/libtpu_lockfile`` (else, when
that cannot be opened, ``/tmp/libtpu_lock_<uid>/libtpu_lockfile``, then
``$HOME/.libtpu_lockfile``), holds it for the life of the process, and writes nothing in it.
A second process is refused with ``The TPU is already in use by process with pid N``; N is not
read from the lock but found by scanning ``/proc/*/fd`` for the device file, and when no such
process is found the refusal reads ``Internal error when accessing libtpu multi-process
lockfile`` (openxla/xla ``xla/stream_executor/tpu/tpu_initialize_util.cc``, the code behind
jax-ml/jax#22070 and #10192).

So who holds the TPU is a question the kernel answers without anyone touching the chip or the
lock: ``/proc/locks`` lists every POSIX lock with its holder's pid and the file's device and
inode, and ``/proc/*/fd`` shows who has a device file open. Nothing here opens the lock file:
a POSIX lock is dropped when *any* descriptor of that file is closed by its holder, and the
supervisor may be a notebook kernel that initialised JAX itself. Both processes use this
module: the supervisor's probe, doctor and the ``reinit_accelerator`` action on JAX (which
removes a lock file only when no process holds it), and the JAX worker (a TPU VM's TPU must
initialise, not be skipped for the CPU).
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")
LOCK_FILE = "/tmp/libtpu_lockfile"
PROC_LOCKS = "/proc/locks"
# "1: POSIX  ADVISORY  WRITE 1234 fe:00:2146495 0 EOF"; a waiter's line has "->" after the id
_LOCK_LINE = re.compile(r"^\d+:\s+(?P<waiter>->\s+)?\S+\s+\S+\s+\S+\s+(?P<pid>-?\d+)\s+"
                        r"(?P<major>[0-9a-f]+):(?P<minor>[0-9a-f]+):(?P<inode>\d+)\s")


# Google's PCI vendor id and the TPU chips' device ids (as jax/_src/hardware_utils.py reads
# them): sysfs names the chip generation without any driver or library.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027": "v3", "0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e",
                    "0x006f": "v6e", "0x0076": "tpu7x"}


def pci_chips(sysfs: str = "/sys/bus/pci/devices") -> list[str]:
    """The TPU generation of each chip on this VM's PCI bus (``["v5e"]`` on a v5e-1)."""
    chips = []
    for vendor in sorted(glob.glob(os.path.join(sysfs, "*", "vendor"))):
        try:
            with open(vendor, encoding="ascii") as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor), "device"), encoding="ascii") as f:
                device = f.read().strip()
        except OSError:
            continue
        if device in _TPU_PCI_DEVICES:
            chips.append(_TPU_PCI_DEVICES[device])
    return chips


def lock_files(uid: int | None = None, home: str | None = None) -> list[str]:
    """Where libtpu may have taken its lock, in the order it tries them."""
    uid = os.getuid() if uid is None else uid
    home = os.environ.get("HOME", "") if home is None else home
    paths = [LOCK_FILE, f"/tmp/libtpu_lock_{uid}/libtpu_lockfile"]
    return paths + ([os.path.join(home, ".libtpu_lockfile")] if home else [])


def device_files(globs=None) -> list[str]:
    """The TPU chips' device files on this machine (none: not a TPU VM)."""
    return sorted(p for g in (DEVICE_GLOBS if globs is None else globs) for p in glob.glob(g))


def lock_holders(path: str, proc_locks: str = PROC_LOCKS) -> list[int] | None:
    """Pids holding a POSIX lock on ``path`` now, from the kernel's ``/proc/locks``; None when
    that cannot be read (then nothing can be proven). A lock on a file of the same inode number
    on another device counts too: on an overlay filesystem the two may be told apart
    differently, and a lock wrongly counted only leaves a file in place."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []  # no file, no lock
    try:
        with open(proc_locks, encoding="ascii", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    pids = set()
    for line in lines:
        m = _LOCK_LINE.match(line)
        if m and not m.group("waiter") and int(m.group("inode")) == st.st_ino:
            pids.add(int(m.group("pid")))  # -1: an open-file-description lock (no pid)
    return sorted(pids)


def openers(path: str, proc: str = "/proc") -> list[int]:
    """Pids that have ``path`` open (from ``/proc/*/fd``; the processes we may inspect: as root,
    all of them). What libtpu itself reports as the TPU's user, for the device file."""
    target = os.path.realpath(path)
    pids = []
    for fd_dir in glob.glob(os.path.join(proc, "[0-9]*", "fd")):
        try:
            links = os.listdir(fd_dir)
        except OSError:
            continue  # gone, or another user's
        for fd in links:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) == target:
                    pids.append(int(os.path.basename(os.path.dirname(fd_dir))))
                    break
            except OSError:
                continue  # closed meanwhile
    return sorted(pids)


def command(pid: int, proc: str = "/proc") -> str:
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "command unknown"


@dataclass
class TpuUse:
    """Who holds the TPU now: the lock's holders and the device files' users, by pid."""

    devices: list[str]
    locks: dict[str, list[int] | None] = field(default_factory=dict)  # None: unreadable
    device_users: list[int] = field(default_factory=list)

    def holders(self) -> list[int]:
        pids = {p for held in self.locks.values() if held for p in held}
        return sorted(pids | set(self.device_users))

    def describe(self, pid: int) -> str:
        if pid == os.getpid():  # a notebook kernel that ran jax.devices() holds it for life
            return (f"pid {pid}, this very process ({command(pid)}): it initialised the TPU "
                    f"itself; restart the runtime and let only the worker touch it")
        return f"pid {pid} ({command(pid)})"


def tpu_use(globs=None, locks: list[str] | None = None, proc_locks: str | None = None
            ) -> TpuUse:
    """The lock files that exist, with their holders, and the processes using a chip."""
    devices = device_files(globs)
    use = TpuUse(devices)
    for path in lock_files() if locks is None else locks:
        if os.path.lexists(path):
            use.locks[path] = lock_holders(path, proc_locks or PROC_LOCKS)
    use.device_users = sorted({p for d in devices for p in openers(d)})
    return use


def clear_stale_locks(globs=None, locks: list[str] | None = None,
                      proc_locks: str | None = None) -> tuple[str, list[dict]]:
    """Remove each libtpu lock file that no process holds, leave every other one; returns a
    one-line summary and a record per file (path, ``removed`` or ``left``, why).

    Proven free means: ``/proc/locks`` could be read and lists no lock on the file, and no
    process has a TPU device file open. A lock held by a live process is that process's TPU,
    ours or not, and nothing here signals anyone; a lock nobody holds is harmless to libtpu's
    ``lockf`` but not always to its ``open`` (another user's file, a symlink: the refusals
    that end "run rm /tmp/libtpu_lockfile")."""
    proc_locks = proc_locks or PROC_LOCKS
    use = tpu_use(globs, locks, proc_locks)
    records = []
    busy = [use.describe(p) for p in use.device_users]
    for path, held in use.locks.items():
        if held is None:
            records.append({"path": path, "action": "left",
                            "why": f"{proc_locks} cannot be read: no holder can be ruled out"})
        elif held:
            records.append({"path": path, "action": "left", "why": "held by " + ", ".join(
                use.describe(p) if p > 0 else "an open-file-description lock" for p in held)})
        elif busy:
            records.append({"path": path, "action": "left",
                            "why": "no lock on it, but a TPU device is open in " + ", ".join(busy)})
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                records.append({"path": path, "action": "left", "why": "gone meanwhile"})
                continue
            except OSError as exc:
                records.append({"path": path, "action": "left", "why": f"not removed: {exc}"})
                continue
            records.append({"path": path, "action": "removed",
                            "why": f"no process holds a lock on it ({proc_locks}) and none has "
                                   f"a TPU device open"})
    if not records:
        summary = "no libtpu lock file" + (f"; TPU device open in {', '.join(busy)}" if busy
                                           else "")
    else:
        summary = "; ".join(f"{r['path']} {r['action']}: {r['why']}" for r in records)
    return summary, records


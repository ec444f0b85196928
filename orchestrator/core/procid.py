"""Which process a pid names: the rule for signalling a process we did not just spawn.

A pid alone names a process only while that process lives. Pids are reused: a fresh VM's
count starts low again, a restarted notebook kernel gets new ones, and a supervisor restarted
after its machine died reads pids from its journal that may by then belong to anyone - with
root on Colab, a ``killpg`` on such a pid kills a stranger's whole process group. So every
pid we may act on later is recorded with its identity at spawn, and a pid is signalled (or
believed to be a live owner) only while the process there still has that identity:

- the same boot (``/proc/sys/kernel/random/boot_id``): pid numbers start over at each boot,
  and a host name alone does not say which boot (or even which machine: recycled VMs may
  share one);
- the same start time (``/proc/<pid>/stat`` field 22, clock ticks since boot): two processes
  that held one pid in one boot started at different ticks;
- the same command line (``/proc/<pid>/cmdline``): a second proof, read as the kernel keeps it.

Where ``/proc`` is not there (not Linux), nothing can be proven, so nothing is signalled: a
worker left running costs a restart's worth of resources, a stranger killed costs someone
else's work. One vocabulary for every caller (orphan workers and standbys, the run lock's
owner, an accelerator lock's holder), so the rule is written once.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    """This boot's id, or None where the kernel does not say (not Linux)."""
    try:
        with open(BOOT_ID, encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int]:
    """(state, start time in clock ticks since boot) of ``pid``. The command name (field 2)
    is in parentheses and may itself hold spaces and parentheses: fields are counted after the
    last ``)``, where field 3 (the state) begins."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        raw = f.read()
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[22 - 3])


def is_running(pid: int) -> bool:
    """Something runs at ``pid`` (a zombie, dead and not yet reaped, does not count)."""
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def _cmdline(pid: int) -> tuple[str, ...]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        raw = f.read()
    return tuple(os.fsdecode(a) for a in raw.split(b"\0")[:-1])


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as it was when we started it: what a pid must still show to be that one."""

    pid: int
    start_ticks: int
    boot_id: str
    cmdline: tuple[str, ...]

    @classmethod
    def of(cls, pid: int, settle_s: float = 0.0) -> "ProcessIdentity | None":
        """The identity of the live process ``pid`` now; None when there is none (gone) or it
        cannot be read (no ``/proc``).

        ``settle_s``: for a process spawned just now. ``subprocess.Popen`` returns once the
        child has exec'ed, but the kernel lets the parent go on before the new program's
        arguments are in place: its command line reads empty for a moment (seen here once in
        three spawns of ``sleep``). Read again until it shows, for at most ``settle_s``."""
        boot = boot_id()
        if boot is None:
            return None
        deadline = time.monotonic() + settle_s
        while True:
            try:
                state, start = _stat(pid)
                cmdline = _cmdline(pid)
            except (OSError, ValueError, IndexError):
                return None
            if cmdline or state == "Z" or time.monotonic() >= deadline:
                return cls(pid, start, boot, cmdline)
            time.sleep(0.001)

    @classmethod
    def from_record(cls, pid: int | None, record: dict | None) -> "ProcessIdentity | None":
        """The identity journaled (or written in a lock) with ``pid``; None when none was
        recorded (a journal written before identities were) or the record is unreadable."""
        if not pid or not isinstance(record, dict):
            return None
        try:
            return cls(int(pid), int(record["start_ticks"]), str(record["boot_id"]),
                       tuple(str(a) for a in record["cmdline"]))
        except (KeyError, TypeError, ValueError):
            return None

    def record(self) -> dict:
        """What is journaled beside the pid (JSON)."""
        return {"start_ticks": self.start_ticks, "boot_id": self.boot_id,
                "cmdline": list(self.cmdline)}

    def differs(self) -> str | None:
        """Why the process at ``pid`` now is not this one (it may be gone, or a stranger that
        holds the pid); None when it is the very process that was recorded."""
        boot = boot_id()
        if boot is None:
            return "this system has no /proc to prove which process a pid is"
        if boot != self.boot_id:
            return (f"it was started in another boot (boot id {self.boot_id[:8]}, this one is "
                    f"{boot[:8]}), or on another machine of the same name")
        try:
            state, start = _stat(self.pid)
            cmdline = _cmdline(self.pid)
        except FileNotFoundError:
            return f"pid {self.pid} is not running"
        except (OSError, ValueError, IndexError) as exc:
            return f"pid {self.pid} cannot be read ({exc})"
        if start != self.start_ticks:
            return (f"pid {self.pid} is another process now: started at tick {start}, not "
                    f"{self.start_ticks} ({' '.join(cmdline)[:120] or 'no command line'})")
        if state == "Z":
            return f"pid {self.pid} has exited (a zombie not yet reaped)"
        if cmdline != self.cmdline:
            return (f"pid {self.pid} runs another command line: {' '.join(cmdline)[:120]!r}, "
                    f"not {' '.join(self.cmdline)[:120]!r}")
        return None

    def matches(self) -> bool:
        return self.differs() is None


def signal_proven(identity: ProcessIdentity | None, sig: int, group: bool = True) -> str | None:
    """Send ``sig`` to the process ``identity`` names (its whole process group, which it leads:
    our workers are spawned in a session of their own) only while the pid is still that
    process. Returns None when it was signalled, else why it was left alone. The check and the
    signal are microseconds apart; the reuse this guards against takes a process's death and
    the pid space wrapping around in between."""
    if identity is None:
        return "no identity was recorded when it was started (a journal of an older version)"
    why = identity.differs()
    if why is not None:
        return why
    try:
        (os.killpg if group else os.kill)(identity.pid, sig)
    except ProcessLookupError:
        return f"pid {identity.pid} exited just now"
    except PermissionError as exc:
        return f"not permitted to signal pid {identity.pid} ({exc})"
    return None

"""Was a SIGKILLed worker killed by the kernel's OOM killer, or from outside?

A SIGKILL looks the same either way from the exit status, and the two call for opposite
remedies: a preemption is restarted as it is (its own budget, no crash loop), an out-of-memory
kill comes back at the same step unless the batch shrinks. So on a SIGKILL the supervisor reads
what the kernel leaves behind, most specific first:

- the OOM-kill counters of the worker's memory cgroup and of its parents, taken before the
  attempt and after it: cgroup v2 ``memory.events`` (``oom_kill N``), cgroup v1
  ``memory.oom_control`` (``oom_kill N``, kernels >= 4.13);
- the kernel log, where this process may read it (``/dev/kmsg``): a ``Killed process PID`` or
  ``oom-kill:... pid=PID`` line for the worker's pid;
- the worker's last resident size (it writes it in its heartbeat) against the cgroup's limit.

No evidence means a kill from outside, which keeps the kind ``killed`` with the meaning
"preemption" (policy.is_preemption). All paths are parameters, so the reading is tested on
fixture files; a real OOM kill is caused in the tests where this machine lets a cgroup be made.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from orchestrator.core import osutil

CGROUP_ROOT = "/sys/fs/cgroup"
KMSG = "/dev/kmsg"
#: a last RSS within this fraction of the memory limit counts as evidence on its own
NEAR_LIMIT = 0.95


@dataclass(frozen=True)
class Snapshot:
    """OOM-kill counters by file, and memory limits by cgroup directory."""

    counters: dict
    limits: dict


def memory_cgroups(pid: int | str = "self", proc: str = "/proc",
                   root: str = CGROUP_ROOT) -> list[str]:
    """The memory cgroup directories of ``pid`` and of their parents up to the root, the
    innermost first (v2 unified and v1 ``memory`` hierarchies alike)."""
    try:
        with open(os.path.join(proc, str(pid), "cgroup"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base = root if os.path.exists(os.path.join(root, "cgroup.controllers")) else \
                os.path.join(root, "unified")
        elif "memory" in controllers.split(","):
            base = os.path.join(root, "memory")
        else:
            continue
        rel = path.strip("/")
        while True:
            d = os.path.join(base, rel) if rel else base
            if os.path.isdir(d) and d not in dirs:
                dirs.append(d)
            if not rel:
                break
            rel = os.path.dirname(rel)
    return dirs


def _oom_kills(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def _limit(d: str) -> int | None:
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            with open(os.path.join(d, name), encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "no limit" with a huge number
            return int(text)
    return None


def _usage(d: str) -> int | None:
    for name in ("memory.current", "memory.usage_in_bytes"):
        try:
            with open(os.path.join(d, name), encoding="utf-8") as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


def headroom(meminfo: str = "/proc/meminfo", pid: int | str = "self",
             proc: str = "/proc", root: str = CGROUP_ROOT) -> int | None:
    """Bytes this process's cgroups and the machine could still give another process: the
    least of ``MemAvailable`` and, per memory cgroup with a limit, its limit less its usage
    (a container's or a notebook runtime's cap); None when none of them can be read."""
    found = []
    try:
        found.append(osutil.meminfo(meminfo)["MemAvailable"])
    except (OSError, KeyError, ValueError):
        pass  # no procfs: the cgroups' figures alone
    for d in memory_cgroups(pid, proc, root):
        lim, used = _limit(d), _usage(d)
        if lim is not None and used is not None:
            found.append(max(0, lim - used))
    return min(found) if found else None


def snapshot(dirs: list[str]) -> Snapshot:
    counters, limits = {}, {}
    for d in dirs:
        for name in ("memory.events", "memory.oom_control"):
            n = _oom_kills(os.path.join(d, name))
            if n is not None:
                counters[os.path.join(d, name)] = n
        lim = _limit(d)
        if lim is not None:
            limits[d] = lim
    return Snapshot(counters, limits)


def kernel_log_line(pid: int, kmsg: str = KMSG) -> str | None:
    """The kernel's OOM line for ``pid``, if the kernel log is readable here."""
    pat = re.compile(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)")
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    try:
        while True:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break  # read to the end
            except OSError:
                continue  # EPIPE: records overwritten while reading; go on
            if not rec:
                break
            for line in rec.decode("utf-8", "replace").splitlines():
                if pat.search(line):  # /dev/kmsg: "6,1234,5678,-;Killed process 42 (python)"
                    found = line.split(";", 1)[-1].strip()
    finally:
        os.close(fd)
    return found


def evidence(before: Snapshot, after: Snapshot, pid: int | None = None,
             last_rss: int | None = None, kmsg: str = KMSG) -> str | None:
    """Why this SIGKILL was the OOM killer's, or None (then it came from outside)."""
    for path, n in after.counters.items():
        was = before.counters.get(path)
        if was is not None and n > was:
            return f"{path}: oom_kill {was} -> {n}"
    if pid is not None:
        line = kernel_log_line(pid, kmsg)
        if line:
            return f"kernel log: {line}"
    if last_rss:
        for d, lim in after.limits.items():
            if last_rss >= NEAR_LIMIT * lim:
                return (f"last resident size {last_rss >> 20} MiB at the memory limit "
                        f"{lim >> 20} MiB of {d}")
    return None

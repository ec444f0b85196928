"""Processes for the bench: launch one, watch it with a callback, read its footprint from /proc.

Linux only (``/proc``). Every command is an argument list; nothing goes through a shell.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

POLL_S = 0.1
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Footprint:
    """The last /proc reading of a process: peak RSS (VmHWM) and CPU seconds (user + system)."""

    peak_rss_mb: float | None = None
    cpu_s: float | None = None

    def sample(self, pid: int) -> None:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self.peak_rss_mb = round(int(line.split()[1]) / 1024, 1)
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            self.cpu_s = round((int(fields[11]) + int(fields[12])) / CLK_TCK, 2)
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            return  # gone between two polls: keep the last reading


@dataclass
class Finished:
    rc: int
    launched: float
    wall_s: float
    footprint: Footprint
    timed_out: bool = False
    extra: dict = field(default_factory=dict)


def children(pid: int) -> list[int]:
    """Live direct children of ``pid`` (scans /proc: no /proc/PID/task/*/children here)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(rest[1]) == pid and rest[0] != "Z":
            out.append(int(name))
    return sorted(out)


def command_name(pid: int) -> str:
    """The process's name (``/proc/PID/comm``), or '' once it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def kill(pid: int, group: bool) -> float | None:
    """SIGKILL ``pid`` (its whole process group if ``group``); the time it was sent, or None."""
    t = time.time()
    try:
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return t


def run(cmd: list[str], log_path: str, *, cwd: str | None = None, env: dict | None = None,
        timeout: float = 900.0, on_poll: Callable[[float, int], None] | None = None) -> Finished:
    """Run ``cmd`` to its end, calling ``on_poll(now, pid)`` every POLL_S; SIGKILL at timeout."""
    with open(log_path, "ab") as log:
        launched = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env=env, start_new_session=True)
    ended: list[float] = []  # the exit time, taken by a thread blocked in wait(): exact
    waiter = threading.Thread(target=lambda: (proc.wait(), ended.append(time.time())), daemon=True)
    waiter.start()
    fp = Footprint()
    timed_out = False
    while not ended:
        now = time.time()
        fp.sample(proc.pid)
        if on_poll is not None:
            on_poll(now, proc.pid)
        if now - launched > timeout and not timed_out:
            timed_out = True
            kill(proc.pid, group=True)
        waiter.join(POLL_S)
    return Finished(proc.returncode, launched, round(ended[0] - launched, 3), fp, timed_out)

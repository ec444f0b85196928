"""What ``doctor``'s checks are made of: a verdict per check, and the probe process that
imports a framework so that the doctor's own process never does (on a TPU VM, importing and
initialising one would take the chip from a run)."""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

OK, WARN, FAIL = "ok", "warn", "fail"
PROBE_TIMEOUT_S = 300


@dataclass
class Check:
    name: str
    level: str
    detail: str


def run_probe(cmd: list[str], tag: str, what: str, timeout: float = PROBE_TIMEOUT_S,
              env=None) -> dict:
    """Run a probe script that prints one line ``tag + JSON``; that JSON, or ``{"error": ...}``
    naming ``what`` took too long, or how the probe exited and its last line on stderr."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"{what} took longer than {timeout:g} s"}
    for line in p.stdout.splitlines():
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"the probe exited {p.returncode}: {tail}"}

"""Reinstall TensorFlow: the remedy people apply by hand for a broken TPU context.

Reinstalls the exact distribution and version that is installed (tensorflow-tpu, tensorflow or
tensorflow-cpu, first found wins: on a TPU runtime the TPU build must win over a plain
``tensorflow`` pip-installed on top of it), with ``pip install --force-reinstall --no-deps`` as
an argument list, then verifies it by importing it in a fresh process. Everything runs in child
processes with the worker's environment, so it sees what the worker sees and this process never
imports TensorFlow. The pip command is configurable (a local index, a target directory).
"""
from __future__ import annotations

import json
import subprocess
import sys

from orchestrator.core.spec import RecoverySpec

_FIND = """
import importlib.metadata as m, json, sys
for name in sys.argv[1:]:
    try:
        print(json.dumps([name, m.version(name)])); break
    except m.PackageNotFoundError:
        continue
else:
    print("null")
"""
_VERIFY = """
import importlib, importlib.metadata as m, sys
mod = importlib.import_module(sys.argv[1])
print(m.version(sys.argv[2]), getattr(mod, "__version__", ""), getattr(mod, "__file__", ""))
"""


def installed(candidates, env, python: str = sys.executable) -> tuple[str, str] | None:
    p = subprocess.run([python, "-c", _FIND, *candidates], capture_output=True, text=True,
                       env=env, timeout=120)
    found = json.loads(p.stdout.strip() or "null") if p.returncode == 0 else None
    return tuple(found) if found else None


def pip_command(cfg: RecoverySpec, dist: str, version: str) -> list[str]:
    prefix = list(cfg.pip) or [sys.executable, "-m", "pip"]
    return [*prefix, "install", "--force-reinstall", "--no-deps", "--disable-pip-version-check",
            *cfg.pip_args, f"{dist}=={version}"]


def reinstall_tensorflow(cfg: RecoverySpec, env, timeout: float = 1800) -> dict:
    """Reinstall and verify; returns what happened (``ok``, the command, pip's tail, verify)."""
    found = installed(cfg.tensorflow_distributions, env)
    if found is None:
        return {"ok": False, "detail": f"none of {', '.join(cfg.tensorflow_distributions)} "
                                       f"is installed for {sys.executable}"}
    dist, version = found
    cmd = pip_command(cfg, dist, version)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"ok": False, "distribution": dist, "version": version, "command": cmd,
                "detail": f"pip did not run: {exc}"}
    tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
    result = {"distribution": dist, "version": version, "command": cmd,
              "pip_exit": p.returncode, "pip_tail": tail}
    if p.returncode != 0:
        return dict(result, ok=False, detail=f"pip exit {p.returncode}")
    v = subprocess.run([sys.executable, "-c", _VERIFY, cfg.verify_import, dist],
                       capture_output=True, text=True, env=env, timeout=600)
    verified = v.returncode == 0 and v.stdout.split()[:1] == [version]
    why = v.stdout.strip() if verified else (v.stderr.strip().splitlines() or ["no output"])[-1]
    return dict(result, ok=verified, verify=why,
                detail=f"reinstalled {dist}=={version}; "
                       f"{'verified' if verified else 'verification failed'}: {why}")

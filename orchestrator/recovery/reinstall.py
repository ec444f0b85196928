"""Reinstall the framework the run trains on: the remedy people apply by hand for a broken install.

What is reinstalled depends on the run's Keras backend (``reinstall_plan``), because a broken
install is a different set of distributions on each:

- TensorFlow: the one installed distribution of ``recovery.tensorflow_distributions``
  (tensorflow-tpu, tensorflow or tensorflow-cpu, first found wins: on a TPU runtime the TPU
  build must win over a plain ``tensorflow`` pip-installed on top of it);
- JAX: every installed one of jax, jaxlib, libtpu and the jax CUDA plugin packages
  (core/backends.py ``DISTRIBUTIONS``), in one pip command, because they only work at matching
  versions: a lone jaxlib reinstalled next to a newer jax is exactly the mismatch being cured.
  Never TensorFlow: Colab's TPU VMs have none, and pip-installing it there breaks the image.

Each is pinned to the version installed now, read from the distribution metadata
(importlib.metadata) in a child process with the worker's environment, so that it sees what
the worker sees and this process never imports TensorFlow or JAX. ``pip install
--force-reinstall --no-deps`` runs as an argument list (the pip command is configurable: a local
index, a target directory), then a fresh process imports the framework and checks its version
(importing jax initialises no device, so it does not take the TPU from anyone). The action keeps
its journal name, ``reinstall_tensorflow``, on both backends: job files and journals name it.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from orchestrator.core import backends
from orchestrator.core.spec import RecoverySpec

_FIND = """
import importlib.metadata as m, json, sys
found = []
for name in sys.argv[1:]:
    try:
        found.append([name, m.version(name)])
    except m.PackageNotFoundError:
        continue
print(json.dumps(found))
"""
_VERIFY = """
import importlib, importlib.metadata as m, sys
mod = importlib.import_module(sys.argv[1])
print(m.version(sys.argv[2]), getattr(mod, "__version__", ""), getattr(mod, "__file__", ""))
"""


@dataclass(frozen=True)
class Plan:
    """What the reinstall looks for on one backend, and how it checks the result."""

    backend: str
    candidates: tuple        # distribution names, in order of preference
    every: bool              # reinstall every installed candidate (JAX) or the first found (TF)
    verify_import: str       # the module a fresh process imports afterwards
    verify_distribution: str | None = None  # whose version it must report; None: the first pin


def reinstall_plan(backend: str = backends.TENSORFLOW, cfg: RecoverySpec = RecoverySpec()) -> Plan:
    """The plan for ``backend`` (``tensorflow`` or ``jax``, as resolved for the run)."""
    if backend == backends.JAX:
        return Plan(backend, backends.DISTRIBUTIONS[backends.JAX], True,
                    backends.MODULES[backends.JAX], "jax")
    if backend == backends.TENSORFLOW:
        return Plan(backend, tuple(cfg.tensorflow_distributions), False, cfg.verify_import)
    raise ValueError(f"no reinstall plan for backend {backend!r}: expected "
                     f"{backends.TENSORFLOW} or {backends.JAX}")


def installed_all(candidates, env, python: str = sys.executable) -> list[tuple[str, str]]:
    """(distribution, version) of each of ``candidates`` installed for ``python``, in order."""
    p = subprocess.run([python, "-c", _FIND, *candidates], capture_output=True, text=True,
                       env=env, timeout=120)
    return [tuple(f) for f in json.loads(p.stdout.strip() or "[]")] if p.returncode == 0 else []


def installed(candidates, env, python: str = sys.executable) -> tuple[str, str] | None:
    """The first of ``candidates`` that is installed, with its version."""
    found = installed_all(candidates, env, python)
    return found[0] if found else None


def pip_command(cfg: RecoverySpec, pins) -> list[str]:
    """One ``pip install`` of every (distribution, version) in ``pins``, at those versions."""
    prefix = list(cfg.pip) or [sys.executable, "-m", "pip"]
    return [*prefix, "install", "--force-reinstall", "--no-deps", "--disable-pip-version-check",
            *cfg.pip_args, *(f"{dist}=={version}" for dist, version in pins)]


def reinstall(cfg: RecoverySpec, env, backend: str = backends.TENSORFLOW,
              timeout: float = 1800) -> dict:
    """Reinstall and verify; returns what happened (``ok``, the pins, the command, pip's tail,
    verify). ``backend``: the run's (JobSpec.backend, resolved here if it is still ``auto``)."""
    backend = backends.resolve(backend, env)[0]
    plan = reinstall_plan(backend, cfg)
    found = installed_all(plan.candidates, env)
    pins = found if plan.every else found[:1]
    if not pins:
        return {"ok": False, "backend": backend,
                "detail": f"none of {', '.join(plan.candidates)} is installed for {sys.executable}"}
    verify_dist = plan.verify_distribution or pins[0][0]
    version = dict(pins).get(verify_dist)
    cmd = pip_command(cfg, pins)
    result = {"backend": backend, "pins": [list(p) for p in pins], "distribution": pins[0][0],
              "version": pins[0][1], "command": cmd}
    if version is None:
        return dict(result, ok=False, detail=f"{verify_dist} is not installed: nothing imports "
                                             f"{plan.verify_import} to verify a reinstall")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return dict(result, ok=False, detail=f"pip did not run: {exc}")
    tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
    result.update(pip_exit=p.returncode, pip_tail=tail)
    if p.returncode != 0:
        return dict(result, ok=False, detail=f"pip exit {p.returncode}")
    v = subprocess.run([sys.executable, "-c", _VERIFY, plan.verify_import, verify_dist],
                       capture_output=True, text=True, env=env, timeout=600)
    verified = v.returncode == 0 and v.stdout.split()[:1] == [version]
    why = v.stdout.strip() if verified else (v.stderr.strip().splitlines() or ["no output"])[-1]
    pinned = " ".join(f"{d}=={ver}" for d, ver in pins)
    return dict(result, ok=verified, verify=why,
                detail=f"reinstalled {pinned}; "
                       f"{'verified' if verified else 'verification failed'}: {why}")

"""``doctor`` on JAX: the versions that must fit together, Keras 3, and the devices JAX sees.

Nothing here imports JAX: a probe process does (``jax_probe``), with the ``JAX_PLATFORMS`` the
worker would set (core/backends.py ``jax_platforms``) and no preallocation of 75 % of a GPU
that a running worker may be using. On a TPU VM whose chip another process holds, the probe
lists no devices (initialising libtpu there fails, or takes the chip from a run): it reads the
versions only. What it checks:

- **jax and jaxlib**: JAX refuses to import a jaxlib outside the range jax declares
  (``Requires-Dist: jaxlib<=0.10.2,>=0.10.1`` for jax 0.10.2: "jaxlib version 0.4.31 is newer
  than and incompatible with jax version 0.4.20", octo-models/octo#125): FAIL. Another release
  inside that range imports, but JAX's accelerator builds (``jax[tpu]``, ``jax[cuda12]``) are
  one release of both: WARN. A CUDA plugin of another release than jaxlib is not used at all
  ("JAX plugin jax_cuda12_plugin version 0.7.2 is installed, but it is not compatible with the
  installed jaxlib version 0.7.1, so it will not be used.", jaxlib/plugin_support.py): FAIL.
  The fix is pinned to the installed jax, so that pip never replaces a runtime's own jax.
- **Keras 3**: Keras 2 has no JAX backend.
- **Devices**: the default backend and its devices by platform; a job whose ``strategy`` asks
  for a TPU or GPU that JAX does not see fails here, with what JAX said when it fell back.
"""
from __future__ import annotations

import collections
import importlib.metadata
import os
import re
import sys

from orchestrator.core import backends
from orchestrator.ops.checks import FAIL, OK, PROBE_TIMEOUT_S, WARN, Check, run_probe
from orchestrator.recovery import probes

# What the probe reports the versions of: JAX's own distributions (jax, jaxlib, libtpu, the
# CUDA plugins) and Keras.
DISTRIBUTIONS = backends.DISTRIBUTIONS[backends.JAX] + ("keras",)
CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")
_PROBE_TAG = "DOCTOR-JAX-PROBE "
# argv: "devices" or "versions", then the distributions. Versions come from the metadata (a
# jaxlib that JAX refuses to import still has one); warnings JAX gives when it falls back to
# the CPU (its logger) or drops a plugin (RuntimeWarning) are kept, first lines only.
_PROBE = r"""
import importlib.metadata as md, json, logging, sys, warnings
out = {"versions": {}, "notes": []}
for name in sys.argv[2:]:
    try:
        out["versions"][name] = md.version(name)
    except md.PackageNotFoundError:
        pass
try:
    out["jaxlib_requires"] = [r for r in md.requires("jax") or []
                              if r.startswith("jaxlib") and ";" not in r]
except md.PackageNotFoundError:
    pass

class Notes(logging.Handler):
    def emit(self, record):
        out["notes"].append(record.getMessage().strip().splitlines()[0])

logging.getLogger("jax").addHandler(Notes(logging.WARNING))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", RuntimeWarning)
    try:
        import jax
    except Exception as exc:
        out["import_error"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    else:
        if sys.argv[1] == "devices":
            try:
                devices = jax.devices()
                out["platform"] = jax.default_backend()
                out["devices"] = [{"platform": d.platform, "kind": d.device_kind,
                                   "repr": repr(d)} for d in devices]
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
out["notes"] += [str(w.message).strip().splitlines()[0] for w in caught
                 if issubclass(w.category, RuntimeWarning)]
print(%r + json.dumps(out), flush=True)
""" % _PROBE_TAG


def probe_env(strategy: str, found: probes.ProbeResult, base=None) -> dict:
    """The probe's environment: the worker's ``JAX_PLATFORMS`` for ``strategy`` here, and no
    preallocation (a worker may be training on the GPU)."""
    env = dict(os.environ if base is None else base)
    platforms = backends.jax_platforms(strategy, found.accelerator == "tpu_vm", env)
    if platforms is not None:
        env["JAX_PLATFORMS"] = platforms
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def lists_devices(found: probes.ProbeResult) -> bool:
    """Whether the probe may initialise JAX's backends: not on a TPU VM whose chip another
    process holds (libtpu admits one process)."""
    return not (found.accelerator == "tpu_vm" and found.state == probes.BUSY)


def jax_probe(strategy: str, found: probes.ProbeResult, python: str = sys.executable,
              env=None, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """Import JAX in a fresh process: versions, jax's jaxlib requirement, and (where it may)
    the default backend and its devices; or the error."""
    mode = "devices" if lists_devices(found) else "versions"
    return run_probe([python, "-c", _PROBE, mode, *DISTRIBUTIONS], _PROBE_TAG,
                     "importing JAX", timeout, probe_env(strategy, found, env))


def jaxlib_requires() -> list[str]:
    """jax's own requirement on jaxlib, from this Python's metadata (``--no-probe``)."""
    try:
        return [r for r in importlib.metadata.requires("jax") or []
                if r.startswith("jaxlib") and ";" not in r]
    except importlib.metadata.PackageNotFoundError:
        return []


def probed_versions(probe: dict | None, dists: dict) -> tuple[dict, list[str]]:
    """The versions to judge and jax's requirement on jaxlib: the probe's (those of the Python
    that runs the worker), else, with no probe or one that died, this Python's ``dists``."""
    if probe and "versions" in probe:
        return probe["versions"], probe.get("jaxlib_requires", [])
    return dists, jaxlib_requires()


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version, as JAX compares them (0.4.38.dev2026 -> (0, 4, 38))."""
    m = re.match(r"[0-9]+(?:\.[0-9]+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def satisfies(version: str, requirement: str) -> bool | None:
    """``version`` against one requirement's specifiers (``jaxlib<=0.10.2,>=0.10.1``); None
    when there are none to read."""
    specs = re.findall(r"(<=|>=|==|<|>)\s*([0-9][\w.]*)", requirement)
    if not specs:
        return None
    v = _release(version)
    ops = {"<=": v.__le__, ">=": v.__ge__, "==": v.__eq__, "<": v.__lt__, ">": v.__gt__}
    return all(ops[op](_release(bound)) for op, bound in specs)


def jax_extra(versions: dict, found: probes.ProbeResult) -> str | None:
    """The extra of jax that fits this machine: ``tpu`` on a TPU VM, the CUDA of the plugin
    installed (or cuda12, Colab's) where there is a GPU, none on a CPU."""
    if found.accelerator == "tpu_vm":
        return "tpu"
    plugin = next((p for p in CUDA_PLUGINS if p in versions), None)
    if plugin:
        return plugin.split("-")[1]
    return "cuda12" if found.accelerator == "gpu" else None


def jax_install(versions: dict, extra: str | None = None) -> str:
    """The line that makes JAX's distributions one release again (or adds what an extra
    brings: libtpu for ``tpu``): pinned to the installed jax, so pip adds or replaces what
    is around it and never replaces the runtime's own jax."""
    jax = versions.get("jax")
    if extra:
        return f"pip install 'jax[{extra}]" + (f"=={jax}'" if jax else "'")
    if jax:
        return f"pip install 'jax=={jax}' 'jaxlib=={jax}'"
    return "pip install 'orchestrator[jax]'"


def check_versions(versions: dict, requires: list[str], found: probes.ProbeResult,
                   python: str = sys.executable) -> list[Check]:
    """jax and jaxlib (and the CUDA plugins) of one release, and Keras 3."""
    jax, jaxlib = versions.get("jax"), versions.get("jaxlib")
    fix = jax_install(versions, jax_extra(versions, found))
    if not jax:
        out = [Check("jax", FAIL, f"JAX is not installed for {python}: pip install "
                     "'orchestrator[jax]' (Colab's TPU and GPU runtimes ship JAX: pip install "
                     "orchestrator there, which never replaces it)")]
    elif not jaxlib:
        out = [Check("jax", FAIL, f"jax {jax} without jaxlib: JAX does not import; {fix}")]
    else:
        both = f"jax {jax}, jaxlib {jaxlib}"
        rule = next((r for r in requires if satisfies(jaxlib, r) is not None), None)
        if _release(jax) == _release(jaxlib):
            out = [Check("jax", OK, both)]
        elif rule and satisfies(jaxlib, rule):
            out = [Check("jax", WARN, f"{both}: jax {jax} accepts it ({rule}), but JAX's TPU "
                         f"and GPU builds are one release of both; {fix}")]
        elif rule:
            out = [Check("jax", FAIL, f"{both}: jax {jax} requires {rule}, JAX refuses to "
                         f"import them together; {fix}")]
        else:
            out = [Check("jax", FAIL, f"{both}: not one release (and jax declares no range "
                         f"of jaxlib); {fix}")]
        for plugin in (p for p in CUDA_PLUGINS if p in versions):
            if _release(versions[plugin]) != _release(jaxlib):
                out.append(Check("jax plugin", FAIL, f"{plugin} {versions[plugin]} beside "
                                 f"jaxlib {jaxlib}: JAX does not use a plugin of another "
                                 f"release (no GPU); {fix}"))
    keras = versions.get("keras")
    if not keras:
        out.append(Check("keras", FAIL, f"Keras is not installed for {python}: pip install "
                         "'orchestrator[jax]' (Keras 3 on JAX)"))
    elif _release(keras)[:1] < (3,):
        out.append(Check("keras", FAIL, f"keras {keras} is Keras 2, which has no JAX backend: "
                         "Keras 3 is needed (pip install 'keras>=3.8')"))
    else:
        out.append(Check("keras", OK, f"keras {keras}"))
    return out


def _devices(probe: dict) -> str:
    by = collections.defaultdict(list)
    for d in probe["devices"]:
        by[d["platform"]].append(d["kind"])
    return "; ".join(f"{len(kinds)} {platform.upper()} ({', '.join(sorted(set(kinds)))})"
                     for platform, kinds in by.items())


def check_devices(probe: dict | None, strategy: str, found: probes.ProbeResult,
                  versions: dict) -> list[Check]:
    """What JAX sees in a fresh process, against what the job's ``strategy`` asks for."""
    if probe is None:
        return []
    said = "; JAX said: " + " / ".join(probe["notes"]) if probe.get("notes") else ""
    if probe.get("import_error"):
        return [Check("jax import", FAIL, f"JAX does not import in a fresh process: "
                      f"{probe['import_error']}{said}")]
    if probe.get("error"):
        return [Check("jax devices", FAIL, f"JAX does not initialise its devices in a fresh "
                      f"process: {probe['error']}{said}")]
    if "devices" not in probe:
        return [Check("jax devices", WARN, "not listed: the TPU is held by another process, "
                      "and listing them would initialise it (see accelerator)")]
    platform = probe.get("platform", "?")
    seen = f"default backend {platform}: {_devices(probe)}"
    platforms = {d["platform"] for d in probe["devices"]}
    wanted = {"tpu": "tpu", "gpu": "gpu"}.get(strategy)
    family = "tpu" if found.accelerator.startswith("tpu") else found.accelerator
    fix = jax_install(versions, jax_extra(versions, found))
    if wanted and wanted not in platforms:
        return [Check("jax devices", FAIL, f"key 'strategy': '{strategy}' but JAX sees no "
                      f"{wanted.upper()} ({seen}){said}"
                      + (f"; {fix}" if family == wanted else ""))]
    if strategy == "auto" and family in ("tpu", "gpu") and found.ok and platform == "cpu":
        return [Check("jax devices", WARN, f"the {family.upper()} answers but JAX sees only "
                      f"the CPU ({seen}): the run would train on the CPU{said}; {fix}")]
    return [Check("jax devices", OK, seen)]

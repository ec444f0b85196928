"""``orchestrator doctor``: what this runtime offers, and what would make a run fail.

Checks, each ``ok``, ``warn`` or ``fail``: on TensorFlow, the distribution(s) installed (read
with importlib.metadata, not imported here) and, in a probe subprocess, whether it imports and
has TPU kernels (``ConfigureDistributedTPU``, lost when plain ``tensorflow`` is installed over
``tensorflow-tpu``); the accelerator in sight (TPU VM, legacy TPU node, GPU or none, with
``probes``, which never touch the chip) and whether it answers; on a TPU VM, libtpu (and
``tensorflow-tpu`` on TensorFlow). Colab's TPU runtimes ship JAX and no TensorFlow, so on JAX
nothing imports TensorFlow, not even a probe, and no TensorFlow install is advised: a JAX probe
checks jax, jaxlib and Keras 3 and the devices JAX sees (``jaxcheck.py``). Then the run
directory (on a mounted Drive? writable?), free disk and memory, pip. Given a job, its own code
in a probe process (``python -m orchestrator.train.jobcheck``, on the CPU): modules, factories,
compile identifiers, a model that builds and takes a batch through the first step's loss; a
mistake is named by its key before any training. Exit status 1 when a run would fail.
"""
from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import asdict

from orchestrator.core import backends, osutil
from orchestrator.core.osutil import read_json
from orchestrator.ops import jaxcheck
from orchestrator.ops.checks import FAIL, OK, PROBE_TIMEOUT_S, WARN, Check, run_probe
from orchestrator.recovery import probes

TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-tpu", "tensorflow-gpu",
                    "tensorflow-intel", "tensorflow-macos", "tf-nightly", "tf-nightly-cpu",
                    "tf-nightly-tpu")
TPU_DISTRIBUTIONS = ("tensorflow-tpu", "tf-nightly-tpu", "libtpu", "libtpu-nightly")
# Colab's TPU runtimes stopped shipping TensorFlow in March 2025; this is the line Colab gave
# (googlecolab/colabtools#5164): libtpu's release index holds the libtpu that tensorflow-tpu pins.
LIBTPU_INDEX = "https://storage.googleapis.com/libtpu-tf-releases/index.html"
TPU_INSTALL = f"pip install tensorflow-tpu -f {LIBTPU_INDEX}"
# ... which stopped being a way back: no tensorflow-tpu fits the JAX those images ship
# (googlecolab/colabtools#5174), and the 2.18 pin stopped working on 2025-06-24 (#5419).
# Keras trains on their JAX; this is said first, the line above only for TPU VMs elsewhere.
TPU_ON_JAX = ("on Colab's TPU runtimes train on JAX, which they ship (`backend: jax`, or "
              "`auto`, which takes JAX where TensorFlow is not installed): no tensorflow-tpu "
              "fits their JAX (colabtools#5174, #5419); on another TPU VM: " + TPU_INSTALL)
DRIVE_ROOT = "/content/drive"
MIN_DISK_GB, LOW_DISK_GB, LOW_MEMORY_GB = 1.0, 5.0, 1.0
# The job-code probe imports TensorFlow and calls the job's data factory, which may download.
JOB_CHECK_TIMEOUT_S = 900
# The probes run this very orchestrator package, wherever the current directory is.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROBE_TAG = "DOCTOR-PROBE "
_PROBE = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
out = {}
try:
    import tensorflow as tf
    from tensorflow.python.framework import kernels
    out["version"] = tf.__version__
    op = kernels.get_registered_kernels_for_op("ConfigureDistributedTPU")
    out["tpu_kernels"] = len(op.kernel) > 0
    if "--devices" in sys.argv:
        out["gpus"] = len(tf.config.list_physical_devices("GPU"))
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
print(%r + json.dumps(out), flush=True)
""" % _PROBE_TAG


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def installed_distributions(names) -> dict[str, str]:
    """``{distribution: version}`` of those in ``names`` installed for this Python."""
    wanted = {_norm(n) for n in names}
    found = {}
    for d in importlib.metadata.distributions():
        n = _norm(d.metadata.get("Name") or "")
        if n in wanted:
            found[n] = d.version
    return found


def tensorflow_probe(python: str = sys.executable, devices: bool = True,
                     timeout: float = PROBE_TIMEOUT_S) -> dict:
    """Import TensorFlow in a fresh process: version, TPU kernels, GPUs it sees (or error)."""
    cmd = [python, "-c", _PROBE] + (["--devices"] if devices else [])
    return run_probe(cmd, _PROBE_TAG, "importing TensorFlow", timeout)


def _probe_env(base=None) -> dict:
    base = dict(os.environ if base is None else base)
    paths = [REPO_ROOT] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    # a check of the job's code, not of the device: on a TPU VM, JAX in the probe would take
    # the chip (libtpu admits one process) from a run that is about to start, or is running
    return dict(base, PYTHONPATH=os.pathsep.join(paths), TF_CPP_MIN_LOG_LEVEL="3",
                JAX_PLATFORMS="cpu")


def check_job_code(job_path: str, python: str = sys.executable,
                   timeout: float = JOB_CHECK_TIMEOUT_S) -> Check:
    """The job's code, built as a worker would build it, in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="orchestrator-jobcheck-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        cmd = [python, "-m", "orchestrator.train.jobcheck", os.path.abspath(job_path),
               "--result", result_path]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL, env=_probe_env())
        except subprocess.TimeoutExpired:
            return Check("job code", FAIL, f"building the job's model took longer than "
                         f"{timeout:g} s")
        result = read_json(result_path)
    if not result:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return Check("job code", FAIL, f"the job-code probe exited {p.returncode} with no "
                     f"verdict: {tail}")
    if result.get("ok"):
        return Check("job code", OK, f"{result['detail']} ({result['seconds']:.1f} s)")
    return Check("job code", FAIL, result["error"])


def check_tensorflow(dists: dict, probe: dict | None, wants_tpu: bool) -> list[Check]:
    tf = {k: v for k, v in dists.items() if k in TF_DISTRIBUTIONS}
    tpu_static = any(k in TPU_DISTRIBUTIONS for k in dists)
    listed = ", ".join(f"{k} {v}" for k, v in sorted(tf.items()))
    if not tf:
        how = (f"{TPU_ON_JAX} (never plain tensorflow)" if wants_tpu else
               "install orchestrator[cpu] or [tensorflow]; "
               f"{TPU_ON_JAX} (never plain tensorflow)")
        return [Check("tensorflow", FAIL, "no TensorFlow distribution is installed for "
                      f"{sys.executable}: {how}")]
    out = []
    tpu_won = (probe is not None and probe.get("tpu_kernels") is True
               and any(k in TPU_DISTRIBUTIONS for k in tf))
    if len(tf) > 1 and tpu_won:
        # Colab's own recipe installs tensorflow, then tensorflow-tpu over it: it works while
        # tensorflow-tpu's files are the ones on disk, which the probe just saw.
        out.append(Check("tensorflow", WARN, f"several TensorFlow distributions are installed "
                         f"({listed}); the TPU build's files won (TPU kernels present), but any "
                         "later install of tensorflow puts files without TPU kernels back"))
    elif len(tf) > 1:
        out.append(Check("tensorflow", FAIL, f"several TensorFlow distributions are installed "
                         f"({listed}); they share one `tensorflow` package and the last one "
                         "installed wins (how TPU kernels go missing): uninstall all but one"))
    else:
        out.append(Check("tensorflow", OK, listed))
    if probe is None:
        kernels = tpu_static
        how = "judged by the distributions installed; probe skipped"
    elif probe.get("error"):
        return out + [Check("tensorflow import", FAIL, f"TensorFlow does not import in a fresh "
                            f"process: {probe['error']}")]
    else:
        kernels = bool(probe.get("tpu_kernels"))
        how = f"TensorFlow {probe.get('version')} imports"
        out.append(Check("tensorflow import", OK, how))
    level = OK if kernels or not wants_tpu else FAIL
    detail = ("has TPU kernels" if kernels else
              "no TPU kernels (no ConfigureDistributedTPU): fine off TPU") + f" ({how})"
    if level == FAIL:
        detail = ("no TPU kernels but a TPU is in sight and the job may use it: the run would "
                  f"fail with No OpKernel ... 'ConfigureDistributedTPU'; {TPU_ON_JAX}, after "
                  "uninstalling tensorflow") + f" ({how})"
    out.append(Check("tpu kernels", level, detail))
    return out


def find_accelerator(env, device_globs=None) -> probes.ProbeResult:
    """What a worker would run on here: TPU VM, TPU node, GPU or CPU, probed from outside.

    A TPU VM (its chips are local device files: ``/dev/accel*`` on v2/v3/v4, ``/dev/vfio/N`` on
    v5e and later) comes first: it is what Colab's TPU runtimes are since 2024, and a stale
    ``COLAB_TPU_ADDR`` must not hide it. A TPU node (gRPC at ``COLAB_TPU_ADDR`` or
    ``TPU_NAME=grpc://...``) is the legacy runtime, still found where one is configured."""
    globs = probes.TPU_DEVICE_GLOBS if device_globs is None else device_globs
    if any(glob.glob(g) for g in globs):
        return probes.probe_tpu_vm(globs)
    node = probes.tpu_node_address(env)
    if node:
        return probes.probe_tpu_node(*node)
    if shutil.which("nvidia-smi", path=env.get("PATH")):
        return probes.probe_gpu(env)
    return probes.probe_cpu()


def find_libtpu(env, search=None) -> str | None:
    """The libtpu.so a TPU VM worker would load: ``TPU_LIBRARY_PATH``, else the ``libtpu``
    package of this Python (tensorflow-tpu's dependency, from the libtpu index)."""
    if env.get("TPU_LIBRARY_PATH"):
        return env["TPU_LIBRARY_PATH"] if os.path.isfile(env["TPU_LIBRARY_PATH"]) else None
    for d in sys.path if search is None else search:
        for candidate in (os.path.join(d, "libtpu", "libtpu.so"), os.path.join(d, "libtpu.so")):
            if d and os.path.isfile(candidate):
                return candidate
    return None


def check_tpu_software(found: probes.ProbeResult, dists: dict, libtpu: str | None,
                       wants_tpu: bool, backend: str = backends.TENSORFLOW) -> list[Check]:
    """On a TPU VM: libtpu installed, and on TensorFlow tensorflow-tpu? (Nothing to say
    elsewhere.) On JAX, libtpu is the whole TPU software: Colab's image ships it, and
    tensorflow-tpu is not needed, nor advised."""
    if found.accelerator != "tpu_vm":
        return []
    bad = FAIL if wants_tpu else WARN
    out = []
    if backend != backends.JAX:
        tpu_tf = {k: v for k, v in dists.items() if k in ("tensorflow-tpu", "tf-nightly-tpu")}
        out.append(Check("tensorflow-tpu", OK, ", ".join(f"{k} {v}" for k, v in tpu_tf.items()))
                   if tpu_tf else
                   Check("tensorflow-tpu", bad, "this TPU VM has no tensorflow-tpu (Colab's TPU "
                         "runtimes ship no TensorFlow; plain tensorflow has no TPU kernels): "
                         + TPU_ON_JAX))
    libs = {k: v for k, v in dists.items() if k in ("libtpu", "libtpu-nightly")}
    version = ", ".join(f"{k} {v}" for k, v in libs.items())
    # on JAX: jax[tpu] at the installed jax's version adds the libtpu that release pins
    who, how = (("JAX", jaxcheck.jax_install(dists, "tpu")) if backend == backends.JAX else
                ("TensorFlow", TPU_ON_JAX))
    out.append(Check("libtpu", OK, f"{libtpu}" + (f" ({version})" if version else ""))
               if libtpu else
               Check("libtpu", bad, "no libtpu.so for this Python (TPU_LIBRARY_PATH unset, no "
                     f"libtpu package): {who} cannot open the chips; {how}"))
    return out


def check_accelerator(found: probes.ProbeResult, strategy: str, probe: dict | None
                      ) -> list[Check]:
    wanted = {"auto": None, "tpu": "tpu", "gpu": "gpu", "cpu": "cpu"}.get(strategy)
    family = "tpu" if found.accelerator.startswith("tpu") else found.accelerator
    uses_it = wanted in (None, family)
    label = f"{found.accelerator.replace('_', ' ').upper()}: {found.detail}"
    out = []
    if wanted not in (None, "cpu") and family != wanted:
        out.append(Check("accelerator", FAIL, f"strategy '{strategy}' but no {wanted.upper()} "
                         f"in sight (found {label})"))
    elif not found.ok:
        out.append(Check("accelerator", FAIL if uses_it else WARN,
                         f"{label} - it does not answer ({found.state})"))
    else:
        out.append(Check("accelerator", OK, label + " - answers"))
    if family == "gpu" and found.ok and probe and probe.get("gpus") == 0 and uses_it:
        out.append(Check("tensorflow gpu", FAIL if wanted == "gpu" else WARN,
                         "the GPU answers but TensorFlow sees none (a CPU-only build such as "
                         "tensorflow-cpu?): the run would train on the CPU"))
    return out


def _existing_parent(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def check_run_dir(run_dir: str, env, drive_root: str = DRIVE_ROOT,
                  ismount=os.path.ismount) -> list[Check]:
    path = os.path.abspath(run_dir)
    out = []
    on_drive = path == drive_root or path.startswith(drive_root.rstrip("/") + "/")
    if on_drive and not ismount(drive_root):
        return [Check("run dir", FAIL, f"{path} is under {drive_root}, which is not mounted: "
                      "mount Drive first (drive.mount('/content/drive')); files written there "
                      "now stay on the VM's disk and block the mount later")]
    if on_drive:
        out.append(Check("run dir", OK, f"{path} is on the mounted Drive ({drive_root})"))
    elif env.get("COLAB_RELEASE_TAG"):
        out.append(Check("run dir", WARN, f"{path} is on the VM's own disk: it is lost when the "
                         "runtime is recycled; put run_dir under /content/drive/MyDrive"))
    else:
        out.append(Check("run dir", OK, f"{path} (local disk)"))
    where = _existing_parent(path)
    probe_file = os.path.join(where, f".orchestrator-doctor-{uuid.uuid4().hex[:8]}")
    try:
        if not os.path.isdir(where):
            raise NotADirectoryError(f"{where} is a file, not a directory")
        with open(probe_file, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe_file)
        out.append(Check("writable", OK, f"wrote, synced and removed a file in {where}"))
    except OSError as exc:
        out.append(Check("writable", FAIL, f"cannot write in {where}: {exc}"))
        return out
    free = shutil.disk_usage(where).free / 2**30
    level = FAIL if free < MIN_DISK_GB else WARN if free < LOW_DISK_GB else OK
    out.append(Check("disk", level, f"{free:.1f} GiB free at {where}"
                     + (f" (a run needs room for checkpoints: at least {MIN_DISK_GB:g} GiB)"
                        if level == FAIL else "")))
    return out


def check_memory(meminfo: str = "/proc/meminfo") -> Check:
    try:
        fields = osutil.meminfo(meminfo)
        avail, total = fields["MemAvailable"] / 2**30, fields["MemTotal"] / 2**30
    except (OSError, KeyError, ValueError) as exc:
        return Check("memory", WARN, f"unknown ({meminfo}: {exc})")
    level = WARN if avail < LOW_MEMORY_GB else OK
    return Check("memory", level, f"{avail:.1f} GiB available of {total:.1f} GiB")


def check_pip(python: str = sys.executable) -> Check:
    try:
        p = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("pip", WARN, f"pip did not run: {exc} (the reinstall action needs it)")
    if p.returncode != 0:
        return Check("pip", WARN, f"`{python} -m pip` is not available (exit {p.returncode}): "
                     "the reinstall action (TensorFlow, or jax/jaxlib/libtpu) cannot run")
    return Check("pip", OK, p.stdout.strip().split(" from ")[0])


def check_runtime(run_dir: str, strategy: str = "auto", env=None, run_probe: bool = True,
             python: str = sys.executable, drive_root: str = DRIVE_ROOT,
             ismount=os.path.ismount, backend: str | None = None) -> list[Check]:
    """All checks, in the order a person reads them. ``backend``: the run's (a job's
    ``spec.backend``); None: what ``backend: auto`` resolves to here. On JAX nothing here
    imports TensorFlow, not even in a probe: on a TPU VM that would load libtpu."""
    env = dict(os.environ if env is None else env)
    backend, why = (backend, "the job's") if backend else backends.resolve(backends.AUTO, env)
    found = find_accelerator(env)
    wants_tpu = found.accelerator.startswith("tpu") and strategy in ("auto", "tpu")
    dists = installed_distributions(TF_DISTRIBUTIONS + TPU_DISTRIBUTIONS
                                    + jaxcheck.DISTRIBUTIONS)
    tf_installed = any(k in TF_DISTRIBUTIONS for k in dists)
    on_tf = backend != backends.JAX
    probe = (tensorflow_probe(python, devices=not found.accelerator.startswith("tpu"))
             if run_probe and tf_installed and on_tf else None)
    jax_probe = (jaxcheck.jax_probe(strategy, found, python, env)
                 if run_probe and "jax" in dists and not on_tf else None)
    checks = [Check("python", OK, f"{sys.version.split()[0]} ({python})"),
              Check("backend", OK, f"{backend} ({why})")]
    if on_tf:
        checks += check_tensorflow(dists, probe, wants_tpu)
    else:
        versions, requires = jaxcheck.probed_versions(jax_probe, dists)
        checks += jaxcheck.check_versions(versions, requires, found, python)
    checks += check_accelerator(found, strategy, probe)
    if not on_tf:
        checks += jaxcheck.check_devices(jax_probe, strategy, found, versions)
    checks += check_tpu_software(found, dists, find_libtpu(env), wants_tpu, backend)
    checks += check_run_dir(run_dir, env, drive_root, ismount)
    checks.append(check_memory())
    checks.append(check_pip(python))
    return checks


def run(job: str | None = None, run_dir: str | None = None, **kw) -> list[Check]:
    """The checks for ``job`` (its run_dir and strategy), or for ``run_dir`` with no job."""
    from orchestrator.core.spec import SpecError
    from orchestrator.core.specload import load

    strategy, first, spec = "auto", [], None
    if job is not None:
        try:
            spec = load(job, run_dir=run_dir)
        except SpecError as exc:
            first.append(Check("job", FAIL, str(exc)))
        else:
            strategy, run_dir = spec.strategy, spec.run_dir
            kw.setdefault("backend", spec.backend)
            first.append(Check("job", OK, f"{spec.job_path}: strategy {strategy}, backend "
                               f"{spec.backend}, {spec.epochs} epochs"))
    checks = first + check_runtime(run_dir or os.getcwd(), strategy, **kw)
    if spec is not None and kw.get("run_probe", True):
        if spec.backend != backends.JAX and not any(
                c.name == "tensorflow import" and c.level == OK for c in checks):
            checks.append(Check("job code", WARN, "not checked: TensorFlow does not import"))
        elif spec.backend == backends.JAX and (  # "jax devices": JAX imported in the probe
                not any(c.name == "jax devices" for c in checks)
                or any(c.name == "keras" and c.level == FAIL for c in checks)):
            checks.append(Check("job code", WARN, "not checked: JAX or Keras 3 does not import"))
        else:
            checks.append(check_job_code(spec.job_path, kw.get("python", sys.executable)))
    return checks


def would_fail(checks: list[Check]) -> bool:
    return any(c.level == FAIL for c in checks)


def format_checks(checks: list[Check]) -> str:
    lines = [f"  {c.level.upper():<5} {c.name:<18} {c.detail}" for c in checks]
    bad = [c.name for c in checks if c.level == FAIL]
    lines.append("a run would FAIL: fix " + ", ".join(bad) if bad else
                 "nothing here would stop a run")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> str:
    return json.dumps({"would_fail": would_fail(checks),
                       "checks": [asdict(c) for c in checks]}, indent=2)

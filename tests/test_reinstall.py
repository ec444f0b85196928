"""The reinstall remedy, for real: pip reinstalls small local packages built here, a fresh
process verifies them, the plan follows the run's backend (never TensorFlow on JAX), and the
supervisor's ladder runs it at most once per run."""
import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile

import pytest

from helpers import fake_commands, fake_env
from orchestrator.core import backends
from orchestrator.core.journal import Journal
from orchestrator.recovery.reinstall import installed, reinstall, reinstall_plan
from orchestrator.core.spec import RecoverySpec
from orchestrator.core.specload import load
from orchestrator.supervise.supervisor import Supervisor

# integration: real pip installs into a target folder: real processes, real waiting
pytestmark = pytest.mark.integration


DIST, MODULE, VERSION = "orchestrator-fakeflow", "fakeflow", "1.0"
# What a Colab TPU VM has (googlecolab/backend-info pip-freeze.tpu.txt), plus a TensorFlow a
# reinstall on JAX must leave alone.
TPU_VM = [("jax", "jax", "0.7.2"), ("jaxlib", "jaxlib", "0.7.2"), ("libtpu", "libtpu", "0.0.21"),
          ("tensorflow-cpu", "tensorflow", "2.20.0")]


def _build_wheel(wheels, dist=DIST, module=MODULE, version=VERSION) -> str:
    """A pure-Python wheel (a zip with METADATA, WHEEL and RECORD), no build backend needed."""
    stem = f"{dist.replace('-', '_')}-{version}"
    files = {
        f"{module}/__init__.py": f"__version__ = {version!r}\n",
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{stem}.dist-info/WHEEL":
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = f"{stem}.dist-info/RECORD"
    lines = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        lines.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    files[record] = "\n".join(lines + [f"{record},,"]) + "\n"
    os.makedirs(wheels, exist_ok=True)
    path = os.path.join(wheels, f"{stem}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def _install(wheels, target, pins):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links",
                    wheels, "--target", target, *pins], check=True)


@pytest.fixture
def local_package(tmp_path):
    """The package installed into a target directory, then broken (its module file deleted)."""
    wheels, target = str(tmp_path / "wheels"), str(tmp_path / "site")
    _build_wheel(wheels)
    _install(wheels, target, [f"{DIST}=={VERSION}"])
    module_file = os.path.join(target, MODULE, "__init__.py")
    os.remove(module_file)  # a broken install: the distribution is there, the code is not
    cfg = RecoverySpec(reinstall_tensorflow=True, tensorflow_distributions=("no-such-dist", DIST),
                       verify_import=MODULE,
                       pip_args=("--no-index", "--find-links", wheels, "--target", target,
                                 "--upgrade"))
    env = dict(os.environ, PYTHONPATH=target)
    return cfg, env, module_file, wheels, target


def test_reinstall_repairs_the_installed_distribution_and_verifies_it(local_package):
    cfg, env, module_file, _, _ = local_package
    assert installed(cfg.tensorflow_distributions, env) == (DIST, VERSION)
    result = reinstall(cfg, env)
    assert result["ok"], result
    assert result["command"][:3] == [sys.executable, "-m", "pip"]
    assert result["command"][-1] == f"{DIST}=={VERSION}"
    assert "--force-reinstall" in result["command"] and "--no-deps" in result["command"]
    assert result["verify"].startswith(f"{VERSION} {VERSION} ")
    assert os.path.isfile(module_file)


def test_reinstall_reports_a_failing_pip_and_a_missing_distribution(local_package, tmp_path):
    cfg, env, _, _, _ = local_package
    bad = RecoverySpec(tensorflow_distributions=(DIST,), verify_import=MODULE,
                       pip_args=("--no-index", "--find-links", str(tmp_path / "nowhere")))
    result = reinstall(bad, env)
    assert result["ok"] is False and result["pip_exit"] != 0
    none = reinstall(RecoverySpec(tensorflow_distributions=("no-such-dist",)), env)
    assert none["ok"] is False and "none of no-such-dist is installed" in none["detail"]


def test_the_ladder_reinstalls_once_per_run_then_moves_on(local_package, fake_job):
    cfg, env, module_file, wheels, target = local_package
    args = json.dumps(list(cfg.pip_args))
    job = fake_job(epochs=2, restarts="{max: 4, backoff: {initial: 0.01}}", extra=f"""
            backend: tensorflow
            recovery:
              reinstall_tensorflow: true
              tensorflow_distributions: [{DIST}]
              verify_import: {MODULE}
              pip_args: {args}
              ladders: {{accelerator_context: [reinstall_tensorflow, restart]}}
    """)
    tpu = {"type": "InvalidArgumentError", "message": "No OpKernel was registered to support "
           "Op 'ConfigureDistributedTPU' used by {{node ConfigureDistributedTPU}}"}
    plan_env = dict(fake_env({"error": {"1": tpu, "2": tpu}}))
    plan_env["PYTHONPATH"] = target + os.pathsep + plan_env["PYTHONPATH"]
    out = io.StringIO()
    sup = Supervisor(load(job), commands=fake_commands(), out=out, env=plan_env)
    assert sup.run() == 0, out.getvalue()
    rec = Journal(sup.rd.journal).events("recovery")
    assert [(e["kind"], e["action"]) for e in rec] == [
        ("accelerator_context", "reinstall_tensorflow"), ("accelerator_context", "restart")]
    assert rec[0]["reinstall"]["ok"] is True and os.path.isfile(module_file)
    assert "skipped reinstall_tensorflow: done 1 time(s)" in rec[1]["detail"]


@pytest.fixture
def tpu_vm_install(tmp_path):
    """jax, jaxlib, libtpu and a TensorFlow installed into a target directory, jax broken."""
    others = set(backends.versions(backends.JAX)) - {"keras"} - {d for d, _, _ in TPU_VM}
    if others:  # a GPU machine's jax CUDA plugin: the plan would rightly pin it too
        pytest.skip(f"{', '.join(sorted(others))} installed here, outside the fake TPU VM")
    wheels, target = str(tmp_path / "wheels"), str(tmp_path / "site")
    for dist, module, version in TPU_VM:
        _build_wheel(wheels, dist, module, version)
    _install(wheels, target, [f"{d}=={v}" for d, _, v in TPU_VM])
    module_file = os.path.join(target, "jax", "__init__.py")
    os.remove(module_file)
    cfg = RecoverySpec(reinstall_tensorflow=True,
                       pip_args=("--no-index", "--find-links", wheels, "--target", target,
                                 "--upgrade"))
    return cfg, dict(os.environ, PYTHONPATH=target), module_file


def test_on_jax_the_reinstall_is_jax_jaxlib_and_libtpu_at_their_versions_never_tensorflow(
        tpu_vm_install):
    cfg, env, module_file = tpu_vm_install
    result = reinstall(cfg, env, backend="jax")
    assert result["ok"], result
    assert result["pins"] == [["jax", "0.7.2"], ["jaxlib", "0.7.2"], ["libtpu", "0.0.21"]]
    assert result["command"][-3:] == ["jax==0.7.2", "jaxlib==0.7.2", "libtpu==0.0.21"]
    assert not any("tensorflow" in part for part in result["command"])
    assert result["verify"].startswith("0.7.2 0.7.2 ") and os.path.isfile(module_file)
    assert result["detail"].startswith("reinstalled jax==0.7.2 jaxlib==0.7.2 libtpu==0.0.21; verified")
    # the same install on TensorFlow reinstalls TensorFlow's distribution alone
    tf = reinstall_plan("tensorflow", cfg)
    assert installed(tf.candidates, env) == ("tensorflow-cpu", "2.20.0")


def test_the_plan_follows_the_backend():
    jax = reinstall_plan("jax")
    assert (jax.every, jax.verify_import, jax.verify_distribution) == (True, "jax", "jax")
    assert {"jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt"} <= set(jax.candidates)
    assert not [c for c in jax.candidates if "tensorflow" in c]
    tf = reinstall_plan("tensorflow", RecoverySpec(tensorflow_distributions=("tensorflow-tpu",)))
    assert (tf.candidates, tf.every, tf.verify_import) == (("tensorflow-tpu",), False, "tensorflow")
    with pytest.raises(ValueError, match="no reinstall plan for backend 'torch'"):
        reinstall_plan("torch")



def test_the_remedy_reinstalls_the_backend_the_run_trains_on(tpu_vm_install, fake_job, said):
    """The supervisor's remedy passes the job's backend (resolved when the job was loaded)."""
    from orchestrator.core.kinds import Action
    from orchestrator.recovery.actions import Remedies
    from orchestrator.recovery.policy import Decision

    cfg, env, module_file = tpu_vm_install
    job = fake_job(extra=f"""
            backend: jax
            recovery:
              reinstall_tensorflow: true
              pip_args: {json.dumps(list(cfg.pip_args))}
    """)
    spec = load(job)
    remedies = Remedies(spec, lambda: dict(env), lambda: None, lambda s: None)
    detail, fields = remedies.apply(Decision(Action.REINSTALL_TENSORFLOW, "accelerator_context",
                                             "ladder rung 3"), dict(env))
    assert fields["reinstall"]["ok"] and fields["reinstall"]["backend"] == "jax"
    assert detail.startswith("reinstalled jax==0.7.2 jaxlib==0.7.2 libtpu==0.0.21; verified")
    assert said == ["reinstalling the jax install (recovery.reinstall_tensorflow)"]
    assert remedies.reinstalls == 1 and os.path.isfile(module_file)

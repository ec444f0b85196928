"""The reinstall remedy, for real: pip reinstalls a small local package built here, a fresh
process verifies it, and the supervisor's ladder runs it at most once per run."""
import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile

import pytest

from helpers import fake_env, fake_worker_cmd
from orchestrator.core.journal import Journal
from orchestrator.recovery.reinstall import installed, reinstall_tensorflow
from orchestrator.core.spec import RecoverySpec
from orchestrator.core.specload import load
from orchestrator.supervise.supervisor import Supervisor

# integration: real pip installs into a target folder: real processes, real waiting
pytestmark = pytest.mark.integration


DIST, MODULE, VERSION = "orchestrator-fakeflow", "fakeflow", "1.0"


def _build_wheel(wheels) -> str:
    """A pure-Python wheel (a zip with METADATA, WHEEL and RECORD), no build backend needed."""
    files = {
        f"{MODULE}/__init__.py": f"__version__ = {VERSION!r}\n",
        f"orchestrator_fakeflow-{VERSION}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {VERSION}\n",
        f"orchestrator_fakeflow-{VERSION}.dist-info/WHEEL":
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = f"orchestrator_fakeflow-{VERSION}.dist-info/RECORD"
    lines = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        lines.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    files[record] = "\n".join(lines + [f"{record},,"]) + "\n"
    os.makedirs(wheels, exist_ok=True)
    path = os.path.join(wheels, f"orchestrator_fakeflow-{VERSION}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


@pytest.fixture
def local_package(tmp_path):
    """The package installed into a target directory, then broken (its module file deleted)."""
    wheels, target = str(tmp_path / "wheels"), str(tmp_path / "site")
    _build_wheel(wheels)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links",
                    wheels, "--target", target, f"{DIST}=={VERSION}"], check=True)
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
    result = reinstall_tensorflow(cfg, env)
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
    result = reinstall_tensorflow(bad, env)
    assert result["ok"] is False and result["pip_exit"] != 0
    none = reinstall_tensorflow(RecoverySpec(tensorflow_distributions=("no-such-dist",)), env)
    assert none["ok"] is False and "none of no-such-dist is installed" in none["detail"]


def test_the_ladder_reinstalls_once_per_run_then_moves_on(local_package, fake_job):
    cfg, env, module_file, wheels, target = local_package
    args = json.dumps(list(cfg.pip_args))
    job = fake_job(epochs=2, restarts="{max: 4, backoff: {initial: 0.01}}", extra=f"""
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
    sup = Supervisor(load(job), worker_cmd=fake_worker_cmd, out=out, env=plan_env)
    assert sup.run() == 0, out.getvalue()
    rec = Journal(sup.rd.journal).events("recovery")
    assert [(e["kind"], e["action"]) for e in rec] == [
        ("accelerator_context", "reinstall_tensorflow"), ("accelerator_context", "restart")]
    assert rec[0]["reinstall"]["ok"] is True and os.path.isfile(module_file)
    assert "skipped reinstall_tensorflow: done 1 time(s)" in rec[1]["detail"]

"""`orchestrator doctor`: each check's verdict on runtimes made to order, and the exit status."""
import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from orchestrator import cli
from orchestrator.core import backends
from orchestrator.ops import doctor, jaxcheck
from orchestrator.recovery import probes
from orchestrator.ops.doctor import FAIL, OK, WARN


def _levels(checks):
    return {c.name: c.level for c in checks}


def test_tensorflow_checks():
    c = doctor.check_tensorflow({}, None, wants_tpu=False)
    assert c[0].level == FAIL and "no TensorFlow distribution" in c[0].detail
    both = doctor.check_tensorflow({"tensorflow": "2.19.0", "tensorflow-tpu": "2.19.0"},
                                   {"version": "2.19.0", "tpu_kernels": False}, wants_tpu=True)
    assert _levels(both) == {"tensorflow": FAIL, "tensorflow import": OK, "tpu kernels": FAIL}
    assert "several TensorFlow distributions" in both[0].detail
    assert "ConfigureDistributedTPU" in both[2].detail
    tpu = doctor.check_tensorflow({"tensorflow-tpu": "2.19.0"},
                                  {"version": "2.19.0", "tpu_kernels": True}, wants_tpu=True)
    assert _levels(tpu) == {"tensorflow": OK, "tensorflow import": OK, "tpu kernels": OK}
    broken = doctor.check_tensorflow({"tensorflow": "2.19.0"},
                                     {"error": "ImportError: libcudart.so.12"}, wants_tpu=False)
    assert broken[-1].level == FAIL and "libcudart" in broken[-1].detail
    # without the probe, the TPU kernels are judged by the distributions installed
    static = doctor.check_tensorflow({"tensorflow-cpu": "2.21.0"}, None, wants_tpu=True)
    assert static[-1].level == FAIL and "probe skipped" in static[-1].detail


def test_accelerator_checks():
    cpu = probes.ProbeResult("cpu", "ok", "2 CPU(s)")
    assert doctor.check_accelerator(cpu, "auto", None)[0].level == OK
    assert doctor.check_accelerator(cpu, "tpu", None)[0].level == FAIL
    dead = probes.ProbeResult("tpu_node", "unavailable", "10.0.0.2:8470: timed out")
    assert doctor.check_accelerator(dead, "auto", None)[0].level == FAIL
    assert doctor.check_accelerator(dead, "cpu", None)[0].level == WARN
    gpu = probes.ProbeResult("gpu", "ok", "0, Tesla T4, 0, 15360")
    checks = doctor.check_accelerator(gpu, "auto", {"gpus": 0})
    assert _levels(checks) == {"accelerator": OK, "tensorflow gpu": WARN}
    assert doctor.check_accelerator(gpu, "gpu", {"gpus": 0})[1].level == FAIL
    assert len(doctor.check_accelerator(gpu, "gpu", {"gpus": 1})) == 1


def test_find_accelerator_tpu_node_answers_or_not():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        found = doctor.find_accelerator({"COLAB_TPU_ADDR": f"127.0.0.1:{port}", "PATH": ""})
        assert (found.accelerator, found.state) == ("tpu_node", "ok")
    found = doctor.find_accelerator({"COLAB_TPU_ADDR": f"127.0.0.1:{port}", "PATH": ""})
    assert (found.accelerator, found.state) == ("tpu_node", "unavailable")


def _tpu_vm(tmp_path, monkeypatch, chips=("vfio/0",), dists=None, libtpu=True):
    """A TPU VM made to order: its device files, the distributions installed, a libtpu.so."""
    dev = tmp_path / "dev"
    for chip in chips:
        (dev / chip).parent.mkdir(parents=True, exist_ok=True)
        (dev / chip).write_text("")
    monkeypatch.setattr(probes, "TPU_DEVICE_GLOBS", (f"{dev}/accel*", f"{dev}/vfio/[0-9]*"))
    monkeypatch.setattr(doctor, "installed_distributions", lambda names: dict(dists or {}))
    env = {"PATH": "", "COLAB_RELEASE_TAG": "release"}
    if libtpu:
        lib = tmp_path / "site" / "libtpu" / "libtpu.so"
        lib.parent.mkdir(parents=True)
        lib.write_bytes(b"\x7fELF")
        env["TPU_LIBRARY_PATH"] = str(lib)
    return env


@pytest.mark.integration
def test_a_v5e_tpu_vm_without_tensorflow_gets_the_install_line(tmp_path, monkeypatch):
    env = _tpu_vm(tmp_path, monkeypatch, libtpu=False)
    # a stale legacy address must not hide the chips of the VM itself
    env["COLAB_TPU_ADDR"] = "10.0.0.2:8470"
    checks = doctor.check_runtime(str(tmp_path / "run"), env=env, run_probe=False,
                                  backend="tensorflow")
    levels = _levels(checks)
    assert levels["accelerator"] == OK and "TPU VM: 1 device file(s)" in next(
        c.detail for c in checks if c.name == "accelerator")
    assert (levels["tensorflow"], levels["tensorflow-tpu"], levels["libtpu"]) == (FAIL,) * 3
    line = ("pip install tensorflow-tpu -f "
            "https://storage.googleapis.com/libtpu-tf-releases/index.html")
    assert all(line in c.detail and "train on JAX" in c.detail  # JAX first (colabtools#5174)
               for c in checks if c.name in ("tensorflow", "tensorflow-tpu", "libtpu"))
    # a job that will not use the TPU only hears about it
    checks = doctor.check_runtime(str(tmp_path / "run"), "cpu", env=env, run_probe=False,
                                  backend="tensorflow")
    assert _levels(checks)["tensorflow-tpu"] == WARN


@pytest.mark.integration
def test_a_tpu_vm_with_tensorflow_tpu_and_libtpu(tmp_path, monkeypatch):
    env = _tpu_vm(tmp_path, monkeypatch, chips=("accel0", "accel1", "accel2", "accel3"),
                  dists={"tensorflow-tpu": "2.18.0", "libtpu": "2.18.0"})
    checks = doctor.check_runtime(str(tmp_path / "run"), env=env, run_probe=False,
                                  backend="tensorflow")
    levels = _levels(checks)
    assert (levels["tensorflow"], levels["tpu kernels"], levels["tensorflow-tpu"],
            levels["libtpu"]) == (OK, OK, OK, OK)
    assert "4 device file(s)" in next(c.detail for c in checks if c.name == "accelerator")
    assert next(c.detail for c in checks if c.name == "libtpu").endswith(
        "libtpu/libtpu.so (libtpu 2.18.0)")
    # found through this Python's own packages when TPU_LIBRARY_PATH is unset
    assert doctor.find_libtpu({}, [str(tmp_path / "nowhere"), str(tmp_path / "site")]) == str(
        tmp_path / "site" / "libtpu" / "libtpu.so")
    assert doctor.find_libtpu({"TPU_LIBRARY_PATH": str(tmp_path / "gone.so")}) is None


@pytest.mark.integration
def test_a_colab_tpu_vm_on_jax_checks_libtpu_and_never_advises_tensorflow(tmp_path,
                                                                          monkeypatch):
    """Today's Colab TPU image (googlecolab/backend-info pip-freeze.tpu.txt): jax, jaxlib and
    libtpu, no TensorFlow. On JAX the doctor imports no TensorFlow, not even in a probe (it
    would load libtpu), and tells no one to install tensorflow-tpu (colabtools#5174)."""
    image = {"jax": "0.7.2", "jaxlib": "0.7.2", "libtpu": "0.0.23"}  # jax[tpu]==0.7.2's pin
    # with a TensorFlow installed beside it too (a custom image): still no TensorFlow probe
    env = _tpu_vm(tmp_path, monkeypatch, dists=dict(image, tensorflow="2.20.0"))
    monkeypatch.setattr(doctor, "tensorflow_probe", lambda *a, **k: pytest.fail("imported TF"))
    monkeypatch.setattr(jaxcheck, "jax_probe", lambda *a, **k: dict(V5E_PROBE))
    checks = doctor.check_runtime(str(tmp_path / "run"), env=env, backend="jax")
    levels = _levels(checks)
    assert not {"tensorflow", "tensorflow import", "tpu kernels", "tensorflow-tpu"} & set(levels)
    assert (levels["accelerator"], levels["libtpu"]) == (OK, OK)
    assert next(c.detail for c in checks if c.name == "libtpu").endswith(
        "libtpu/libtpu.so (libtpu 0.0.23)")
    env = _tpu_vm(tmp_path / "bare", monkeypatch, dists={"jax": "0.7.2"}, libtpu=False)
    checks = doctor.check_runtime(str(tmp_path / "run"), env=env, run_probe=False,
                                  backend="jax")
    libtpu = next(c for c in checks if c.name == "libtpu")
    assert libtpu.level == FAIL and libtpu.detail.endswith(
        "JAX cannot open the chips; pip install 'jax[tpu]==0.7.2'")
    assert not any("tensorflow-tpu" in c.detail for c in checks)
    # the job-code probe builds the model on the CPU: JAX there must not take the chip
    assert doctor._probe_env({})["JAX_PLATFORMS"] == "cpu"


@pytest.mark.integration
def test_no_tpu_checks_off_a_tpu_vm(tmp_path, monkeypatch):
    monkeypatch.setattr(probes, "TPU_DEVICE_GLOBS", ())
    checks = doctor.check_runtime(str(tmp_path / "run"), env={"PATH": ""}, run_probe=False)
    assert "tensorflow-tpu" not in _levels(checks) and "libtpu" not in _levels(checks)


def test_tensorflow_then_tensorflow_tpu_over_it_is_a_warning_when_the_kernels_are_there():
    # Colab's recipe: pip install tensorflow==2.18.0, then tensorflow-tpu==2.18.0 -f <index>
    both = {"tensorflow": "2.18.0", "tensorflow-tpu": "2.18.0"}
    won = doctor.check_tensorflow(both, {"version": "2.18.0", "tpu_kernels": True},
                                  wants_tpu=True)
    assert _levels(won) == {"tensorflow": WARN, "tensorflow import": OK, "tpu kernels": OK}
    assert "TPU build's files won" in won[0].detail
    lost = doctor.check_tensorflow(both, {"version": "2.18.0", "tpu_kernels": False},
                                   wants_tpu=True)
    assert lost[0].level == FAIL and lost[-1].level == FAIL
    assert doctor.check_tensorflow(both, None, wants_tpu=True)[0].level == FAIL


def _fake_nvidia_smi(tmp_path, code, text):
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    exe = d / "nvidia-smi"
    exe.write_text(f'#!/bin/sh\necho "{text}"\nexit {code}\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return {"PATH": str(d)}


@pytest.mark.integration
def test_find_accelerator_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(probes, "TPU_DEVICE_GLOBS", ())  # whatever this machine has
    found = doctor.find_accelerator(_fake_nvidia_smi(tmp_path, 0, "0, Tesla T4, 3, 15360"))
    assert (found.accelerator, found.state) == ("gpu", "ok") and "Tesla T4" in found.detail
    found = doctor.find_accelerator(_fake_nvidia_smi(
        tmp_path, 9, "NVIDIA-SMI has failed because it couldn't communicate with the driver"))
    assert (found.accelerator, found.state) == ("gpu", "unavailable")
    assert "couldn't communicate" in found.detail


def test_run_dir_checks(tmp_path):
    drive = str(tmp_path / "drive")
    c = doctor.check_run_dir(f"{drive}/MyDrive/run", {}, drive_root=drive,
                             ismount=lambda p: False)
    assert len(c) == 1 and c[0].level == FAIL and "not mounted" in c[0].detail
    os.makedirs(drive)
    c = doctor.check_run_dir(f"{drive}/MyDrive/run", {}, drive_root=drive,
                             ismount=lambda p: p == drive)
    assert _levels(c) == {"run dir": OK, "writable": OK, "disk": _levels(c)["disk"]}
    assert "mounted Drive" in c[0].detail
    c = doctor.check_run_dir(str(tmp_path / "local"), {"COLAB_RELEASE_TAG": "release"},
                             drive_root=drive, ismount=lambda p: True)
    assert c[0].level == WARN and "lost when the runtime is recycled" in c[0].detail
    (tmp_path / "a-file").write_text("x")
    c = doctor.check_run_dir(str(tmp_path / "a-file" / "run"), {}, drive_root=drive)
    assert _levels(c)["writable"] == FAIL
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".orchestrator-doctor")]


@pytest.mark.integration
def test_memory_and_pip(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       13290460 kB\nMemAvailable:     524288 kB\n")
    m = doctor.check_memory(str(meminfo))
    assert m.level == WARN and m.detail.startswith("0.5 GiB available of 12.7 GiB")
    assert doctor.check_pip().level == OK
    nopip = tmp_path / "python-without-pip"
    nopip.write_text("#!/bin/sh\necho 'No module named pip' >&2\nexit 1\n")
    nopip.chmod(0o755)
    p = doctor.check_pip(str(nopip))
    assert p.level == WARN and "reinstall action" in p.detail


@pytest.mark.integration
def test_cli_exit_status_and_json(tmp_path, write_job, capsys):
    assert cli.main(["doctor", "--no-probe", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "nothing here would stop a run" in out
    assert cli.main(["doctor", "--no-probe", "--json", "--run-dir",
                     str(tmp_path / "f" / "run")]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["would_fail"] is False and {c["name"] for c in j["checks"]} >= {
        "python", "tensorflow", "accelerator", "run dir", "writable", "disk", "memory", "pip"}
    (tmp_path / "f2").write_text("not a dir")
    assert cli.main(["doctor", "--no-probe", "--run-dir", str(tmp_path / "f2" / "run")]) == 1
    assert "a run would FAIL: fix writable" in capsys.readouterr().out
    bad = write_job("name: x\nepochs: many\n", name="bad.yaml")
    assert cli.main(["doctor", "--no-probe", bad]) == 1
    out = capsys.readouterr().out
    assert "FAIL  job" in out and "bad.yaml: key '" in out


@pytest.mark.integration
def test_doctor_never_imports_tensorflow_in_its_own_process(tmp_path):
    # A fresh interpreter: other tests in this session may have imported Keras already.
    code = ("import sys; from orchestrator.ops import doctor\n"
            f"doctor.run(None, {str(tmp_path)!r}, run_probe=False)\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]\n"
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.e2e
def test_tensorflow_probe_in_a_fresh_process():
    import importlib.metadata

    probe = doctor.tensorflow_probe()
    assert probe.get("error") is None, probe
    assert probe["version"] == importlib.metadata.version("tensorflow-cpu")
    assert probe["tpu_kernels"] is False and probe["gpus"] == 0


def _digits_job(tmp_path, optimizer="adam", backend=None):
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copy(os.path.join(root, "jobs", "digits", "digits_job.py"), tmp_path)
    text = open(os.path.join(root, "jobs", "digits", "job.yaml")).read()
    for was, now in (("optimizer: adam\n", f"optimizer: {optimizer}\n"),
                     ("run_dir: runs/digits", f"run_dir: {tmp_path / 'run'}")):
        assert was in text
        text = text.replace(was, now)
    job = tmp_path / f"job-{optimizer}.yaml"
    job.write_text(text + (f"backend: {backend}\n" if backend else ""))
    return str(job)


@pytest.mark.integration
def test_a_job_code_probe_that_leaves_no_verdict_fails_the_check_with_its_last_line(tmp_path):
    broken = tmp_path / "python-that-dies"
    broken.write_text("#!/bin/sh\necho 'Fatal Python error: boom' >&2\nexit 3\n")
    broken.chmod(0o755)
    c = doctor.check_job_code(_digits_job(tmp_path), python=str(broken))
    assert (c.name, c.level) == ("job code", FAIL)
    assert "exited 3 with no verdict: Fatal Python error: boom" in c.detail


@pytest.mark.integration
def test_the_job_code_is_not_checked_when_tensorflow_does_not_import(tmp_path):
    no_tf = tmp_path / "python-without-tensorflow"
    no_tf.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'tensorflow'\" >&2"
                     "\nexit 1\n")
    no_tf.chmod(0o755)
    checks = doctor.run(_digits_job(tmp_path), python=str(no_tf))
    assert _levels(checks)["tensorflow import"] == FAIL
    assert checks[-1].name == "job code" and checks[-1].level == WARN
    assert "not checked" in checks[-1].detail


@pytest.mark.integration
def test_no_probe_skips_the_job_code_check(tmp_path):
    checks = doctor.run(_digits_job(tmp_path, "adamm"), run_probe=False)
    assert "job code" not in _levels(checks)


@pytest.mark.e2e
def test_job_code_check_names_the_key_before_any_training(tmp_path, capsys, monkeypatch):
    bad = _digits_job(tmp_path, "adamm", backend="jax")  # Keras's words; JAX starts faster
    c = doctor.check_job_code(bad)
    assert c.level == FAIL and "key 'compile.optimizer': Keras does not accept 'adamm'" in c.detail
    assert "did you mean 'adam'" in c.detail
    # the command reports that verdict (the check itself is not run twice: a framework start)
    monkeypatch.setattr(doctor, "check_job_code", lambda path, *_: c if path == bad else None)
    assert cli.main(["doctor", bad]) == 1
    out = capsys.readouterr().out
    assert "FAIL  job code" in out and "a run would FAIL: fix job code" in out
    assert not (tmp_path / "run").exists()  # nothing written, nothing trained


@pytest.mark.e2e
def test_job_code_check_builds_a_good_job_without_tensorflow_in_the_doctor(tmp_path):
    code = ("import sys; from orchestrator.ops import doctor\n"
            f"c = doctor.run({_digits_job(tmp_path)!r})[-1]\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]\n"
            "print(c.name, c.level, c.detail); print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("job code ok imported digits_job:build_model"), p.stdout
    assert "digits_cnn" in p.stdout and "first step's loss" in p.stdout


# --- JAX (ops/jaxcheck.py) ---------------------------------------------------------------
# What the probe reports, in the formats JAX prints them. Sources:
# - CPU: this machine (jax 0.10.2): jax.devices() -> [CpuDevice(id=0)], default_backend() cpu,
#   device_kind 'cpu'; jax 0.10.2's metadata: Requires-Dist: jaxlib<=0.10.2,>=0.10.1.
# - GPU: bench/gpu/h200-2026-12-04.json, this project's own run on an H200 ("0.11.2 0.11.2
#   [CudaDevice(id=0)]", device_kind 'NVIDIA H200'); a CUDA device's platform is 'gpu'.
# - TPU: a v6e-1 TPU VM's jax.devices() as a public note recorded it (jax 0.6.2: [TpuDevice(id=0,
#   process_index=0, coords=(0,0,0), core_on_chip=0)]); 'TPU v5 lite' is the v5e's device_kind
#   (jax/_src/mesh_utils.py: _TPU_V5_LITE); Colab's TPU image: jax/jaxlib 0.7.2, keras 3.13.2
#   (googlecolab/backend-info pip-freeze.tpu.txt, as issue 23 quotes it).
# - Falling back to the CPU: jax/_src/xla_bridge.py's warning; a CUDA plugin of another
#   release: jaxlib/plugin_support.py's RuntimeWarning as a Colab notebook printed it; a held
#   TPU: libtpu's words inside JAX's (jax#22070, as tests/test_failures.py has them); a jaxlib
#   newer than jax: jax/_src/lib/__init__.py (octo-models/octo#125: 0.4.31 with jax 0.4.20).

CPU_PROBE = {"versions": {"jax": "0.10.2", "jaxlib": "0.10.2", "keras": "3.15.1"},
             "jaxlib_requires": ["jaxlib<=0.10.2,>=0.10.1"], "notes": [], "platform": "cpu",
             "devices": [{"platform": "cpu", "kind": "cpu", "repr": "CpuDevice(id=0)"}]}
H200_PROBE = dict(CPU_PROBE, platform="gpu", devices=[
    {"platform": "gpu", "kind": "NVIDIA H200", "repr": "CudaDevice(id=0)"}])
V5E_PROBE = {"versions": {"jax": "0.7.2", "jaxlib": "0.7.2", "libtpu": "0.0.23",
                          "keras": "3.13.2"}, "notes": [], "platform": "tpu",
             "devices": [{"platform": "tpu", "kind": "TPU v5 lite", "repr": (
                 "TpuDevice(id=0, process_index=0, coords=(0,0,0), core_on_chip=0)")}]}
FELL_BACK = ("An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not "
             "installed. Falling back to cpu.")
TPU_HELD = ("RuntimeError: Unable to initialize backend 'tpu': ABORTED: The TPU is already in "
            "use by process with pid 4242. Not attempting to load libtpu.so in this process. "
            "(set JAX_PLATFORMS='' to automatically choose an available backend)")
CPU = probes.ProbeResult("cpu", "ok", "2 CPU(s)")
T4 = probes.ProbeResult("gpu", "ok", "0, Tesla T4, 0, 15360")
V5E = probes.ProbeResult("tpu_vm", "ok", "1 device file(s); the TPU is free")
V5E_HELD = probes.ProbeResult("tpu_vm", "busy", "1 device file(s); the TPU is held by pid 4242")


def _detail(checks, name):
    return next(c.detail for c in checks if c.name == name)


def test_jax_and_jaxlib_of_one_release_or_a_fix_pinned_to_the_installed_jax():
    req = CPU_PROBE["jaxlib_requires"]
    ok = jaxcheck.check_versions(CPU_PROBE["versions"], req, CPU)
    assert [(c.name, c.level, c.detail) for c in ok] == [
        ("jax", OK, "jax 0.10.2, jaxlib 0.10.2"), ("keras", OK, "keras 3.15.1")]
    # a jaxlib newer than jax: JAX refuses to import it (jax/_src/lib/__init__.py)
    newer = jaxcheck.check_versions({"jax": "0.10.2", "jaxlib": "0.11.2", "keras": "3.15.1"},
                                    req, CPU)
    assert newer[0].level == FAIL and newer[0].detail.startswith(
        "jax 0.10.2, jaxlib 0.11.2: jax 0.10.2 requires jaxlib<=0.10.2,>=0.10.1")
    assert newer[0].detail.endswith("pip install 'jax==0.10.2' 'jaxlib==0.10.2'")
    # on a TPU VM the same fix through jax[tpu], which also brings the libtpu it pins
    on_tpu = jaxcheck.check_versions({"jax": "0.10.2", "jaxlib": "0.11.2"}, req, V5E)
    assert on_tpu[0].detail.endswith("pip install 'jax[tpu]==0.10.2'")
    # older, but inside jax's own range: it imports; JAX's accelerator builds pair them equal
    inside = jaxcheck.check_versions({"jax": "0.10.2", "jaxlib": "0.10.1", "keras": "3.15.1"},
                                     req, CPU)
    assert inside[0].level == WARN and "accepts it" in inside[0].detail
    # a jax that declares no range (jax < 0.4.31): only one release is known to fit
    assert jaxcheck.check_versions({"jax": "0.4.20", "jaxlib": "0.4.31"}, [], CPU)[0].level == FAIL
    assert jaxcheck.check_versions({"jax": "0.4.20"}, [], CPU)[0].level == FAIL


def test_a_cuda_plugin_of_another_release_than_jaxlib_fails_with_the_cuda_fix():
    # "JAX plugin jax_cuda12_plugin version 0.7.2 is installed, but it is not compatible with
    # the installed jaxlib version 0.7.1, so it will not be used." (a Colab GPU notebook)
    versions = {"jax": "0.7.1", "jaxlib": "0.7.1", "jax-cuda12-plugin": "0.7.2",
                "jax-cuda12-pjrt": "0.7.1", "keras": "3.13.2"}
    checks = jaxcheck.check_versions(versions, ["jaxlib<=0.7.1,>=0.7.1"], T4)
    assert [(c.name, c.level) for c in checks] == [("jax", OK), ("jax plugin", FAIL), ("keras", OK)]
    assert checks[1].detail.startswith("jax-cuda12-plugin 0.7.2 beside jaxlib 0.7.1")
    assert checks[1].detail.endswith("pip install 'jax[cuda12]==0.7.1'")


def test_keras_3_and_jax_itself_must_be_installed():
    keras2 = jaxcheck.check_versions({"jax": "0.10.2", "jaxlib": "0.10.2", "keras": "2.15.0"},
                                     [], CPU)
    assert keras2[-1].level == FAIL and "Keras 2, which has no JAX backend" in keras2[-1].detail
    none = jaxcheck.check_versions({}, [], CPU, python="/usr/bin/python3")
    assert [(c.name, c.level) for c in none] == [("jax", FAIL), ("keras", FAIL)]
    assert "JAX is not installed for /usr/bin/python3: pip install 'orchestrator[jax]'" in (
        none[0].detail)


def test_jax_devices_against_the_job_s_strategy():
    ok = jaxcheck.check_devices(CPU_PROBE, "auto", CPU, CPU_PROBE["versions"])
    assert [(c.name, c.level, c.detail) for c in ok] == [
        ("jax devices", OK, "default backend cpu: 1 CPU (cpu)")]
    assert jaxcheck.check_devices(H200_PROBE, "gpu", T4, {})[0].detail == (
        "default backend gpu: 1 GPU (NVIDIA H200)")
    tpu = jaxcheck.check_devices(V5E_PROBE, "tpu", V5E, V5E_PROBE["versions"])
    assert (tpu[0].level, tpu[0].detail) == (OK, "default backend tpu: 1 TPU (TPU v5 lite)")
    # a TPU job where JAX sees none: named by its key
    no_tpu = jaxcheck.check_devices(CPU_PROBE, "tpu", CPU, CPU_PROBE["versions"])
    assert no_tpu[0].level == FAIL and no_tpu[0].detail.startswith(
        "key 'strategy': 'tpu' but JAX sees no TPU (default backend cpu: 1 CPU (cpu))")


def test_a_gpu_that_jax_does_not_see_fails_a_gpu_job_and_warns_an_auto_one():
    fell_back = dict(CPU_PROBE, notes=[FELL_BACK])
    versions = {"jax": "0.7.2", "jaxlib": "0.7.2"}
    gpu = jaxcheck.check_devices(fell_back, "gpu", T4, versions)[0]
    assert gpu.level == FAIL and gpu.detail.startswith("key 'strategy': 'gpu' but JAX sees no GPU")
    assert f"JAX said: {FELL_BACK}" in gpu.detail
    assert gpu.detail.endswith("pip install 'jax[cuda12]==0.7.2'")
    auto = jaxcheck.check_devices(fell_back, "auto", T4, versions)[0]
    assert auto.level == WARN and "the run would train on the CPU" in auto.detail
    # a CPU job on the same machine is what it asks for
    assert jaxcheck.check_devices(CPU_PROBE, "cpu", T4, versions)[0].level == OK


def test_a_probe_that_cannot_import_jax_or_open_its_devices_fails():
    newer = ("RuntimeError: jaxlib version 0.4.31 is newer than and incompatible with jax "
             "version 0.4.20. Please update your jax and/or jaxlib packages.")
    c = jaxcheck.check_devices({"versions": {}, "notes": [], "import_error": newer}, "auto",
                               CPU, {})[0]
    assert (c.name, c.level) == ("jax import", FAIL) and newer in c.detail
    held = jaxcheck.check_devices({"versions": {}, "notes": [], "error": TPU_HELD}, "auto",
                                  V5E, {})[0]
    assert (held.name, held.level) == ("jax devices", FAIL) and "pid 4242" in held.detail
    # a TPU another process holds is not opened at all: versions only, and that is said
    unlisted = jaxcheck.check_devices({"versions": {}, "notes": []}, "auto", V5E_HELD, {})[0]
    assert unlisted.level == WARN and "held by another process" in unlisted.detail


def test_the_jax_probe_sees_what_the_worker_would_and_never_opens_a_held_tpu(monkeypatch):
    base = {"PATH": "/usr/bin"}
    assert jaxcheck.probe_env("cpu", V5E, base)["JAX_PLATFORMS"] == "cpu"
    # on a TPU VM the TPU is named: a TPU that fails to open fails, not trains on the CPU
    assert jaxcheck.probe_env("auto", V5E, base)["JAX_PLATFORMS"] == "tpu,cpu"
    assert "JAX_PLATFORMS" not in jaxcheck.probe_env("auto", T4, base)
    assert jaxcheck.probe_env("auto", T4, base)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert jaxcheck.probe_env("auto", V5E, dict(base, JAX_PLATFORMS="tpu"))["JAX_PLATFORMS"] == (
        "tpu")
    assert backends.jax_platforms("gpu", True, {}) is None
    ran = []
    monkeypatch.setattr(jaxcheck, "run_probe", lambda cmd, *a, **k: ran.append(cmd) or {})
    jaxcheck.jax_probe("auto", V5E_HELD, python="py")
    jaxcheck.jax_probe("auto", V5E, python="py")
    assert [cmd[3] for cmd in ran] == ["versions", "devices"]
    assert ran[0][0] == "py" and ran[0][4:] == list(jaxcheck.DISTRIBUTIONS)


def test_the_jax_probe_and_the_worker_name_the_same_platforms(monkeypatch, tmp_path):
    """Both take them from core/backends.py jax_platforms: the worker in its configure."""
    from types import SimpleNamespace

    from orchestrator.core import tpuvm
    from orchestrator.train.backends.jax_backend import JaxBackend

    (tmp_path / "dev" / "vfio").mkdir(parents=True)
    monkeypatch.setattr(tpuvm, "DEVICE_GLOBS", (f"{tmp_path}/dev/vfio/[0-9]*",))
    seen = []
    for chip in (False, True):
        if chip:
            (tmp_path / "dev" / "vfio" / "0").write_text("")
        for strategy in ("auto", "tpu", "gpu", "cpu"):
            for name in ("JAX_PLATFORMS", "ORCHESTRATOR_STRATEGY", "XLA_FLAGS"):
                monkeypatch.setenv(name, "")  # restored after the test, whatever configure sets
                monkeypatch.delenv(name)
            spec = SimpleNamespace(strategy=strategy, deterministic=False,
                                   run_dir=str(tmp_path / "run"), checkpoint=SimpleNamespace(
                                       local_dir=str(tmp_path / "local" / "ckpt")))
            JaxBackend().configure(spec, None, standby=False)
            found = V5E if chip else CPU
            probe = jaxcheck.probe_env(strategy, found, {}).get("JAX_PLATFORMS")
            assert os.environ.get("JAX_PLATFORMS") == probe, (strategy, chip)
            seen.append(probe)
    assert seen == [None, None, None, "cpu", "tpu,cpu", "tpu,cpu", None, "cpu"]


def _no_pip(monkeypatch):
    monkeypatch.setattr(doctor, "check_pip", lambda python=None: doctor.Check("pip", OK, "pip"))


def test_a_colab_tpu_vm_on_jax_in_full_tensorflow_absent(tmp_path, monkeypatch):
    """Today's Colab TPU runtime as the doctor sees it: JAX checks, no TensorFlow, no FAIL."""
    _no_pip(monkeypatch)
    env = _tpu_vm(tmp_path, monkeypatch, dists=V5E_PROBE["versions"])
    probed = []
    monkeypatch.setattr(jaxcheck, "jax_probe",
                        lambda *a, **k: probed.append(a) or dict(V5E_PROBE))
    checks = doctor.check_runtime(str(tmp_path / "run"), "tpu", env=env, backend="jax")
    levels = _levels(checks)
    assert not doctor.would_fail(checks), doctor.format_checks(checks)
    assert (levels["backend"], levels["jax"], levels["keras"], levels["jax devices"],
            levels["libtpu"]) == (OK,) * 5
    assert not {"tensorflow", "tensorflow import", "tpu kernels", "tensorflow-tpu"} & set(levels)
    assert _detail(checks, "jax") == "jax 0.7.2, jaxlib 0.7.2"
    assert probed and probed[0][0] == "tpu"  # the job's strategy, for the worker's platforms
    # the same runtime with jaxlib from another release and JAX that falls back to the CPU
    broken = dict(CPU_PROBE, versions=dict(V5E_PROBE["versions"], jaxlib="0.8.1"),
                  jaxlib_requires=["jaxlib<=0.7.2,>=0.7.2"])
    monkeypatch.setattr(jaxcheck, "jax_probe", lambda *a, **k: broken)
    checks = doctor.check_runtime(str(tmp_path / "run"), "tpu", env=env, backend="jax")
    assert doctor.would_fail(checks)
    assert _detail(checks, "jax").endswith("pip install 'jax[tpu]==0.7.2'")
    assert _detail(checks, "jax devices").startswith("key 'strategy': 'tpu' but JAX sees no TPU")
    # --no-probe: the versions of this Python's distributions, no devices
    checks = doctor.check_runtime(str(tmp_path / "run"), "tpu", env=env, backend="jax",
                                  run_probe=False)
    assert _levels(checks)["jax"] == OK and "jax devices" not in _levels(checks)


@pytest.mark.integration
def test_the_real_jax_probe_on_this_cpu_from_a_doctor_that_never_imports_jax(tmp_path):
    import importlib.metadata

    code = ("import json, sys; from orchestrator.ops import doctor\n"
            f"checks = doctor.check_runtime({str(tmp_path)!r}, 'cpu', backend='jax')\n"
            "print(json.dumps([[c.name, c.level, c.detail] for c in checks]))\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib', 'tensorflow', 'keras')]\n"
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stdout + p.stderr
    checks = {name: (level, detail) for name, level, detail in json.loads(
        p.stdout.splitlines()[0])}
    jax, jaxlib, keras = (importlib.metadata.version(d) for d in ("jax", "jaxlib", "keras"))
    assert checks["jax"] == (OK, f"jax {jax}, jaxlib {jaxlib}")
    assert checks["keras"] == (OK, f"keras {keras}")
    assert checks["jax devices"] == (OK, "default backend cpu: 1 CPU (cpu)")


def test_backend_auto_resolving_to_jax_gets_the_jax_checks(tmp_path, monkeypatch):
    _no_pip(monkeypatch)
    monkeypatch.setattr(probes, "TPU_DEVICE_GLOBS", ())  # whatever this machine has
    monkeypatch.setattr(doctor, "tensorflow_probe", lambda *a, **k: pytest.fail("imported TF"))
    monkeypatch.setattr(jaxcheck, "jax_probe", lambda *a, **k: dict(CPU_PROBE))
    checks = doctor.check_runtime(str(tmp_path / "run"), env={"PATH": "", "KERAS_BACKEND": "jax"})
    assert _detail(checks, "backend") == "jax (KERAS_BACKEND=jax)"
    assert (_levels(checks)["jax"], _levels(checks)["jax devices"]) == (OK, OK)
    assert "tensorflow" not in _levels(checks)


def test_a_jax_job_s_code_is_checked_only_when_jax_imports(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "jax")  # the job's backend: auto resolves to JAX
    _no_pip(monkeypatch)
    monkeypatch.setattr(probes, "TPU_DEVICE_GLOBS", ())
    newer = ("RuntimeError: jaxlib version 0.4.31 is newer than and incompatible with jax "
             "version 0.4.20. Please update your jax and/or jaxlib packages.")
    monkeypatch.setattr(jaxcheck, "jax_probe", lambda *a, **k: {
        "versions": {"jax": "0.4.20", "jaxlib": "0.4.31", "keras": "3.8.0"}, "notes": [],
        "import_error": newer})
    monkeypatch.setattr(doctor, "check_job_code", lambda *a, **k: pytest.fail("built the job"))
    env = {"PATH": "", "KERAS_BACKEND": "jax"}
    checks = doctor.run(_digits_job(tmp_path), env=env)
    assert "strategy auto, backend jax, 10 epochs" in checks[0].detail
    assert (_levels(checks)["jax"], _levels(checks)["jax import"]) == (FAIL, FAIL)
    assert (checks[-1].name, checks[-1].level) == ("job code", WARN)
    assert "not checked: JAX" in checks[-1].detail
    monkeypatch.setattr(jaxcheck, "jax_probe", lambda *a, **k: dict(CPU_PROBE))
    monkeypatch.setattr(doctor, "check_job_code", lambda *a, **k: doctor.Check("job code", OK, ""))
    assert doctor.run(_digits_job(tmp_path), env=env)[-1].level == OK

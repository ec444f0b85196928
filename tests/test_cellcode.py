"""Jobs defined in cells: the functions travel by value (core/cellcode.py), the training hash
covers them (the same code in another process hashes the same), only a code file of this
user's is unpickled, and a function that cannot be carried fails at once, named."""
import io
import linecache
import os
import stat
import subprocess
import sys
import textwrap
import threading

import pytest

import noimport
from helpers import fake_commands, fake_env
from orchestrator import api
from orchestrator.core import cellcode
from orchestrator.core.spec import SpecError
from orchestrator.core.specload import load
from orchestrator.supervise.admission import IncompatibleResume
from orchestrator.supervise.supervisor import Supervisor

CELL = '''
import numpy as np

SCALE = 16.0


def helper(x):
    return np.asarray(x) / SCALE


class Shift:
    def __init__(self, by):
        self.by = by

    def apply(self, x):
        return x + self.by


def load_data(n=4):
    return {"train": (Shift(1).apply(helper(np.arange(n))), np.zeros(n))}


def build_model():
    return {s for s in ("a", "b", "c")}
'''


def cell(src=CELL, filename="/tmp/ipykernel_1/1.py", first_line=1):
    """Run ``src`` as a notebook cell does: a module that cannot be imported, its source in
    linecache under the cell's file name."""
    src = "\n" * (first_line - 1) + textwrap.dedent(src)
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns = {"__name__": "__main__"}
    exec(compile(src, filename, "exec"), ns)
    return ns


def job(ns, tmp_path, **keys):
    return dict(dict(model=ns["build_model"], data=ns["load_data"], name="cell", epochs=2,
                     batch_size=8, run_dir=str(tmp_path / "run")), **keys)


def frozen(tmp_path, ns=None, **keys):
    """Freeze a keyword job into its run directory as the supervisor does; its spec."""
    keys = job(ns or cell(), tmp_path, **keys)
    spec, cj = api.keyword_job(keys)
    os.makedirs(spec.run_dir, exist_ok=True)
    cj.freeze(spec.job_path)
    return load(spec.job_path, run_dir=spec.run_dir), cj


@pytest.mark.integration
def test_the_functions_round_trip_by_value_into_a_process_that_never_saw_the_cell(tmp_path):
    spec, cj = frozen(tmp_path)
    assert spec.model.target == "__cell__:build_model" and spec.data.target == "__cell__:load_data"
    code = os.path.join(spec.run_dir, "code.pkl")
    assert stat.S_IMODE(os.stat(code).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(spec.job_path).st_mode) == 0o600
    assert spec.code.sha256 == cj.code.sha256
    out = subprocess.run([sys.executable, "-c", (
        "import sys; from orchestrator.core import cellcode; "
        "from orchestrator.core.specload import load; "
        f"spec = load({spec.job_path!r}); f = cellcode.load(spec.job_path, spec.code); "
        "print(f['load_data'](3)['train'][0].tolist(), sorted(f['build_model']()))")],
        env=fake_env({}), capture_output=True, text=True, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[1.0,", "1.0625,", "1.125]", "['a',", "'b',", "'c']"]


def test_the_worker_resolves_carried_functions_as_it_resolves_module_functions(tmp_path):
    from orchestrator.train import jobcode

    spec, _ = frozen(tmp_path, data={"factory": cell()["load_data"], "args": {"n": 2}})
    assert spec.data.args == {"n": 2}
    assert jobcode.resolve(spec, spec.data, "data")()["train"][0].tolist() == [1.0, 1.0625]


FINGERPRINT = ("import linecache, sys; from orchestrator.core import cellcode\n"
               "src = open(sys.argv[1]).read(); fn = sys.argv[2]\n"
               "linecache.cache[fn] = (len(src), None, src.splitlines(True), fn)\n"
               "ns = {'__name__': '__main__'}; exec(compile(src, fn, 'exec'), ns)\n"
               "c = cellcode.carry([(k, k, ns[k]) for k in ('build_model', 'load_data')], 'x')\n"
               "print(c.fingerprint, c.sha256)\n")


def _fingerprint(tmp_path, src, filename, seed):
    p = tmp_path / f"src-{seed}.py"
    p.write_text(src)
    out = subprocess.run([sys.executable, "-c", FINGERPRINT, str(p), filename],
                         env=dict(fake_env({}), PYTHONHASHSEED=str(seed)),
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.integration
def test_the_same_cell_in_another_kernel_has_the_same_fingerprint_and_changed_code_another(
        tmp_path):
    """The pickle's bytes hold the cell's file name, its line numbers and random class ids;
    the fingerprint (in the training hash) must not, or a recycled VM could never resume."""
    fp1, sha1 = _fingerprint(tmp_path, CELL, "/tmp/ipykernel_11/5.py", 1)
    fp2, sha2 = _fingerprint(tmp_path, "\n\n\n" + CELL, "/tmp/ipykernel_22/9.py", 2)
    assert sha1 != sha2, "the pickles differ between kernels (file name, lines, class ids)"
    assert fp1 == fp2
    changed, _ = _fingerprint(tmp_path, CELL.replace("x + self.by", "x - self.by"), "/a.py", 3)
    assert changed != fp1
    helper, _ = _fingerprint(tmp_path, CELL.replace("SCALE = 16.0", "SCALE = 8.0"), "/a.py", 4)
    assert helper != fp1


def test_the_training_hash_covers_the_code_and_a_yaml_job_s_hash_is_unchanged(tmp_path,
                                                                                fake_job):
    a, _ = api.keyword_job(job(cell(), tmp_path))
    b, _ = api.keyword_job(job(cell(CELL.replace("16.0", "8.0")), tmp_path))
    assert a.training_relevant()["code"] == a.code.fingerprint
    assert a.training_hash() != b.training_hash()
    assert "code" not in load(fake_job()).training_relevant()


@pytest.mark.integration
def test_the_supervisor_freezes_the_code_only_once_the_run_is_admitted(tmp_path):
    """A refused resume (changed code) must leave the run's own code file as it was."""
    class FakeWorkerSupervisor(Supervisor):
        def __init__(self, spec, **kw):
            super().__init__(spec, commands=fake_commands(), env=fake_env({}), out=io.StringIO(),
                             **kw)

    spec, cj = api.keyword_job(job(cell(), tmp_path))
    assert FakeWorkerSupervisor(spec, cell=cj).run() == 0
    code = tmp_path / "run" / "code.pkl"
    before = code.read_bytes()
    assert before == cj.code.blob
    spec2, cj2 = api.keyword_job(job(cell(CELL.replace("16.0", "8.0")), tmp_path))
    with pytest.raises(IncompatibleResume, match=r"code changed since it was created.*"
                                                 r"force=True"):
        FakeWorkerSupervisor(spec2, cell=cj2).run()
    assert code.read_bytes() == before


def _refused(spec, match):
    cellcode._LOADED.clear()
    with pytest.raises(cellcode.CodeError, match=match):
        cellcode.load(spec.job_path, spec.code)


def test_a_code_file_not_this_user_s_own_is_never_unpickled(tmp_path, monkeypatch):
    spec, _ = frozen(tmp_path)
    code = os.path.join(spec.run_dir, "code.pkl")
    cellcode._LOADED.clear()
    assert set(cellcode.load(spec.job_path, spec.code)) == {"build_model", "load_data"}

    os.chmod(code, 0o620)
    _refused(spec, r"code.pkl: refused: writable by group or others \(mode 620\)")
    os.chmod(code, 0o600)
    os.chmod(spec.job_path, 0o602)  # the job names the hash: held to the same rule
    _refused(spec, r"job.yaml: refused: writable by group or others")
    os.chmod(spec.job_path, 0o600)

    if os.getuid() == 0:
        os.chown(code, 12345, -1)
    else:
        monkeypatch.setattr(cellcode.os, "getuid", lambda: os.geteuid() + 1)
    _refused(spec, r"code.pkl: refused: owned by uid \d+, not by this user")
    if os.getuid() == 0:
        os.chown(code, 0, -1)
    monkeypatch.undo()

    os.rename(code, code + ".real")
    os.symlink(code + ".real", code)
    _refused(spec, r"a symlink is refused")
    os.unlink(code)
    other = cellcode.carry([("model", "build_model", print)], "x").blob
    with open(code, "wb") as f:  # the same user's, but not the code the frozen job names
        f.write(other)
    os.chmod(code, 0o600)
    _refused(spec, r"refused: its sha256 is [0-9a-f]{12}, the frozen job .* records")


def test_the_worker_names_a_refused_code_file_by_its_key(tmp_path):
    from orchestrator.train import jobcode

    spec, _ = frozen(tmp_path)
    os.chmod(os.path.join(spec.run_dir, "code.pkl"), 0o666)
    cellcode._LOADED.clear()
    with pytest.raises(jobcode.JobError, match=r"job.yaml: key 'model': .*code.pkl: refused"):
        jobcode.resolve(spec, spec.model, "model")


def _carry_error(tmp_path, key, fn):
    run = tmp_path / "run"
    with pytest.raises(cellcode.CarryError) as err:
        api.run(**job(cell(), tmp_path, **{key: fn}))
    assert not run.exists(), "the run directory was touched before the error"
    assert err.value.key == key
    return str(err.value)


def test_a_function_that_cannot_be_carried_fails_at_once_naming_it_and_the_cause(tmp_path):
    lock = threading.Lock()
    ns = cell("""
        def read_all():
            return LOG.read()

        def load_data():
            return read_all()
        """)
    ns["LOG"] = open(__file__)
    try:
        msg = _carry_error(tmp_path, "data", ns["load_data"])
    finally:
        ns["LOG"].close()
    assert msg.startswith("orchestrator.run(): key 'data': load_data cannot be carried")
    assert "load_data -> read_all -> 'LOG' is an open file" in msg
    assert "open the file inside the function" in msg

    msg = _carry_error(tmp_path, "model", lambda: lock.locked())
    assert "<lambda> -> 'lock' is a lock, which cannot be pickled (TypeError: cannot pickle " \
           "'_thread.lock' object)" in msg


def test_a_tensorflow_tensor_of_the_calling_process_is_refused(tmp_path):
    tf = pytest.importorskip("tensorflow")
    t = tf.constant([1.0, 2.0])  # pickle would copy it off the device; the worker needs its own
    msg = _carry_error(tmp_path, "data", lambda: {"train": (t, t)})
    assert "<lambda> -> 't' is a TensorFlow EagerTensor of this process" in msg
    assert "create it inside the function" in msg


def test_a_jax_array_held_by_the_kernel_is_refused_naming_the_key_and_the_reference(tmp_path):
    jnp = pytest.importorskip("jax.numpy")
    w = jnp.ones((2, 2))  # pickle would copy it off the device into a NumPy array
    msg = _carry_error(tmp_path, "model", lambda: w @ w)  # in the closure
    assert "key 'model'" in msg
    assert "<lambda> -> 'w' is a JAX ArrayImpl of this process" in msg
    assert "on this process's devices" in msg and "create it inside the function" in msg
    ns = cell("""
        def load_data():
            return {"train": (WEIGHTS, WEIGHTS)}
        """)
    ns["WEIGHTS"] = jnp.arange(4.0)  # in the cell's globals
    msg = _carry_error(tmp_path, "data", ns["load_data"])
    assert "key 'data'" in msg and "load_data -> 'WEIGHTS' is a JAX ArrayImpl" in msg


@pytest.mark.integration
def test_the_kernel_s_jax_arrays_are_recognised_without_importing_jax(tmp_path):
    # The supervisor side never imports a framework: a jax.Array is known by its class's
    # module, here in a Python where jax cannot be imported at all.
    site = tmp_path / "site"
    code = textwrap.dedent("""
        import sys
        from orchestrator.core import cellcode
        ArrayImpl = type("ArrayImpl", (), {"__module__": "jaxlib._jax"})
        x = ArrayImpl()
        try:
            cellcode.carry([("data", "load_data", lambda: x)], "orchestrator.run()")
        except cellcode.CarryError as exc:
            print(exc)
        print("jax imported:", any(m.split(".")[0] in ("jax", "jaxlib") for m in sys.modules))
        """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=noimport.env_without(site, "jax", "jaxlib"), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "key 'data'" in p.stdout and "'x' is a JAX ArrayImpl of this process" in p.stdout
    assert "jax imported: False" in p.stdout and noimport.attempted(site) == []


def test_keyword_jobs_take_job_file_values_and_refuse_others(tmp_path):
    import numpy as np

    ns = cell()
    spec, cj = api.keyword_job(job(ns, tmp_path, epochs=np.int64(3), callbacks=[
        ns["build_model"], {"early_stopping": {"patience": 2}}],
        compile={"loss": "mse", "metrics": ("mae",)}))
    assert spec.epochs == 3 and spec.compile.metrics == ("mae",)
    assert spec.callbacks[0].factory.target == "__cell__:build_model"
    assert cj.code.names == ("build_model", "load_data")  # the same function carried once
    data = cell("def data():\n    return 1\n")["data"]
    spec, cj = api.keyword_job(job(ns, tmp_path, model=data, data=lambda: 2,
                                   learning_rate=lambda epoch, lr: lr))
    assert (spec.model.target, spec.data.target, spec.learning_rate.function.target) == (
        "__cell__:data", "__cell__:data_1", "__cell__:learning_rate")
    assert spec.job_dir == os.getcwd() and spec.job_path == str(tmp_path / "run" / "job.yaml")
    with pytest.raises(SpecError, match=r"key 'compile.optimizer': expected what a job file "
                                        r"holds .* got object"):
        api.keyword_job(job(ns, tmp_path, compile={"loss": "mse", "optimizer": object()}))
    with pytest.raises(SpecError, match=r"key 'seed': a function is carried for model, data, "
                                        r"learning_rate or an item of callbacks only"):
        api.keyword_job(job(ns, tmp_path, seed=ns["helper"]))
    with pytest.raises(SpecError, match=r"orchestrator.run\(\): key 'epochs': expected an "
                                        r"integer >= 1"):
        api.keyword_job(job(ns, tmp_path, epochs=0))
    with pytest.raises(TypeError, match="a job file or the job's keys, not both"):
        api.run("job.yaml", model=ns["build_model"])


def test_a_job_file_naming_cell_code_without_its_code_section_is_refused(write_job):
    with pytest.raises(SpecError, match=r"key 'model': '__cell__:...' names a function carried "
                                        r"by orchestrator.run\(model=function\)"):
        load(write_job("""
            name: x
            model: __cell__:build_model
            data: m:load
            epochs: 1
            batch_size: 1
        """))

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_WORKER = os.path.join(ROOT, "tests", "fakes", "fake_worker.py")


@pytest.fixture(autouse=True)
def _local_tier_in_pytest_tmp(tmp_path_factory, monkeypatch):
    """The default local checkpoint tier lives under the temp dir: keep it in pytest's own
    temp dirs (for this process and the workers it starts), not in /tmp."""
    import tempfile

    tmp = tmp_path_factory.mktemp("tmpdir")
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)


# The Keras backends a guarantee is proven on: an end-to-end test marked ``@BOTH_BACKENDS``
# runs once per backend, its job saying ``backend: <backend>`` (the ``backend`` fixture).
BACKENDS = ("tensorflow", "jax")
BOTH_BACKENDS = pytest.mark.parametrize("backend", BACKENDS)


@pytest.fixture
def backend():
    """The job's backend where a test does not ask for both (``@BOTH_BACKENDS``)."""
    return "tensorflow"


@pytest.fixture(scope="session")
def _jax_compile_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax-compile-cache"))


@pytest.fixture(autouse=True)
def _shared_jax_compile_cache(_jax_compile_cache, monkeypatch):
    """One JAX compile cache for every worker the suite starts (JAX_COMPILATION_CACHE_DIR is
    taken as the local cache: train/compile_cache.py): each test's run directory is new, and
    compiling the same digits model afresh in each JAX worker cost 4-8 s a start."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", _jax_compile_cache)


@pytest.fixture(autouse=True)
def _keras_backend(backend, monkeypatch):
    """Every process a test starts resolves ``backend: auto`` (the default) to the test's
    backend through ``KERAS_BACKEND``, as a user switches it; and no test depends on what a
    ``~/.keras/keras.json`` of this machine says."""
    monkeypatch.setenv("KERAS_BACKEND", backend)


@pytest.fixture
def write_job(tmp_path):
    """Write a job file (YAML text, dedented) into tmp_path and return its path."""

    def write(text: str, name: str = "job.yaml") -> str:
        p = tmp_path / name
        p.write_text(textwrap.dedent(text))
        return str(p)

    return write


@pytest.fixture
def fake_job(write_job, tmp_path):
    """A valid job for the fake worker; keyword arguments replace top-level keys."""

    def make(epochs=4, restarts="{max: 2, backoff: {initial: 0.01, max: 0.05}}", extra=""):
        return write_job(f"""
            name: fake
            model: nowhere:build
            data: nowhere:load
            epochs: {epochs}
            batch_size: 8
            run_dir: {tmp_path / 'run'}
            restarts: {restarts}
            {extra}
        """)

    return make


def fake_worker_cmd(spec, attempt):
    return [sys.executable, FAKE_WORKER, spec.job_path, "--run-dir", spec.run_dir,
            "--attempt", str(attempt)]


def fake_standby_cmd(spec, attempt, mode):
    return fake_worker_cmd(spec, attempt) + ["--standby", mode]


def fake_env(plan: dict) -> dict:
    import json

    env = dict(os.environ, FAKE_PLAN=json.dumps(plan))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def supervise(job, plan, out=None, standby=False):
    """Run the real supervisor with the fake worker; return (rc, its output, journal events).
    ``standby``: with the fake standby (else none, as with any custom worker command)."""
    import io

    from orchestrator.core.journal import Journal
    from orchestrator.core.spec import load
    from orchestrator.supervise.supervisor import Supervisor

    out = out if out is not None else io.StringIO()
    sup = Supervisor(load(job), worker_cmd=fake_worker_cmd, out=out, env=fake_env(plan),
                     standby_cmd=fake_standby_cmd if standby else None)
    rc = sup.run()
    return rc, out.getvalue(), Journal(sup.rd.journal).events()


@pytest.fixture
def finished_run(fake_job, tmp_path):
    """A run dir written by the real supervisor: attempt 1 SIGKILLed at epoch 3, then done."""
    plan = {"exit_at_epoch": {"1": [3, -9]}, "batches": 3, "epoch_s": 0.2}
    rc, _, _ = supervise(fake_job(epochs=5), plan)
    assert rc == 0
    return str(tmp_path / "run")


@pytest.fixture
def failed_run(fake_job, tmp_path):
    """A run dir written by the real supervisor: every attempt fails, the budget (2) is spent."""
    rc, _, _ = supervise(fake_job(epochs=4, restarts="{max: 2, backoff: {initial: 0.01}}"),
                         {"exit": {str(n): 1 for n in range(1, 10)}})
    assert rc == 1
    return str(tmp_path / "run")


def supervisor_process(job, plan):
    """The real supervisor with the fake worker, in its own process (to signal or kill it)."""
    code = ("import sys; sys.path.insert(0, %r); sys.path.insert(0, %r)\n"
            "from conftest import fake_worker_cmd\n"
            "from orchestrator.core.spec import load\n"
            "from orchestrator.supervise.supervisor import Supervisor\n"
            "sys.exit(Supervisor(load(%r), worker_cmd=fake_worker_cmd).run())\n"
            % (os.path.join(ROOT, "tests"), ROOT, job))
    return subprocess.Popen([sys.executable, "-c", code], env=fake_env(plan),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def live(job, run_dir) -> "RunDir":
    """Where a running job's journal and heartbeat are written first (its local control folder,
    mirrored to the run directory every 0.5 s): tests that act at a precise moment read here."""
    from orchestrator.core.rundir import RunDir
    from orchestrator.core.spec import load

    return RunDir.for_spec(load(str(job), run_dir=str(run_dir)))


def wait_until(cond, timeout=120, what="condition"):
    """Poll ``cond`` until it gives something true (returned); an AssertionError naming
    ``what`` after ``timeout`` s. For tests that act when a run reaches a moment."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{what} not met within {timeout} s")


def wait_while_running(proc, cond, what="condition", cap=900):
    """Poll ``cond`` until it gives something true (returned), for as long as the supervisor
    ``proc`` runs: an AssertionError with its output as soon as it exits first. No timing of
    an idle machine here: every wait of a supervisor before and between steps is bounded by the
    supervisor itself and journaled with its bound (Ray's connection and placement, the
    start-up and hang timeouts), so one that cannot go on exits. ``cap`` only keeps a test
    machine that stopped altogether from holding the suite forever."""
    import time

    deadline = time.time() + cap
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"{what}: the supervisor exited {proc.returncode} first:\n{out}")
        time.sleep(0.05)
    raise AssertionError(f"{what} not met in {cap} s while the supervisor ran")

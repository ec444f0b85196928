import logging
import platform
import subprocess
import textwrap

import pytest

from helpers import Said, supervise
from orchestrator.core import logs

# TensorFlow's import asks platform.processor(), which runs `uname -p` once per process: asked
# here, before any test, so that the fast tier's guard below never takes the first test to
# import TensorFlow in a process for one that starts processes (under pytest-xdist that test
# is any of them).
platform.processor()


def pytest_configure(config):
    """The test processes' own Keras is on TensorFlow, whichever test comes first: Keras reads
    KERAS_BACKEND once, at its import, and a test on JAX sets it for the processes it starts
    (``_keras_backend``). The unit tests that build models in this process assert TensorFlow's
    texts; in a process whose first import came from a JAX test, they failed. (pytest-xdist's
    controller runs no test: it imports nothing.)"""
    import os

    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras

    assert keras.backend.backend() == "tensorflow", keras.backend.backend()


# The modules whose tests run longest (end-to-end runs with several kills, groups of workers)
# go first, ordered by their longest test in a suite run: with `pytest -n`, a worker that takes
# one of them last would finish alone, minutes after the others (seen: 5 of the suite's 17
# minutes with one worker of three busy; later, the last 60 s at half the cores idle, with the
# 130 s LoRA and write-back tests, not listed then, started late).
LONGEST_FIRST = ("test_e2e_standby.py", "test_e2e_lora.py", "test_e2e_colab_writeback.py",
                 "test_e2e_multiworker.py", "test_e2e_objectstore.py", "test_e2e_anymodel.py",
                 "test_e2e_colab.py", "test_e2e.py", "test_e2e_preemptions.py",
                 "test_e2e_async.py", "test_e2e_outage.py")


SOAK_ENV = "ORCHESTRATOR_SOAK"


def pytest_collection_modifyitems(items):
    """End-to-end tests first, the longest modules ahead of them; then the integration tier;
    then the unit tests, which fill the gaps at the end (a stable sort: the order within a
    module stays as written). The ``soak`` tier is skipped unless ORCHESTRATOR_SOAK=1."""
    import os

    if os.environ.get(SOAK_ENV) != "1":
        skip = pytest.mark.skip(reason=f"soak tier (helpers.SOAK): {SOAK_ENV}=1 scripts/test "
                                       f"-m soak runs it")
        for item in items:
            if item.get_closest_marker("soak"):
                item.add_marker(skip)
    def rank(item):
        if item.get_closest_marker("e2e"):
            name = item.path.name
            return (0, LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST))
        return (1 if item.get_closest_marker("integration") else 2, 0)
    items.sort(key=rank)


@pytest.fixture(autouse=True)
def _the_fast_tier_starts_no_process(request, monkeypatch):
    """The fast tier (neither ``integration`` nor ``e2e``) runs in seconds because none of its
    tests starts a process: one that does fails here, naming the marker it needs, instead of
    slowing every run of the tier down unnoticed."""
    if any(request.node.get_closest_marker(m) for m in ("integration", "e2e")):
        yield
        return
    started = []
    real = subprocess.Popen._execute_child

    def record(self, args, *rest, **kw):
        started.append(args)
        return real(self, args, *rest, **kw)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", record)
    yield
    assert not started, (f"a test of the fast tier started a process ({started[0]!r}): mark "
                         f"it @pytest.mark.integration")


@pytest.fixture(autouse=True)
def _local_tier_in_pytest_tmp(tmp_path_factory, monkeypatch):
    """The default local checkpoint tier lives under the temp dir: keep it in pytest's own
    temp dirs (for this process and the workers it starts), not in /tmp."""
    import tempfile

    tmp = tmp_path_factory.mktemp("tmpdir")
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)


@pytest.fixture(autouse=True, scope="session")
def _log_lines_as_in_the_cli():
    """The orchestrator's log lines reach this process's streams as they do in the CLI and the
    worker (core/logs.configure): a test reading them with capsys sees what a user sees."""
    logs.configure()


@pytest.fixture
def said(caplog):
    """What the orchestrator's loggers said during the test (helpers.Said): caplog's handler
    on the ``orchestrator`` logger itself, which does not propagate (core/logs.configure)."""
    logger = logging.getLogger(logs.ROOT)
    logger.addHandler(caplog.handler)
    yield Said(caplog)
    logger.removeHandler(caplog.handler)


@pytest.fixture
def backend():
    """The job's backend where a test does not ask for both (``helpers.BOTH_BACKENDS``)."""
    return "tensorflow"


@pytest.fixture(scope="session")
def _jax_compile_cache(tmp_path_factory):
    """The session's, shared by its pytest-xdist processes (pytest-of-USER/pytest-N): a
    program compiled by one test's worker is a hit in every other's."""
    import os

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    (root / "jax-compile-cache").mkdir(exist_ok=True)
    return str(root / "jax-compile-cache")


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

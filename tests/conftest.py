import textwrap

import pytest

from helpers import supervise


@pytest.fixture(autouse=True)
def _local_tier_in_pytest_tmp(tmp_path_factory, monkeypatch):
    """The default local checkpoint tier lives under the temp dir: keep it in pytest's own
    temp dirs (for this process and the workers it starts), not in /tmp."""
    import tempfile

    tmp = tmp_path_factory.mktemp("tmpdir")
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)


@pytest.fixture
def backend():
    """The job's backend where a test does not ask for both (``helpers.BOTH_BACKENDS``)."""
    return "tensorflow"


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

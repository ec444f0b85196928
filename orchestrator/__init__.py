"""A resilient training orchestrator for preemptible runtimes (Colab TPU/GPU).

``orchestrator.run("job.yaml")`` (or ``orchestrator.run(model=fn, data=fn, ...)``) starts or
resumes a run. This package's top level never
imports TensorFlow: the supervisor must be able to repair a broken TensorFlow install.
"""
__version__ = "0.1.0"


def run(job: str | None = None, run_dir: str | None = None, **kwargs) -> int:
    """Start or resume the run of ``job``, a job file, or of a job given by its keys
    (``model=build_model, data=load_data, name=..., epochs=..., batch_size=...``, functions
    defined in the cell); see ``orchestrator.api.run``."""
    from orchestrator.api import run as _run

    return _run(job, run_dir=run_dir, **kwargs)


def status(run_dir: str) -> dict:
    """Where the run in ``run_dir`` stands (what ``orchestrator status --json`` prints)."""
    from orchestrator.ops.status import run_status

    return run_status(run_dir)


def report(run_dir: str, out_dir: str | None = None) -> str:
    """Write the run's HTML report (and its SVG charts); return the page's path."""
    from orchestrator.ops.report import write_report

    return write_report(run_dir, out_dir)["report.html"]


def run_on_colab(job: str, **kwargs) -> int:
    """Carry the run of ``job`` through Colab runtimes from this machine, getting a new one
    whenever one is lost (``orchestrator colab``); see ``orchestrator.api.run_on_colab``."""
    from orchestrator.api import run_on_colab as _run_on_colab

    return _run_on_colab(job, **kwargs)

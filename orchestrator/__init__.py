"""A resilient training orchestrator for preemptible runtimes (Colab TPU/GPU).

``orchestrator.run("job.yaml")`` starts or resumes a run. This package's top level never
imports TensorFlow: the supervisor must be able to repair a broken TensorFlow install.
"""
__version__ = "0.1.0"


def run(job: str, run_dir: str | None = None) -> int:
    """Start or resume the run of ``job`` (see ``orchestrator.api.run``)."""
    from orchestrator.api import run as _run

    return _run(job, run_dir=run_dir)


def status(run_dir: str) -> dict:
    """Where the run in ``run_dir`` stands (what ``orchestrator status --json`` prints)."""
    from orchestrator.ops.status import run_status

    return run_status(run_dir)


def report(run_dir: str, out_dir: str | None = None) -> str:
    """Write the run's HTML report (and PNGs); return the page's path."""
    from orchestrator.ops.report import write_report

    return write_report(run_dir, out_dir)["report.html"]

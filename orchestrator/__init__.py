"""A resilient training orchestrator for preemptible runtimes (Colab TPU/GPU).

``orchestrator.run("job.yaml")`` starts or resumes a run. This package's top level never
imports TensorFlow: the supervisor must be able to repair a broken TensorFlow install.
"""
__version__ = "0.1.0"


def run(job: str, run_dir: str | None = None) -> int:
    from .api import run as _run

    return _run(job, run_dir=run_dir)

"""The notebook and CLI entry point: ``orchestrator.run("job.yaml")``."""
from __future__ import annotations

from .spec import load
from .supervisor import Supervisor


def run(job: str, run_dir: str | None = None) -> int:
    """Start or resume the run of ``job``; return 0 when it completed, non-zero otherwise."""
    return Supervisor(load(job, run_dir=run_dir)).run()

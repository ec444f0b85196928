"""The notebook and CLI entry point: ``orchestrator.run("job.yaml")``.

In a notebook the supervisor runs in the kernel: its progress goes to the cell (a live bar,
since ipykernel's stream renders carriage returns), and interrupting the cell (SIGINT) stops
the worker's whole process group cleanly, journals the stop and then raises KeyboardInterrupt,
as any interrupted call does, so that "run all" stops there. Running the cell again resumes.
"""
from __future__ import annotations

import dataclasses
import signal

from orchestrator.core.rundir import EXIT_STOPPED
from orchestrator.core.spec import SpecError, load
from orchestrator.supervise.supervisor import Supervisor


def run(job: str, run_dir: str | None = None, raise_on_interrupt: bool = True,
        faults=(), force: bool = False, remount=None, workers: int | None = None,
        engine: str | None = None) -> int:
    """Start or resume the run of ``job``; return 0 when it completed, non-zero otherwise.

    With ``raise_on_interrupt`` (the notebook's default), a SIGINT (cell interrupt, Ctrl-C)
    raises KeyboardInterrupt once the worker is stopped; otherwise it returns 130.
    ``faults``: fault specs to inject (see orchestrator.recovery.faults), each fired once per run.
    ``force`` resumes even though the model, data or optimizer changed; ``remount(dir)`` is
    called when the durable checkpoint folder's mount is lost (overrides checkpoint.remount).
    """
    spec = load(job, run_dir=run_dir)
    if workers is not None or engine is not None:  # --workers / --engine
        if workers is not None and workers < 1:
            raise SpecError(job, None, "workers", f"expected at least 1 worker, got {workers}")
        spec = dataclasses.replace(spec, workers=spec.workers if workers is None else workers,
                                   engine=engine or spec.engine)
    sup = Supervisor(spec, faults=faults, force=force, remount=remount)
    rc = sup.run()
    if rc == EXIT_STOPPED and raise_on_interrupt and sup.stop_signal == signal.SIGINT:
        raise KeyboardInterrupt("orchestrator: the worker was stopped; run the cell again "
                                "to resume")
    return rc

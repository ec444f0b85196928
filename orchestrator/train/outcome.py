"""How an attempt ended, as the supervisor reads it: the exit status and the error record.

``EXIT_CONFIG`` says "this will fail the same way again" (a ``JobError``, a ``DataError``, a
checkpoint that does not fit the model): the supervisor does not retry it. ``EXIT_PREEMPTED``
follows a SIGTERM the attempt journaled. Every other failure exits 1 with its traceback.
"""
from __future__ import annotations

import logging
import os
import time
import traceback

from orchestrator.core.osutil import write_json_atomic
from orchestrator.core.rundir import EXIT_CONFIG, EXIT_PREEMPTED, RunDir
from orchestrator.train import multiworker, state
from orchestrator.train.errors import DataError, JobError
from orchestrator.train.preemption import Preempted

log = logging.getLogger("orchestrator.train.worker")  # the [worker] lines of the attempt's log


def write_error_record(layout: RunDir, attempt: int, exc: BaseException, progress,
                       fatal: bool) -> None:
    record = {
        "time": round(time.time(), 3),
        "attempt": attempt,
        "pid": os.getpid(),
        "type": type(exc).__name__,
        "qualified_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "fatal": fatal,
        **(progress.as_dict() if progress else {}),
    }
    rank = multiworker.rank()
    if rank:
        record["rank"] = rank
    try:
        write_json_atomic(layout.error_record(attempt, rank), record)
    except OSError as write_exc:  # the run dir itself may be what failed (Drive gone)
        log.warning(f"could not write the error record: {write_exc}")


def guarded(layout: RunDir, attempt: int, progress, body) -> int:
    """Run an attempt's ``body`` and turn how it ended into the exit status the supervisor
    classifies: an error record for every failure, ``EXIT_CONFIG`` for the job's own."""
    try:
        try:
            summary = body()
        except (DataError, state.StateMismatch) as exc:
            raise JobError(str(exc)) from exc
    except Preempted as exc:
        exc.journal(layout.journal, attempt, progress)
        return EXIT_PREEMPTED
    except JobError as exc:
        write_error_record(layout, attempt, exc, progress, fatal=True)
        log.warning(f"error: {exc}")
        return EXIT_CONFIG
    except Exception as exc:  # noqa: BLE001 - every failure is recorded for the supervisor
        write_error_record(layout, attempt, exc, progress, fatal=False)
        traceback.print_exc()
        return 1
    log.info(f"done: {summary['epochs']} epochs, weights sha256 {summary['fingerprint']}")
    return 0

"""A worker process: ``python -m orchestrator.train.worker JOB --run-dir D --attempt N``.

It reads the job file, starts the process's watchers (the parent's death, SIGTERM, a stack
dump), then runs one attempt (attempt.py) and exits with the status the supervisor classifies
(outcome.py). With ``--standby`` it is a standby instead (standby.py).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from orchestrator.core import logs
from orchestrator.core.backends import ENV_BACKEND
from orchestrator.core.heartbeat import Position, register_stack_dump
from orchestrator.core.rundir import EXIT_CONFIG, EXIT_PREEMPTED, RunDir
from orchestrator.core.spec import SpecError
from orchestrator.core.specload import load
from orchestrator.core.standbymode import StandbyMode
from orchestrator.train import attempt, backends, standby
from orchestrator.train.outcome import guarded
from orchestrator.train.preemption import Preempted, PreemptionNotice

log = logging.getLogger("orchestrator.train.worker")  # its name as __main__ too (python -m)


def _watch_parent(poll: float = 0.5) -> None:
    """Exit when the supervisor that started us dies: an orphan must not keep training."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(poll)
            if os.getppid() != parent:
                log.warning("supervisor is gone; exiting")
                os._exit(EXIT_CONFIG + 1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.train.worker")
    p.add_argument("job")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--attempt", type=int, required=True,
                   help="the attempt (a standby: the one it is meant to become)")
    p.add_argument("--standby", choices=StandbyMode.STARTED,
                   help="warm up and wait for a promotion line on stdin")
    args = p.parse_args(argv)
    t_start = time.time()
    logs.configure()  # the [worker] lines of the attempt's log
    notice = PreemptionNotice().install()
    try:  # from here a SIGTERM raises Preempted until training (a traceback and exit 1 before)
        return _start(args, notice, t_start)
    except Preempted:  # before training: nothing new to save
        return EXIT_PREEMPTED


def _start(args, notice: PreemptionNotice, t_start: float) -> int:
    with notice.deferred():  # until it knows where its journal is
        register_stack_dump()
        _watch_parent()
        try:
            spec = load(args.job, run_dir=args.run_dir,
                        backend=os.environ.get(ENV_BACKEND) or None)
        except SpecError as exc:
            log.warning(str(exc))
            return EXIT_CONFIG
        layout = RunDir.for_spec(spec).make()
    if notice.requested:
        Preempted(None, notice.received_at).journal(layout.journal, args.attempt, Position())
        return EXIT_PREEMPTED
    if args.standby:
        return standby.serve(spec, layout, args.attempt, args.standby, notice, t_start)
    progress = Position()
    return backends.leave(guarded(layout, args.attempt, progress,
                                  lambda: attempt.cold(spec, layout, args.attempt, progress,
                                                       t_start, notice)))


if __name__ == "__main__":
    sys.exit(main())

"""Command line: argument parsing only; the work is done by the API modules."""
from __future__ import annotations

import argparse
import json
import sys

from orchestrator.core import logs
from orchestrator.core.lock import LockedError
from orchestrator.core.rundir import RunDirUnreachable
from orchestrator.core.backends import BACKENDS
from orchestrator.core.spec import ENGINES, SpecError
from orchestrator.supervise.admission import IncompatibleResume
from orchestrator.supervise.group import EngineUnavailable
from orchestrator.recovery.faults import FaultSpecError

EXIT_USAGE = 2
EXIT_LOCKED = 3
EXIT_RUN_DIR = 4


def _cmd_run(args) -> int:
    from orchestrator.api import run
    from orchestrator.recovery.faults import FaultSpecError, parse

    try:
        faults = [parse(f).text for f in args.fault]
    except FaultSpecError as exc:
        print(f"orchestrator: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # no flush of Drive here: `orchestrator colab` runs this command in a runtime and flushes
    # from outside once it has brought the export home (a flush unmounts Drive under it)
    return run(args.job, run_dir=args.run_dir, raise_on_interrupt=False, faults=faults,
               force=args.force, workers=args.workers, engine=args.engine,
               backend=args.backend, flush_drive=False)


def _cmd_colab(args) -> int:
    from orchestrator.api import run_on_colab

    try:
        return run_on_colab(args.job, tpu=args.tpu, gpu=args.gpu, run_dir=args.run_dir,
                            local_dir=args.local_dir, colab_cli=args.colab_cli,
                            colab_auth=args.colab_auth,
                            max_sessions=args.max_sessions or None, max_hours=args.max_hours,
                            max_runtime_hours=args.max_runtime_hours, poll_s=args.poll,
                            lock_retry_s=args.lock_retry, backoff_s=args.backoff,
                            unreachable_s=args.unreachable)
    except (ValueError, FileNotFoundError) as exc:
        print(f"orchestrator colab: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _cmd_diagnose(args) -> int:
    from orchestrator.ops.diagnose import diagnose
    from orchestrator.core.specload import load

    try:
        if args.file == "-":
            text = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8", errors="replace") as f:
                text = f.read()
    except OSError as exc:
        print(f"orchestrator: {args.file}: cannot read: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    spec = load(args.job) if args.job else None
    print(json.dumps(diagnose(text, spec), indent=2))
    return 0


def _cmd_export(args) -> int:
    """Run the exporter in its own process: it imports TensorFlow, this process must not."""
    import os
    import subprocess

    if not os.path.isfile(os.path.join(args.run_dir, "run.json")):
        print(f"orchestrator: {args.run_dir}: not a run directory (no run.json)", file=sys.stderr)
        return EXIT_USAGE
    cmd = [sys.executable, "-m", "orchestrator.train.export", args.run_dir]
    if args.out:
        cmd += ["--out", args.out]
    return subprocess.call(cmd)


def _cmd_status(args) -> int:
    from orchestrator.ops.status import format_status, run_status

    try:
        s = run_status(args.run_dir)
    except FileNotFoundError as exc:
        print(f"orchestrator: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(s, indent=2, default=str) if args.json else format_status(s))
    return 0


def _cmd_report(args) -> int:
    from orchestrator.ops.report import write_report

    try:
        paths = write_report(args.run_dir, args.out)
    except FileNotFoundError as exc:
        print(f"orchestrator: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"report: {paths['report.html']}")
    for name, path in paths.items():
        if name != "report.html":
            print(f"chart:  {path}")
    return 0


def _cmd_doctor(args) -> int:
    from orchestrator.ops import doctor

    checks = doctor.run(args.job, args.run_dir, run_probe=not args.no_probe)
    print(doctor.as_json(checks) if args.json else doctor.format_checks(checks))
    return 1 if doctor.would_fail(checks) else 0


def _cmd_schema(args) -> int:
    from orchestrator.core.jobfile import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orchestrator",
                                description="Resilient Keras training on preemptible runtimes.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="start, or resume, the run of a job")
    r.add_argument("job", help="the job's YAML file")
    r.add_argument("--run-dir", help="override the job's run_dir")
    r.add_argument("--backend", choices=BACKENDS,
                   help="override the job's backend (Keras on TensorFlow or on JAX)")
    r.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="inject a fault (repeatable), fired once per run: kill@step=N, "
                        "hang@step=N, raise=KIND@step=N, exit=CODE@step=N, "
                        "corrupt-checkpoint@epoch=N, storage-down@step=N,for=SECONDS, "
                        "kill@checkpoint=N, delay-checkpoint@checkpoint=N,for=SECONDS, "
                        "disk-full@checkpoint=N, kill@export=1, slow-steps@step=N,for=SECONDS; "
                        "any with ,rank=R: only that worker of a group fires it")
    r.add_argument("--force", action="store_true",
                   help="resume even though the model, data or optimizer changed")
    r.add_argument("--workers", type=int, metavar="N",
                   help="train with N workers (MultiWorkerMirroredStrategy); overrides `workers:`")
    r.add_argument("--engine", choices=ENGINES,
                   help="who places the workers: local processes or Ray; overrides `engine:`")
    r.set_defaults(func=_cmd_run)
    _colab_parser(sub)
    d = sub.add_parser("diagnose", help="classify a log or traceback (FILE, or - for stdin)")
    d.add_argument("file")
    d.add_argument("--job", help="use this job's recovery policy (default: the defaults)")
    d.set_defaults(func=_cmd_diagnose)
    e = sub.add_parser("export", help="write the run's model for inference (.keras, "
                       ".weights.h5, SavedModel)")
    e.add_argument("run_dir")
    e.add_argument("--out", help="where to write (default RUN_DIR/export)")
    e.set_defaults(func=_cmd_export)
    s = sub.add_parser("status", help="where a run stands")
    s.add_argument("run_dir")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=_cmd_status)
    rp = sub.add_parser("report", help="an HTML page with charts of a run (SVG, self-contained)")
    rp.add_argument("run_dir")
    rp.add_argument("-o", "--out", help="output folder (default RUN_DIR/report)")
    rp.set_defaults(func=_cmd_report)
    d = sub.add_parser("doctor", help="check this runtime; exit 1 when a run would fail")
    d.add_argument("job", nargs="?", help="the job's YAML file (its run_dir, strategy and code)")
    d.add_argument("--run-dir", help="the run directory to check (default: the job's, or .)")
    d.add_argument("--no-probe", action="store_true",
                   help="do not import TensorFlow or JAX in a probe process nor build the "
                        "job's model (faster, less certain)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=_cmd_doctor)
    sub.add_parser("schema", help="print the JSON Schema of a job file (for an editor's YAML "
                   "support)").set_defaults(func=_cmd_schema)
    return p


def _wrap(*paragraphs: str) -> str:
    import textwrap

    return "\n\n".join(textwrap.fill(p, 79) for p in paragraphs)


def _colab_parser(sub) -> None:
    from orchestrator.colab.kinds import GPUS, TPUS

    c = sub.add_parser(
        "colab", help="carry a run through Colab runtimes from this machine: allocate, train, "
                      "get a new runtime when one is lost (Google's Colab CLI)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_wrap("Run this on a machine that stays up (a laptop, Cloud Shell, a small "
                          "VM). It allocates a Colab runtime through Google's Colab CLI (`pip "
                          "install google-colab-cli`, signed in once), mounts Drive there, sends "
                          "this orchestrator and the job's folder, starts `orchestrator run` "
                          "with the run directory on Drive, follows it, and allocates again "
                          "whenever the runtime is lost: the run resumes from Drive. At the end "
                          "it stops the runtime and downloads the export."),
        epilog=_wrap(f"runtime kinds: --tpu {{{','.join(TPUS)}}}, --gpu {{{','.join(GPUS)}}}, "
                     f"neither: CPU.",
                     "budgets: --max-sessions (runtimes given, default 10), --max-hours (wall "
                     "time since the first request), --max-runtime-hours (runtime hours held); "
                     "a capacity refusal or usage limit backs off (--backoff, doubling to 30 "
                     "min) until a budget is spent.",
                     "exit status: 0 completed (export downloaded), 1 the run failed, 2 bad job "
                     "or arguments, 5 the Colab CLI needs you to sign in (the line says what to "
                     "run), 6 a budget is spent (run it again to go on), 130 interrupted."))
    c.add_argument("job", help="the job's YAML file, on this machine (its folder is sent)")
    kind = c.add_mutually_exclusive_group()
    kind.add_argument("--tpu", choices=TPUS, help="a TPU runtime")
    kind.add_argument("--gpu", choices=GPUS, help="a GPU runtime")
    c.add_argument("--run-dir", help="the run directory on Drive as the runtime sees it "
                   "(default /content/drive/MyDrive/orchestrator-runs/NAME)")
    c.add_argument("--local-dir", help="where the outer journal and the export go here "
                   "(default colab-runs/NAME)")
    c.add_argument("--colab-cli", metavar="PATH", help="the Colab CLI's executable (default "
                   "$ORCHESTRATOR_COLAB_CLI, else `colab` on the PATH)")
    c.add_argument("--colab-auth", choices=("oauth2", "adc"),
                   help="the Colab CLI's --auth, given to each of its calls (default: the "
                        "CLI's own, oauth2)")
    c.add_argument("--max-sessions", type=int, default=10, metavar="N",
                   help="runtimes to use at most (0: no limit; default 10)")
    c.add_argument("--max-hours", type=float, metavar="H",
                   help="stop after H hours from the first request")
    c.add_argument("--max-runtime-hours", type=float, metavar="H",
                   help="stop once the runtimes held add up to H hours")
    c.add_argument("--backoff", type=float, default=60.0, metavar="S",
                   help="first wait after a refusal (default 60 s; doubles, 30 min at most)")
    c.add_argument("--poll", type=float, default=30.0, metavar="S",
                   help="seconds between two looks at the runtime (default 30)")
    c.add_argument("--lock-retry", type=float, default=30.0, metavar="S",
                   help="seconds before starting again when a lost runtime's lock is not "
                        "stale yet (default 30)")
    c.add_argument("--unreachable", type=float, default=300.0, metavar="S",
                   help="a runtime that gives no answer this long counts as lost (default 300)")
    c.set_defaults(func=_cmd_colab)


# The errors whose message is the whole answer, and the exit status each gives.
EXIT_CODES = {SpecError: EXIT_USAGE, IncompatibleResume: EXIT_USAGE, EngineUnavailable: EXIT_USAGE,
              FaultSpecError: EXIT_USAGE, LockedError: EXIT_LOCKED, RunDirUnreachable: EXIT_RUN_DIR}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure()
    try:
        return args.func(args)
    except tuple(EXIT_CODES) as exc:  # a message meant for the user as it is, no traceback
        print(f"orchestrator: {exc}", file=sys.stderr)
        return next(code for kind, code in EXIT_CODES.items() if isinstance(exc, kind))


if __name__ == "__main__":
    sys.exit(main())

"""The notebook and CLI entry point: ``orchestrator.run("job.yaml")``, or a job defined in the
cell itself: ``orchestrator.run(model=build_model, data=load_data, name=..., epochs=..., ...)``.

In a notebook the supervisor runs in the kernel: its progress goes to the cell (a live bar,
since ipykernel's stream renders carriage returns), and interrupting the cell (SIGINT) stops
the worker's whole process group cleanly, journals the stop and then raises KeyboardInterrupt,
as any interrupted call does, so that "run all" stops there. Running the cell again resumes.

A job given as keywords takes the keys of a job file; its functions (``model``, ``data``,
``learning_rate``, ``callbacks`` items) are carried to the worker by value
(``core/cellcode.py``), so they may be defined in the cell or in a script's ``__main__``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import numbers
import os
import signal

import yaml

from orchestrator.checkpoint.settle import policy_for
from orchestrator.colab import remote
from orchestrator.core import cellcode
from orchestrator.core.rundir import EXIT_STOPPED, RunDir
from orchestrator.core.spec import CELL_MODULE, SpecError
from orchestrator.core.specload import load
from orchestrator.core.specload import load_mapping
from orchestrator.supervise.supervisor import Supervisor

log = logging.getLogger(__name__)

SOURCE = "orchestrator.run()"  # what names a keyword job's mistakes, as a file names a YAML's
_FUNCTION_KEYS = ("model", "data", "learning_rate")  # and each item of callbacks


def run(job: str | None = None, run_dir: str | None = None, raise_on_interrupt: bool = True,
        faults=(), force: bool = False, remount=None, workers: int | None = None,
        engine: str | None = None, backend: str | None = None, flush_drive: bool = True,
        **job_keys) -> int:
    """Start or resume the run of ``job`` (a job file), or of the job given by ``job_keys``
    (``model=function, data=function, name=..., epochs=..., batch_size=...`` and any other key
    of a job file); return 0 when it completed, non-zero otherwise.

    With ``raise_on_interrupt`` (the notebook's default), a SIGINT (cell interrupt, Ctrl-C)
    raises KeyboardInterrupt once the worker is stopped; otherwise it returns 130.
    ``faults``: fault specs to inject (see orchestrator.recovery.faults), each fired once per run.
    ``force`` resumes even though the model, data, optimizer or carried code changed;
    ``remount(dir)`` is called when the durable checkpoint folder's mount is lost (overrides
    checkpoint.remount). ``backend`` (auto | tensorflow | jax) overrides the job's.
    ``flush_drive``: on Colab, once the run completed on Drive (a write-back cache,
    checkpoint/settle.py), push the cache to the cloud (this unmounts Drive) and say what is
    not settled.
    """
    if job is not None and job_keys:
        raise TypeError(f"orchestrator.run: give a job file or the job's keys, not both "
                        f"(got {job!r} and {', '.join(sorted(job_keys))})")
    if job is None:
        if not job_keys:
            raise TypeError("orchestrator.run: give a job file, or the job's keys "
                            "(model=function, data=function, name=..., epochs=..., "
                            "batch_size=...)")
        given = {"workers": workers, "engine": engine,  # keys of the job: frozen with it
                 "backend": backend}
        spec, cell = keyword_job(dict(job_keys, **{k: v for k, v in given.items()
                                                   if v is not None}), run_dir)
    else:
        spec, cell = load(job, run_dir=run_dir, backend=backend), None
        if workers is not None or engine is not None:  # --workers / --engine
            if workers is not None and workers < 1:
                raise SpecError(job, None, "workers", f"expected at least 1 worker, got {workers}")
            spec = dataclasses.replace(spec, workers=spec.workers if workers is None else workers,
                                       engine=engine or spec.engine)
    sup = Supervisor(spec, faults=faults, force=force, remount=remount, cell=cell)
    rc = sup.run()
    if rc == 0 and flush_drive and _on_colab() and policy_for(
            spec.checkpoint, RunDir(spec.run_dir).checkpoints).writeback:
        settle_drive(spec.run_dir, spec.checkpoint)
    if rc == EXIT_STOPPED and raise_on_interrupt and sup.stop_signal == signal.SIGINT:
        raise KeyboardInterrupt("orchestrator: the worker was stopped; run the cell again "
                                "to resume")
    return rc


def _on_colab() -> bool:
    try:
        return importlib.util.find_spec("google.colab") is not None
    except ModuleNotFoundError:
        return False


def settle_drive(run_dir: str, ck) -> dict | None:
    """The notebook's end of a run on Colab: what ``orchestrator colab`` does before it stops a
    runtime (colab/remote.flush_drive), in this kernel; says what is still not settled."""
    found = remote.run_here(remote.flush_drive(
        run_dir, ck.flush_timeout, ck.writeback_quiet_s, ck.writeback_bytes_per_s,
        ck.writeback_margin)) or {}
    if found.get("ok"):
        log.info(f"Drive flushed in {found.get('seconds')} s: the final checkpoint, the export "
                 f"and the journal are in the cloud. Drive is unmounted now; "
                 f"drive.mount('/content/drive') mounts it again")
    else:
        log.warning(f"Drive could not be flushed ({found.get('error')}): "
                    f"{', '.join(found.get('not_settled') or []) or 'nothing'} may not have "
                    f"reached the cloud yet; keep this runtime a few minutes")
    return found


def keyword_job(job_keys: dict, run_dir: str | None = None):
    """The spec of a job given as keywords and what the supervisor freezes into its run
    directory: the job as YAML (its functions named ``__cell__:name``) and the carried code.
    Every mistake, a function that cannot be carried included, is raised here, before any
    worker starts."""
    functions: list = []
    job = {k: _plain(v, k, functions, may_carry=k in _FUNCTION_KEYS or k == "callbacks")
           for k, v in job_keys.items()}
    if run_dir is not None:
        job["run_dir"] = os.fspath(run_dir)
    carried = cellcode.carry(functions, SOURCE)
    job["code"] = {"file": cellcode.CODE_FILE, "sha256": carried.sha256,
                   "fingerprint": carried.fingerprint}
    spec = load_mapping(job, SOURCE, run_dir)
    job["run_dir"] = spec.run_dir
    text = (f"# Frozen by orchestrator.run(...) from {os.getcwd()}: the functions named "
            f"{CELL_MODULE}:name are\n# in {cellcode.CODE_FILE}, next to this file.\n"
            + yaml.safe_dump(job, sort_keys=False))
    # the worker runs where the call was made: relative paths in the functions mean the same
    spec = dataclasses.replace(spec, job_path=RunDir(spec.run_dir).job_copy, job_dir=os.getcwd())
    return spec, cellcode.CellJob(text, carried)


def _plain(value, key: str, functions: list, may_carry: bool = False):
    """``value`` as a job file would hold it (tuples as lists, NumPy numbers as numbers), a
    function where one may be carried replaced by its ``__cell__:name`` target."""
    if callable(value) and may_carry and key != "callbacks":
        taken = {n: f for _, n, f in functions}
        name = next((n for n, f in taken.items() if f is value), None)
        if name is None:
            name = getattr(value, "__name__", "")
            if not name.isidentifier() or name in taken:  # a lambda; two functions of a name
                base = name = key.replace("[", "_").replace("]", "").replace(".", "_")
                while name in taken:
                    name = f"{base}_{len(taken)}"
            functions.append((key, name, value))
        return f"{CELL_MODULE}:{name}"
    if isinstance(value, dict):
        if may_carry and key != "callbacks" and "factory" in value:  # {factory: fn, args: {}}
            return {k: _plain(v, f"{key}.{k}", functions, may_carry=k == "factory")
                    for k, v in value.items()}
        return {str(k): _plain(v, f"{key}.{k}", functions) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{key}[{i}]", functions, may_carry=key == "callbacks")
                for i, v in enumerate(value)]
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if callable(value):
        raise SpecError(SOURCE, None, key, f"a function is carried for {', '.join(_FUNCTION_KEYS)}"
                        f" or an item of callbacks only; got {cellcode.label(value)}")
    raise SpecError(SOURCE, None, key, f"expected what a job file holds (text, a number, true or "
                    f"false, a list, a mapping), got {type(value).__name__}; build such objects "
                    f"inside the functions")


def run_on_colab(job: str, tpu: str | None = None, gpu: str | None = None,
                 run_dir: str | None = None, local_dir: str | None = None,
                 colab_cli: str | None = None, colab_auth: str | None = None,
                 max_sessions: int | None = 10,
                 max_hours: float | None = None, max_runtime_hours: float | None = None,
                 poll_s: float = 30.0, lock_retry_s: float = 30.0, backoff_s: float = 60.0,
                 unreachable_s: float = 300.0, remote_env: dict | None = None, out=None) -> int:
    """Carry the run of ``job`` (a job file on this machine) through Colab runtimes, from a
    machine that stays up (``orchestrator colab``; orchestrator/colab/loop.py): allocate one of
    the kind asked (``tpu="v5e1"``, ``gpu="T4"``, neither: CPU) through Google's Colab CLI,
    train there with the run directory on Drive, get another when it is lost; return 0 when
    the run completed (its export is then in ``local_dir``), else the loop's exit status.

    The job file is checked here first, so that a mistake costs no runtime. ``run_dir`` is
    where the run lives on Drive as a runtime sees it (default
    ``/content/drive/MyDrive/orchestrator-runs/NAME``); ``local_dir`` where the outer journal
    and the export go on this machine (default ``colab-runs/NAME``); ``colab_auth`` the CLI's
    ``--auth`` (oauth2 or adc)."""
    from orchestrator.colab.colabcli import ColabCLI, executable
    from orchestrator.colab.kinds import runtime_kind
    from orchestrator.colab.loop import ColabLoop, Plan
    from orchestrator.colab.policy import Backoff, Budgets

    spec = load(job)
    kind = runtime_kind(tpu=tpu, gpu=gpu)
    run_dir = run_dir or f"/content/drive/MyDrive/orchestrator-runs/{spec.name}"
    if not run_dir.startswith("/content/drive/"):
        raise ValueError(f"--run-dir {run_dir}: expected a folder under /content/drive/ (Drive, "
                         f"as a runtime sees it): the run must outlive the runtime")
    plan = Plan(job=job, name=spec.name, kind=kind, run_dir=run_dir.rstrip("/"),
                local_dir=local_dir or os.path.join("colab-runs", spec.name),
                budgets=Budgets(max_sessions=max_sessions, max_hours=max_hours,
                                max_runtime_hours=max_runtime_hours),
                backoff=Backoff(initial_s=backoff_s, max_s=max(backoff_s, 1800.0)),
                poll_s=poll_s, lock_retry_s=lock_retry_s, unreachable_s=unreachable_s,
                remote_env=dict(remote_env or {}))
    return ColabLoop(plan, ColabCLI(executable(colab_cli), auth=colab_auth), out=out).run()

"""Loading a job file: YAML with line numbers, validated by the models of ``jobfile.py``, into
the frozen ``spec.JobSpec``.

Every error names the file, the line, the key and what was expected, and every mistake of a
file is reported at once. Only ``yaml.SafeLoader`` is used: a job file must never be able to
run code by being parsed.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.core import jobfile
from orchestrator.core.backends import BACKENDS, resolve as resolve_backend
from orchestrator.core.jobfile import CELL_MODULE, SCHEDULE_TAGS, JobFile
from orchestrator.core.rundir import TENSORBOARD_DIR, default_local_dir
from orchestrator.core.spec import (CallbackSpec, CheckpointSpec, CodeSpec, CompileSpec,
                                    CrashLoopSpec, ExportSpec, Factory, JobSpec, LearningRateSpec,
                                    RecoverySpec, RestartSpec, Rung, SpecError, TensorBoardSpec,
                                    object_store_problem)

# --------------------------------------------------------------------------------------------
# YAML with line numbers


def _compose(text: str, path: str) -> tuple[Any, dict]:
    """Parse YAML safely; return the data and a map from key path to line (1-based)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(path, line, None, f"invalid YAML: {problem}") from None
    finally:
        loader.dispose()
    lines: dict = {}

    def walk(n, prefix):
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                lines[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(n, yaml.SequenceNode):  # list items: callbacks[0]
            for i, v in enumerate(n.value):
                lines[f"{prefix}[{i}]"] = v.start_mark.line + 1
                walk(v, f"{prefix}[{i}]")

    walk(node, "")
    return data, lines


TOP_KEYS = frozenset(JobFile.model_fields)
_PLAIN_KEYS = ({f.name for f in dataclasses.fields(JobSpec)} & TOP_KEYS) - {
    "model", "data", "run_dir", "compile", "checkpoint", "restarts", "learning_rate", "callbacks",
    "worker_resources", "recovery", "tensorboard", "export", "code", "backend"}  # the same value in both
_MAPPING_ERRORS = ("model_type", "model_attributes_type", "dict_type")


def load(path: str, run_dir: str | None = None, backend: str | None = None) -> JobSpec:
    """Read and validate a job file. ``run_dir`` and ``backend`` override the file's."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise SpecError(path, None, None, f"cannot read the job file: {exc.strerror}") from None
    data, lines = _compose(text, path)
    if data is None:
        raise SpecError(path, None, None, "the job file is empty; expected a mapping with "
                        "name, model, data, epochs and batch_size")
    return load_mapping(data, path, run_dir, lines, backend)


def load_mapping(data, path: str, run_dir: str | None = None, lines=None,
                 backend: str | None = None) -> JobSpec:
    """Validate a job given as a mapping (what the YAML of a job file holds), every mistake at
    once, named by ``path`` (the file, or the call that gave the mapping) and the key."""
    lines = lines or {}
    if not isinstance(data, dict):
        raise SpecError(path, None, "(top level)",
                        f"expected a mapping, got {type(data).__name__}")
    errors = [SpecError(path, _line(lines, k), k, expected) for k, expected in _uncarried(data)]
    if backend is not None and backend not in BACKENDS:
        errors.append(SpecError(path, None, "backend",
                                f"expected one of {', '.join(BACKENDS)}, got {backend!r}"))
    try:
        job = JobFile.model_validate(data)
    except ValidationError as exc:
        errors += [_problem(e, path, lines) for e in exc.errors()]
    if errors:
        raise SpecError.combined(errors)
    return _spec(job, path, run_dir, backend, lines)


def _problem(error: dict, path: str, lines: dict) -> SpecError:
    """A pydantic error in the job file's words: its file:line, its dotted key, and what was
    expected (the models' own messages; pydantic's for the rest)."""
    key = _key(error["loc"])
    kind, msg, value = error["type"], error["msg"], error["input"]
    if kind == "missing":
        return SpecError(path, _line(lines, key.rpartition(".")[0]), key,
                         "required key is missing")
    if kind in ("job_file", "unknown_key"):
        expected = msg
    elif kind in _MAPPING_ERRORS:
        expected = f"expected a mapping, got {value!r}"
    else:
        expected = f"{msg[:1].lower()}{msg[1:]}, got {value!r}"
    return SpecError(path, _line(lines, key), key, expected)


def _key(loc: tuple) -> str:
    """``('restarts', 'backoff', 'max')`` -> ``restarts.backoff.max``; list items as ``[i]``;
    the schedule a learning_rate error was checked against is no key of the file."""
    key = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            key += f"[{part}]"
        elif not (part in SCHEDULE_TAGS and i and loc[i - 1] == "learning_rate"):
            key += f".{part}" if key else str(part)
    return key


def _line(lines: dict, key: str) -> int | None:
    """The line of ``key``, else of the nearest enclosing key the file has."""
    while key:
        if key in lines:
            return lines[key]
        key = key[:max(key.rfind("."), key.rfind("["), 0)]
    return None


def _uncarried(data: dict) -> list[tuple[str, str]]:
    """A factory naming ``__cell__:function`` needs the ``code`` section that carries it
    (written by ``orchestrator.run(model=fn, ...)`` into the frozen job)."""
    def names_cell(v) -> bool:
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            return any(names_cell(x) for x in v)
        return isinstance(v, str) and v.startswith(CELL_MODULE + ":")

    if "code" in data:
        return []
    return [(k, f"'{CELL_MODULE}:...' names a function carried by orchestrator.run({k}="
                f"function), but the job has no 'code' section naming its file")
            for k in ("model", "data", "learning_rate", "callbacks") if names_cell(data.get(k))]


def _spec(job: JobFile, path: str, run_dir: str | None, backend: str | None,
          lines: dict) -> JobSpec:
    """The frozen spec of a valid job file: paths made absolute, defaults that depend on the
    run filled, and the backend resolved (core/backends.py), so that the spec, its training
    hash and the run say which backend trains, never "auto"."""
    rd = run_dir if run_dir is not None else job.run_dir or os.path.join("runs", job.name)
    rd = os.path.abspath(os.path.expanduser(rd))
    return JobSpec(
        **{k: getattr(job, k) for k in _PLAIN_KEYS},
        model=_factory(job.model), data=_factory(job.data),
        run_dir=rd, job_path=os.path.abspath(path), job_dir=os.path.dirname(os.path.abspath(path)),
        compile=CompileSpec(**job.compile.model_dump()) if job.compile else None,
        checkpoint=_checkpoint(job, rd, path, lines),
        restarts=RestartSpec(**_flat(job.restarts, ("backoff",))),
        learning_rate=_learning_rate(job.learning_rate) if job.learning_rate else None,
        callbacks=tuple(_callback(c) for c in job.callbacks),
        worker_resources=tuple(sorted(job.worker_resources.items())),
        recovery=_recovery(job.recovery),
        tensorboard=(TensorBoardSpec(_tensorboard_dir(job.tensorboard.dir, rd),
                                     job.tensorboard.every_steps) if job.tensorboard else None),
        export=ExportSpec(**job.export.model_dump()),
        code=CodeSpec(**job.code.model_dump()) if job.code else None,
        backend=resolve_backend(backend or job.backend)[0],
    )


def _flat(section, nested: tuple = ()) -> dict:
    """A section's values by the runtime spec's names: a nested ``backoff: {max: 60}`` is the
    field ``backoff_max``."""
    out = {}
    for name in type(section).model_fields:
        value = getattr(section, name)
        if name in nested:
            out.update({f"{name}_{k}": v for k, v in _flat(value).items()})
        else:
            out[name] = value
    return out


def _factory(call) -> Factory:
    return Factory(call.factory, dict(call.args))


def _learning_rate(lr) -> LearningRateSpec:
    if isinstance(lr, jobfile.FactoryCall):
        return LearningRateSpec(schedule="function", function=_factory(lr))
    return LearningRateSpec(schedule=lr.schedule,
                            params=lr.model_dump(exclude={"schedule"}, exclude_none=True))


def _callback(c) -> CallbackSpec:
    if c.factory:
        return CallbackSpec(factory=Factory(c.factory, dict(c.args)))
    return CallbackSpec(name=c.name, args=dict(c.args))


def _recovery(r) -> RecoverySpec:
    ladders = tuple((kind, tuple(Rung(action, times) for action, times in ladder))
                    for kind, ladder in r.ladders if ladder is not None)
    return RecoverySpec(**dict(_flat(r, ("wait",)), ladders=ladders,
                               crash_loop=CrashLoopSpec(**r.crash_loop.model_dump())))


def _tensorboard_dir(d: str | None, run_dir: str) -> str:
    """A relative log directory is in the run directory: the logs travel with the run."""
    return os.path.normpath(os.path.join(run_dir, os.path.expanduser(d or TENSORBOARD_DIR)))


def _checkpoint(job: JobFile, run_dir: str, path: str, lines: dict) -> CheckpointSpec:
    c = job.checkpoint
    local = (os.path.abspath(os.path.expanduser(c.local_dir)) if c.local_dir
             else default_local_dir(job.name, run_dir))
    if os.path.normpath(local) == os.path.normpath(os.path.join(run_dir, "checkpoints")):
        key = "checkpoint.local_dir"
        raise SpecError(path, _line(lines, key), key, "expected a local folder other than the run "
                        "directory's checkpoints/ (that is the durable tier)")
    if c.durable and (problem := object_store_problem(c.durable)):
        key = "checkpoint.durable"  # the URL's form is the schema's; its library is checked here
        raise SpecError(path, _line(lines, key), key, problem)
    best = c.keep_best
    return CheckpointSpec(**dict(
        _flat(c, ("upload_backoff", "writeback")), local_dir=local,
        keep_best=best.metric if best else None,
        keep_best_mode=best.mode if best else CheckpointSpec.keep_best_mode))

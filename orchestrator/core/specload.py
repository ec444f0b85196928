"""Loading a job file: YAML with line numbers into the dataclasses of ``spec.py``.

Every error names the file, the line, the key and what was expected, and every such mistake of
a file is reported at once. Each field's default is read from its dataclass field, never
written here again. Only ``yaml.SafeLoader`` is used: a job file must never be able to run code
by being parsed. The typed reader and the key sets derived from the dataclasses are in
``specread.py``.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import yaml

from orchestrator.core.backends import BACKENDS, resolve as resolve_backend
from orchestrator.core.kinds import ACTIONS, KINDS
from orchestrator.core.standbymode import StandbyMode
from orchestrator.core.specread import Reader, keys, subkeys
from orchestrator.core.spec import (_FACTORY_RE, BUILTIN_CALLBACKS, CELL_MODULE, ENGINES,
                                    SCHEDULES, STANDBY_MODES, STRATEGIES, CallbackSpec,
                                    CheckpointSpec, CodeSpec, CompileSpec, CrashLoopSpec,
                                    JobSpec, LearningRateSpec, RecoverySpec, RestartSpec, Rung,
                                    SCHEDULE_PARAMS, CosineParams, SpecError, StepDecayParams,
                                    TensorBoardSpec)

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

    walk(node, "")
    return data, lines


# Each default is declared once, on its dataclass field; the loader reads it from there.
_RS, _CK, _RC, _CL = RestartSpec(), CheckpointSpec(), RecoverySpec(), CrashLoopSpec()
_TB, _CM = TensorBoardSpec(), CompileSpec()
_SD, _CO = StepDecayParams(), CosineParams()
_JOB = {f.name: f.default for f in dataclasses.fields(JobSpec)
        if f.default is not dataclasses.MISSING}


# job_path and job_dir say where the job file is, not what it says: load fills them.
TOP_KEYS = keys(JobSpec, internal=("job_path", "job_dir"))
RECOVERY_KEYS = keys(RecoverySpec, nested=("wait",))


def _ladder(r: Reader, value, key: str) -> tuple:
    """``[restart, {reinit_accelerator: 2}, {restart: budget}]`` -> Rungs."""
    if not isinstance(value, list):
        r.fail(key, f"expected a list of actions (e.g. [restart, {{halve_batch: 2}}]), "
               f"got {value!r}")
    rungs = []
    for item in value:
        action, times = (item, 1) if isinstance(item, str) else (
            next(iter(item.items())) if isinstance(item, dict) and len(item) == 1 else (None, 0))
        if action not in ACTIONS:
            r.fail(key, f"expected actions from {', '.join(ACTIONS)}, got {item!r}")
        if times == "budget":
            times = None
        elif isinstance(times, bool) or not isinstance(times, int) or times < 1:
            r.fail(key, f"{action}: expected a count >= 1 or 'budget', got {times!r}")
        rungs.append(Rung(action, times))
    return tuple(rungs)


def _recovery(r: Reader, data) -> RecoverySpec:
    c = r.mapping(data, "recovery", RECOVERY_KEYS)
    ladders = ()
    if "ladders" in c:
        lad = r.mapping(c["ladders"], "recovery.ladders", set(KINDS))
        ladders = tuple((k, _ladder(r, v, f"recovery.ladders.{k}")) for k, v in lad.items())
    w = r.mapping(c.get("wait", {}), "recovery.wait", subkeys(RecoverySpec, "wait"))
    cl = r.mapping(c.get("crash_loop", {}), "recovery.crash_loop", keys(CrashLoopSpec))
    return RecoverySpec(
        ladders=ladders,
        reinstall_tensorflow=r.boolean(c, "reinstall_tensorflow", "recovery.reinstall_tensorflow",
                                       _RC.reinstall_tensorflow),
        reinstall_max=r.integer(c, "reinstall_max", "recovery.reinstall_max", _RC.reinstall_max, 0),
        pip=r.strings(c, "pip", "recovery.pip"),
        pip_args=r.strings(c, "pip_args", "recovery.pip_args"),
        tensorflow_distributions=r.strings(c, "tensorflow_distributions",
                                           "recovery.tensorflow_distributions",
                                           _RC.tensorflow_distributions),
        verify_import=r.string(c, "verify_import", "recovery.verify_import", _RC.verify_import),
        halve_batch=r.boolean(c, "halve_batch", "recovery.halve_batch", _RC.halve_batch),
        min_batch_size=r.integer(c, "min_batch_size", "recovery.min_batch_size", _RC.min_batch_size, 1),
        strategy_fallback=r.boolean(c, "strategy_fallback", "recovery.strategy_fallback",
                                    _RC.strategy_fallback),
        wait_initial=r.number(w, "initial", "recovery.wait.initial", _RC.wait_initial, 0),
        wait_max=r.number(w, "max", "recovery.wait.max", _RC.wait_max, 0),
        wait_timeout=r.number(w, "timeout", "recovery.wait.timeout", _RC.wait_timeout, 0),
        crash_loop=CrashLoopSpec(
            same_failure=r.integer(cl, "same_failure", "recovery.crash_loop.same_failure",
                                  _CL.same_failure, 2),
            failures=r.integer(cl, "failures", "recovery.crash_loop.failures", _CL.failures, 2),
            window_minutes=r.number(cl, "window_minutes", "recovery.crash_loop.window_minutes",
                                    _CL.window_minutes, 0)),
    )

_SCHEDULE_KEYS = {name: keys(cls) for name, cls in SCHEDULE_PARAMS.items()}


def _learning_rate(r: Reader, v) -> LearningRateSpec:
    """``learning_rate: module:function``, ``{factory, args}`` or ``{schedule: NAME, ...}``."""
    key = "learning_rate"
    if isinstance(v, str) or (isinstance(v, dict) and "factory" in v):
        return LearningRateSpec(schedule="function", function=r.factory_value(v, key))
    if not isinstance(v, dict) or "schedule" not in v:
        r.fail(key, f"expected a schedule mapping {{schedule: {'|'.join(SCHEDULES)}, ...}} or "
               f"'module:function' taking (epoch, lr), got {v!r}")
    name = r.string(v, "schedule", f"{key}.schedule", choices=SCHEDULES)
    r.mapping(v, key, _SCHEDULE_KEYS[name] | {"schedule"})
    p: dict = {}
    if name == "piecewise":
        for k in ("boundaries", "values"):
            if k not in v:
                raise SpecError(r.path, r.lines.get(key), f"{key}.{k}", "required key is missing")
        b, vals = v["boundaries"], v["values"]
        if (not isinstance(b, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                               and x > 0 for x in b) or b != sorted(set(b))):
            r.fail(f"{key}.boundaries", f"expected a rising list of epoch numbers > 0, got {b!r}")
        if (not isinstance(vals, list) or len(vals) != len(b) + 1 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in vals)):
            r.fail(f"{key}.values", f"expected {len(b) + 1} learning rates >= 0 (one more than "
                   f"the boundaries), got {vals!r}")
        p = {"boundaries": list(b), "values": [float(x) for x in vals]}
    else:
        if "initial" in v:
            p["initial"] = r.number(v, "initial", f"{key}.initial", minimum=0)
        if name == "step_decay":
            p["factor"] = r.number(v, "factor", f"{key}.factor", _SD.factor, 0)
            p["every"] = r.integer(v, "every", f"{key}.every", _SD.every, 1)
        else:
            p["minimum"] = r.number(v, "minimum", f"{key}.minimum", _CO.minimum, 0)
            p["warmup_epochs"] = r.integer(v, "warmup_epochs", f"{key}.warmup_epochs",
                                           _CO.warmup_epochs, 0)
            if "decay_epochs" in v:
                p["decay_epochs"] = r.integer(v, "decay_epochs", f"{key}.decay_epochs", None, 1)
    return LearningRateSpec(schedule=name, params=p)


def _callbacks(r: Reader, v) -> tuple:
    """A list of ``NAME: {args}`` built-ins, ``module:function`` or ``{factory, args}``."""
    if not isinstance(v, list):
        r.fail("callbacks", f"expected a list, e.g. [{{early_stopping: {{patience: 3}}}}, "
               f"my_module:make_callback], got {v!r}")
    out = []
    for i, item in enumerate(v):
        key = f"callbacks[{i}]"
        if isinstance(item, str) or (isinstance(item, dict) and "factory" in item):
            if isinstance(item, str) and item in BUILTIN_CALLBACKS:
                out.append(CallbackSpec(name=item))
                continue
            try:
                out.append(CallbackSpec(factory=r.factory_value(item, "callbacks")))
            except SpecError as exc:
                raise SpecError(r.path, exc.line, key, exc.expected) from None
            continue
        if (not isinstance(item, dict) or len(item) != 1
                or next(iter(item)) not in BUILTIN_CALLBACKS):
            r.fail("callbacks", f"{key}: expected one of {', '.join(BUILTIN_CALLBACKS)} "
                   f"(as NAME: {{args}}), 'module:function' or {{factory, args}}; got {item!r}")
        name, args = next(iter(item.items()))
        if args is not None and not isinstance(args, dict):
            r.fail("callbacks", f"{key}: {name}: expected a mapping of keyword arguments, "
                   f"got {args!r}")
        out.append(CallbackSpec(name=name, args=dict(args or {})))
    return tuple(out)



def _off_is_a_word(data: dict, key: str) -> dict:
    """YAML 1.1 reads a bare ``off`` as false and ``on`` as true: ``standby: off`` and
    ``standby: on`` mean the modes "off" and "on"."""
    if data.get(key) is False:
        return dict(data, **{key: StandbyMode.OFF})
    if data.get(key) is True:
        return dict(data, **{key: StandbyMode.ON})
    return data

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
    r = Reader(path, lines or {})
    try:
        spec = _read(r, data, path, run_dir, backend)
    except SpecError as exc:
        raise SpecError.combined(r.errors + [exc]) from None
    except (TypeError, AttributeError, KeyError, ValueError):
        if not r.errors:
            raise
        raise SpecError.combined(r.errors) from None  # a consequence of a mistake noted
    if r.errors:
        raise SpecError.combined(r.errors)
    return spec


def _read(r: Reader, data: dict, path: str, run_dir: str | None,
          backend: str | None = None) -> JobSpec:
    r.mapping(data, "", TOP_KEYS, {"name", "model", "data", "epochs", "batch_size"})

    name = r.string(data, "name", "name")
    if not re.match(r"^[\w.-]+$", name):
        r.fail("name", f"expected letters, digits, '.', '_' or '-' only, got {name!r}")

    compile_spec = None
    if "compile" in data:
        # no loss: a model whose train_step or compute_loss computes its own (a VAE); Keras's
        # own train_step without one is named before training (train/jobcode.first_step)
        c = r.mapping(data["compile"], "compile", keys(CompileSpec))
        opt = c.get("optimizer", _CM.optimizer)
        if not isinstance(opt, (str, dict)):
            r.fail("compile.optimizer", f"expected a name like 'adam' or a mapping "
                   f"{{class_name: ..., config: ...}}, got {opt!r}")
        if c.get("loss") is not None and not isinstance(c["loss"], (str, dict)):
            r.fail("compile.loss", f"expected a loss name like 'sparse_categorical_crossentropy', "
                   f"got {c['loss']!r}")
        metrics = c.get("metrics", [])
        if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
            r.fail("compile.metrics", f"expected a list of metric names, got {metrics!r}")
        compile_spec = CompileSpec(opt, c.get("loss"), tuple(metrics))

    job_dir = os.path.dirname(os.path.abspath(path))
    rd = run_dir if run_dir is not None else r.string(data, "run_dir", "run_dir",
                                                      os.path.join("runs", name))
    rd = os.path.abspath(os.path.expanduser(rd))
    ckpt = _checkpoint_spec(r, data.get("checkpoint", {}) if "checkpoint" in data else {},
                            name, rd)

    restarts = RestartSpec()
    if "restarts" in data:
        c = r.mapping(data["restarts"], "restarts", keys(RestartSpec, nested=("backoff",)))
        b = {}
        if "backoff" in c:
            b = r.mapping(c["backoff"], "restarts.backoff", subkeys(RestartSpec, "backoff"))
        restarts = RestartSpec(
            max=r.integer(c, "max", "restarts.max", _RS.max, 0),
            preemptions=r.integer(c, "preemptions", "restarts.preemptions", _RS.preemptions, 0),
            backoff_initial=r.number(b, "initial", "restarts.backoff.initial", _RS.backoff_initial, 0),
            backoff_max=r.number(b, "max", "restarts.backoff.max", _RS.backoff_max, 0),
            backoff_multiplier=r.number(b, "multiplier", "restarts.backoff.multiplier",
                                         _RS.backoff_multiplier, 1),
        )

    return JobSpec(
        name=name,
        model=r.factory(data, "model"),
        data=r.factory(data, "data"),
        epochs=r.integer(data, "epochs", "epochs", minimum=1),
        batch_size=r.integer(data, "batch_size", "batch_size", minimum=1),
        strategy=r.string(data, "strategy", "strategy", _JOB["strategy"], STRATEGIES),
        seed=r.integer(data, "seed", "seed", _JOB["seed"], 0),
        run_dir=rd,
        job_path=os.path.abspath(path),
        job_dir=job_dir,
        compile=compile_spec,
        checkpoint=ckpt,
        restarts=restarts,
        heartbeat_interval=r.number(data, "heartbeat_interval", "heartbeat_interval",
                                         _JOB["heartbeat_interval"], 0.05),
        deterministic=r.boolean(data, "deterministic", "deterministic", _JOB["deterministic"]),
        learning_rate=(_learning_rate(r, data["learning_rate"]) if "learning_rate" in data
                       else None),
        callbacks=_callbacks(r, data["callbacks"]) if "callbacks" in data else (),
        hang_timeout=r.number(data, "hang_timeout", "hang_timeout", _JOB["hang_timeout"], 0.1),
        startup_timeout=r.number(data, "startup_timeout", "startup_timeout", _JOB["startup_timeout"],
                                 0.1),
        stop_grace=r.number(data, "stop_grace", "stop_grace", _JOB["stop_grace"], 0),
        preempt_grace=r.number(data, "preempt_grace", "preempt_grace", _JOB["preempt_grace"], 0),
        standby=r.string(_off_is_a_word(data, "standby"), "standby", "standby",
                         _JOB["standby"], STANDBY_MODES),
        probe_interval=r.number(data, "probe_interval", "probe_interval", _JOB["probe_interval"], 0.1),
        lock_stale_after=r.number(data, "lock_stale_after", "lock_stale_after",
                                  _JOB["lock_stale_after"], 2.0),
        workers=r.integer(data, "workers", "workers", _JOB["workers"], 1),
        engine=r.string(data, "engine", "engine", _JOB["engine"], ENGINES),
        address=r.string(data, "address", "address", _JOB["address"]),
        worker_resources=_resources(r, data),
        recovery=_recovery(r, data["recovery"]) if "recovery" in data else RecoverySpec(),
        tensorboard=_tensorboard(r, data.get("tensorboard", False), rd),
        code=_code(r, data),
        backend=_backend(r, data, backend),
    )


def _backend(r: Reader, data: dict, override: str | None) -> str:
    """``backend: auto | tensorflow | jax``, resolved here (core/backends.py: from the
    environment and what is installed, importing nothing), so that the spec, its training hash
    and the run say which backend trains, never "auto"."""
    if override is not None and override not in BACKENDS:
        r.note("backend", f"expected one of {', '.join(BACKENDS)}, got {override!r}")
        override = None
    requested = override or r.string(data, "backend", "backend", _JOB["backend"], BACKENDS)
    return resolve_backend(requested)[0]


def _code(r: Reader, data: dict) -> CodeSpec | None:
    """``code: {file, sha256, fingerprint}``, written by ``orchestrator.run(model=fn, ...)``
    into the frozen job; required exactly when a factory names ``__cell__:function``."""
    def names_cell(v) -> bool:
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            return any(names_cell(x) for x in v)
        return isinstance(v, str) and v.startswith(CELL_MODULE + ":")

    cell = [k for k in ("model", "data", "learning_rate", "callbacks") if names_cell(data.get(k))]
    if "code" not in data:
        for k in cell:
            r.note(k, f"'{CELL_MODULE}:...' names a function carried by orchestrator.run("
                      f"{k}=function), but the job has no 'code' section naming its file")
        return None
    c = r.mapping(data["code"], "code", keys(CodeSpec), {"file", "sha256"})
    file = r.string(c, "file", "code.file")
    if file and (os.path.basename(file) != file or file.startswith(".")):
        r.note("code.file", f"expected a file name next to the job file, got {file!r}")
    digests = {}
    for k in ("sha256", "fingerprint"):
        v = c.get(k, "")
        if not (isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)) and k in c:
            r.note(f"code.{k}", f"expected 64 hexadecimal digits (a sha256), got {v!r}")
        digests[k] = v if isinstance(v, str) else ""
    return CodeSpec(file=file or CodeSpec.file, **digests)


def _tensorboard(r: Reader, v, run_dir: str) -> TensorBoardSpec | None:
    """``tensorboard: false | true | PATH | {dir: PATH, every_steps: N}``; a relative PATH is
    in the run directory, so that the logs travel with the run (a Drive folder)."""
    from orchestrator.core.rundir import TENSORBOARD_DIR

    if v is False or v is None:
        return None
    c = {} if v is True else {"dir": v} if isinstance(v, str) else v
    if not isinstance(c, dict):
        r.fail("tensorboard", f"expected true, false, a log directory or a mapping "
               f"{{dir: PATH, every_steps: N}}, got {v!r}")
    r.mapping(c, "tensorboard", keys(TensorBoardSpec))
    d = r.string(c, "dir", "tensorboard" if isinstance(v, str) else "tensorboard.dir",
                 TENSORBOARD_DIR)
    return TensorBoardSpec(
        dir=os.path.normpath(os.path.join(run_dir, os.path.expanduser(d or TENSORBOARD_DIR))),
        every_steps=r.integer(c, "every_steps", "tensorboard.every_steps", _TB.every_steps, 0))


CHECKPOINT_KEYS = keys(CheckpointSpec, nested=("upload_backoff", "keep_best", "writeback"))


def _checkpoint_spec(r: Reader, c, name: str, run_dir: str) -> CheckpointSpec:
    from orchestrator.core.rundir import default_local_dir

    r.mapping(c, "checkpoint", CHECKPOINT_KEYS)
    best, mode = None, _CK.keep_best_mode
    if c.get("keep_best") is not None:
        b = r.mapping(c["keep_best"], "checkpoint.keep_best", {"metric", "mode"}, {"metric"})
        best = r.string(b, "metric", "checkpoint.keep_best.metric")
        mode = r.string(b, "mode", "checkpoint.keep_best.mode", _CK.keep_best_mode,
                        ("min", "max"))
    local = r.string(c, "local_dir", "checkpoint.local_dir", None)
    local = (os.path.abspath(os.path.expanduser(local)) if local
             else default_local_dir(name, run_dir))
    if os.path.normpath(local) == os.path.normpath(os.path.join(run_dir, "checkpoints")):
        r.fail("checkpoint.local_dir", "expected a local folder other than the run directory's "
               "checkpoints/ (that is the durable tier)")
    remount = r.string(c, "remount", "checkpoint.remount", None)
    if remount is not None and remount != "colab" and not _FACTORY_RE.match(remount):
        r.fail("checkpoint.remount", f"expected 'colab' or 'module:function', got {remount!r}")
    b = {}
    if "upload_backoff" in c:
        b = r.mapping(c["upload_backoff"], "checkpoint.upload_backoff",
                      subkeys(CheckpointSpec, "upload_backoff"))
    wb = {}
    if "writeback" in c:
        wb = r.mapping(c["writeback"], "checkpoint.writeback",
                       subkeys(CheckpointSpec, "writeback"))
    return CheckpointSpec(
        every_epochs=r.integer(c, "every_epochs", "checkpoint.every_epochs", _CK.every_epochs, 1),
        keep=r.integer(c, "keep", "checkpoint.keep", _CK.keep, 1),
        every_steps=r.integer(c, "every_steps", "checkpoint.every_steps", _CK.every_steps, 1),
        every_seconds=r.number(c, "every_seconds", "checkpoint.every_seconds", _CK.every_seconds,
                                   0.1),
        keep_every_epochs=r.integer(c, "keep_every_epochs", "checkpoint.keep_every_epochs",
                                    _CK.keep_every_epochs, 1),
        keep_best=best,
        keep_best_mode=mode,
        local_dir=local,
        remount=remount,
        flush_timeout=r.number(c, "flush_timeout", "checkpoint.flush_timeout", _CK.flush_timeout, 0),
        upload_backoff_initial=r.number(b, "initial", "checkpoint.upload_backoff.initial",
                                        _CK.upload_backoff_initial, 0),
        upload_backoff_max=r.number(b, "max", "checkpoint.upload_backoff.max",
                                    _CK.upload_backoff_max, 0),
        background=r.boolean(c, "background", "checkpoint.background", _CK.background),
        durable_cache=r.string(c, "durable_cache", "checkpoint.durable_cache", _CK.durable_cache,
                               ("auto", "writeback", "none")),
        durable_max_bytes=r.integer(c, "durable_max_bytes", "checkpoint.durable_max_bytes",
                                    _CK.durable_max_bytes, 1),
        writeback_quiet_s=r.number(wb, "quiet_s", "checkpoint.writeback.quiet_s",
                                   _CK.writeback_quiet_s, 0),
        writeback_bytes_per_s=r.number(wb, "bytes_per_s", "checkpoint.writeback.bytes_per_s",
                                       _CK.writeback_bytes_per_s, 1),
        writeback_margin=r.number(wb, "margin", "checkpoint.writeback.margin",
                                  _CK.writeback_margin, 1),
    )


def _resources(r: Reader, data) -> tuple:
    """``worker_resources: {CPU: 1, GPU: 1}``: what Ray reserves for each worker."""
    if "worker_resources" not in data:
        return _JOB["worker_resources"]
    res = data["worker_resources"]
    if not isinstance(res, dict) or not res:
        return r.note("worker_resources", "expected a mapping of Ray resource names to "
                      "amounts, e.g. {CPU: 1, GPU: 1}", _JOB["worker_resources"])
    out = []
    for name, amount in res.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
            r.note(f"worker_resources.{name}", f"expected a positive number, got {amount!r}")
            continue
        out.append((str(name), float(amount)))
    return tuple(sorted(out))

"""What a job file may say: each key once, with its type, bounds, default and description.

These pydantic models have the file's own shape (``restarts: {backoff: {max: 60}}``). ``specload``
validates a file against them and builds the frozen ``spec.JobSpec`` from the result;
``orchestrator schema`` prints their JSON Schema, so that an editor completes and checks a job
file. Each check says what was expected and what the file held, because the message is read in
a notebook cell hours after the YAML was written.
"""
import os
import re
from typing import Annotated, Any, Literal, Optional, Union, get_args

from annotated_types import Ge, Gt
from pydantic import (BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationInfo,
                      create_model, field_validator)

from orchestrator.core.backends import BACKENDS
from orchestrator.core.jobtypes import (  # noqa: F401 (FACTORY_RE: read from here too)
    FACTORY_RE, TARGET, Boolean, Choice, Integer, Keywords, Number, OptionalText, Section,
    Sha256, Strings, Target, Text, _checked, _form, _is_int, _is_number, _text, mistake)
from orchestrator.core.kinds import ACTIONS, KINDS
from orchestrator.core.standbymode import StandbyMode

STRATEGIES = ("auto", "tpu", "gpu", "cpu")
SCHEDULES = ("step_decay", "cosine", "piecewise")
BUILTIN_CALLBACKS = ("early_stopping", "reduce_lr_on_plateau", "terminate_on_nan")
STANDBY_MODES = StandbyMode.SETTINGS
ENGINES = ("local", "ray")  # who places the workers of a multi-worker job
DURABLE_SCHEMES = ("gs", "s3")  # object stores a durable checkpoint copy may go to
DURABLE_CACHES = ("auto", "writeback", "none")
# The module name of the functions ``orchestrator.run(model=fn, data=fn, ...)`` carries by value
# (core/cellcode.py): ``__cell__:build_model`` is no importable module, it names a function in
# the job's ``code`` file.
CELL_MODULE = "__cell__"

def default(path: str):
    """The default of a dotted key (``restarts.backoff.max``): what a file that leaves it out
    gets, and the default of the runtime spec's field that holds it."""
    section: type[Section] = JobFile
    *outer, last = path.split(".")
    for key in outer:
        section = _section_in(section.model_fields[key].annotation)
    return section.model_fields[last].get_default(call_default_factory=True)


def _section_in(annotation) -> type[Section] | None:
    """The section a key's annotation holds (``Optional[KeepBest]``: KeepBest)."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    return next(filter(None, map(_section_in, get_args(annotation))), None)


# ---------------------------------------------------------------------------------------------
# The sections


class FactoryCall(Section):
    """A user function called with ``args`` as keyword arguments."""

    factory: Target = Field(description="the function, as module:function")
    args: Keywords = Field({}, description="keyword arguments of the call")


def _factory_form(v):
    if isinstance(v, str):
        if not FACTORY_RE.match(v):
            raise mistake(f"expected {TARGET}", v)
        return {"factory": v}
    if not isinstance(v, dict):
        raise mistake(f"expected {TARGET} or a mapping {{factory, args}}", v)
    return v


FactoryField = Annotated[FactoryCall, BeforeValidator(
    _factory_form, json_schema_input_type=Union[Target, FactoryCall])]


class Compile(Section):
    optimizer: Annotated[Union[str, dict[str, Any]], _form(
        (str, dict), "expected a name like 'adam' or a mapping {class_name: ..., config: ...}")
    ] = Field("adam", description="a Keras optimizer name, or {class_name, config}")
    loss: Annotated[Optional[Union[str, dict[str, Any]]], _form(
        (str, dict), "expected a loss name like 'sparse_categorical_crossentropy'",
        optional=True)] = Field(None, description=(
            "a Keras loss; none: the model's train_step or compute_loss computes its own"))
    metrics: Annotated[tuple[str, ...], _form(
        list, "expected a list of metric names", lambda x: all(isinstance(m, str) for m in x),
        convert=tuple)] = Field((), description="Keras metric names")


class KeepBest(Section):
    metric: Text = Field(description="the logged metric to keep the best checkpoint by")
    mode: Choice(("min", "max")) = Field("min", description="min: lower is better")


class UploadBackoff(Section):
    initial: Number(0) = Field(1.0, description="seconds before the first retry of a copy")
    max: Number(0) = Field(60.0, description="the longest wait between retries")


class Writeback(Section):
    quiet_s: Number(0) = Field(15.0, description=(
        "seconds a write-back cache leaves a file alone before it uploads it"))
    bytes_per_s: Number(1) = Field(10e6, description=(
        "the cache's upload rate until a flush on the runtime measured one"))
    margin: Number(1) = Field(2.0, description="the estimate of when a copy settled, times this")


def _remount(v) -> bool:
    return isinstance(v, str) and (v == "colab" or bool(FACTORY_RE.match(v)))


def _durable_url(v) -> bool:
    scheme, sep, rest = v.partition("://") if isinstance(v, str) else ("", "", "")
    return scheme in DURABLE_SCHEMES and bool(sep) and bool(rest.strip("/"))


class Checkpoint(Section):
    """When to checkpoint, what to keep, and the two tiers (checkpoint/tiers.py)."""

    every_epochs: Integer(1) = Field(1, description="commit at the end of every N epochs")
    keep: Integer(1) = Field(3, description="the last K verified checkpoints are kept")
    every_steps: Integer(1, optional=True) = Field(None, description=(
        "also commit within an epoch at every multiple of N steps"))
    every_seconds: Number(0.1, optional=True) = Field(None, description=(
        "also commit within an epoch every T seconds"))
    keep_every_epochs: Integer(1, optional=True) = Field(None, description=(
        "also keep one checkpoint every N epochs"))
    keep_best: Optional[KeepBest] = Field(None, description="also keep the best by a metric")
    local_dir: OptionalText = Field(None, description=(
        "the fast tier (default: <temp dir>/orchestrator/<name>-<hash of run_dir>/checkpoints)"))
    remount: Optional[Annotated[str, _checked(
        _remount, "expected 'colab' or 'module:function'")]] = Field(None, description=(
            "colab, or module:function(dir), called when the durable mount is lost"))
    flush_timeout: Number(0) = Field(600.0, description=(
        "seconds the end of a run waits for the durable copies"))
    upload_backoff: UploadBackoff = Field(UploadBackoff(), description=(
        "retries of a durable copy that failed"))
    background: Boolean = Field(True, description=(
        "write checkpoints off the training thread; false: in line"))
    durable: Optional[Annotated[str, _checked(
        _durable_url, "expected gs://bucket/prefix or s3://bucket/prefix")]] = Field(
            None, description="a bucket (gs:// or s3://) as the durable tier, in place of the run directory's checkpoints/")
    durable_cache: Choice(DURABLE_CACHES) = Field("auto", description=(
        "how the durable tier caches its copies: auto | writeback | none"))
    durable_max_bytes: Integer(1, optional=True) = Field(None, description=(
        "the durable tier's space cap; none: no cap"))
    writeback: Writeback = Field(Writeback(), description=(
        "when a copy on a write-back cache counts as in the cloud (checkpoint/settle.py)"))


class RestartBackoff(Section):
    initial: Number(0) = Field(1.0, description="seconds before the first restart")
    max: Number(0) = Field(60.0, description="the longest wait between restarts")
    multiplier: Number(1) = Field(2.0, description="each wait is the last one times this")


class Restarts(Section):
    max: Integer(0) = Field(3, description=(
        "failures of the job or the runtime since the last new checkpoint"))
    preemptions: Integer(0, optional=True) = Field(None, description=(
        "kills from outside (preemptions); none: no limit"))
    backoff: RestartBackoff = Field(RestartBackoff(), description="the wait before a restart")


class Wait(Section):
    initial: Number(0) = Field(5.0, description="seconds before probing the accelerator again")
    max: Number(0) = Field(60.0, description="the longest wait between probes")
    timeout: Number(0) = Field(600.0, description="give up waiting after this long")


class CrashLoop(Section):
    """A crash loop stops the run: the same failure, or many, within a window without a new
    checkpoint."""

    same_failure: Integer(2) = Field(3, description=(
        "the same kind at the same step this many times in a row"))
    failures: Integer(2) = Field(4, description="... or this many failures")
    window_minutes: Number(0) = Field(10.0, description="... within this window")


def _rung_form(v):
    """``restart``, ``{halve_batch: 2}`` or ``{restart: budget}`` -> (action, times)."""
    action, times = (v, 1) if isinstance(v, str) else (
        next(iter(v.items())) if isinstance(v, dict) and len(v) == 1 else (None, 0))
    if action not in ACTIONS:
        raise mistake(f"expected actions from {', '.join(ACTIONS)}", v)
    if times == "budget":
        return (action, None)
    if not _is_int(times) or times < 1:
        raise mistake(f"{action}: expected a count >= 1 or 'budget'", times)
    return (action, times)


_Action = Literal[ACTIONS]
Rung = Annotated[tuple[_Action, Optional[int]], BeforeValidator(
    _rung_form, json_schema_input_type=Union[_Action, dict[_Action, Union[
        Annotated[int, Ge(1)], Literal["budget"]]]])]
Ladder = Annotated[tuple[Rung, ...], _checked(
    lambda v: isinstance(v, list),
    "expected a list of actions (e.g. [restart, {halve_batch: 2}])", tuple)]
Ladders = create_model("Ladders", __base__=Section, __doc__=(
    "The recovery ladder of a failure kind, replacing its default: the actions in order, each "
    "a number of times in a row, or `budget`: while the restart budget lasts."),
    **{kind: (Optional[Ladder], None) for kind in KINDS})


class Recovery(Section):
    ladders: Ladders = Field(Ladders(), description="ladders replacing the defaults, by kind")
    reinstall_tensorflow: Boolean = Field(False, description=(
        "opt-in: pip-reinstall the installed TensorFlow distribution"))
    reinstall_max: Integer(0) = Field(1, description="reinstalls per run")
    pip: Strings = Field((), description="the pip command; none: python -m pip")
    pip_args: Strings = Field((), description="extra arguments to pip install (index, target)")
    tensorflow_distributions: Strings = Field(
        ("tensorflow-tpu", "tensorflow", "tensorflow-cpu"), description=(
            "the distributions a reinstall looks for, in this order"))
    verify_import: Text = Field("tensorflow", description=(
        "the module a fresh process imports to verify a reinstall"))
    halve_batch: Boolean = Field(False, description=(
        "on out_of_memory, halve the per-replica batch"))
    min_batch_size: Integer(1) = Field(1, description="the batch is never halved below this")
    strategy_fallback: Boolean = Field(False, description="fall back TPU -> GPU -> CPU")
    wait: Wait = Field(Wait(), description="wait_accelerator's probe backoff")
    crash_loop: CrashLoop = Field(CrashLoop(), description="when a crash loop stops the run")


def _schedule_check(v):
    if v not in SCHEDULES:
        raise mistake(f"expected one of {', '.join(SCHEDULES)}", v)
    return v


class StepDecay(Section):
    """The rate times ``factor`` every ``every`` epochs."""

    schedule: Annotated[Literal["step_decay"], BeforeValidator(_schedule_check)]
    initial: Number(0, optional=True) = Field(None, description=(
        "the first epoch's rate; none: the optimizer's own"))
    factor: Number(0) = Field(0.1, description="the rate is multiplied by this ...")
    every: Integer(1) = Field(1, description="... every N epochs")


class Cosine(Section):
    """A linear warm-up, then a cosine decay to ``minimum``."""

    schedule: Annotated[Literal["cosine"], BeforeValidator(_schedule_check)]
    initial: Number(0, optional=True) = Field(None, description=(
        "the rate after the warm-up; none: the optimizer's own"))
    minimum: Number(0) = Field(0.0, description="the rate at the end of the decay")
    decay_epochs: Integer(1, optional=True) = Field(None, description=(
        "epochs of the decay; none: the epochs after the warm-up"))
    warmup_epochs: Integer(0) = Field(0, description="epochs of the linear warm-up")


class Piecewise(Section):
    """``values[i]`` from epoch ``boundaries[i-1]`` on."""

    schedule: Annotated[Literal["piecewise"], BeforeValidator(_schedule_check)]
    boundaries: Annotated[list[Annotated[int, Gt(0)]], _checked(
        lambda b: isinstance(b, list) and all(_is_int(x) and x > 0 for x in b)
        and b == sorted(set(b)), "expected a rising list of epoch numbers > 0", list)] = Field(
            description="the epochs where the rate changes")
    values: list[Annotated[float, Ge(0)]] = Field(description=(
        "the rates, one more than the boundaries"))

    @field_validator("values", mode="before")
    @classmethod
    def _one_more_than_the_boundaries(cls, v, info: ValidationInfo):
        n = len(info.data["boundaries"]) + 1 if "boundaries" in info.data else None
        if not isinstance(v, list) or (n is not None and len(v) != n) or not all(
                _is_number(x) and x >= 0 for x in v):
            raise mistake(f"expected {n or 'one more than the boundaries'} learning rates >= 0 "
                          f"(one more than the boundaries)", v)
        return [float(x) for x in v]


def _schedule_form(v) -> str | None:
    if isinstance(v, str) or (isinstance(v, dict) and "factory" in v):
        return "function"
    if isinstance(v, dict) and "schedule" in v:  # an unknown one: named by StepDecay's check
        return v["schedule"] if v["schedule"] in SCHEDULES else "step_decay"
    return None


SCHEDULE_TAGS = (*SCHEDULES, "function")  # where a learning_rate error's location says which
LearningRate = Annotated[Union[
    Annotated[StepDecay, Tag("step_decay")], Annotated[Cosine, Tag("cosine")],
    Annotated[Piecewise, Tag("piecewise")], Annotated[FactoryField, Tag("function")]],
    Discriminator(_schedule_form, custom_error_type="job_file_form", custom_error_message=(
        f"expected a schedule mapping {{schedule: {'|'.join(SCHEDULES)}, ...}} or "
        "'module:function' taking (epoch, lr)"))]


class Callback(Section):
    """A Keras callback: a built-in by ``name`` with keyword ``args``, or a user ``factory``."""

    name: Choice(BUILTIN_CALLBACKS, optional=True) = None
    factory: Optional[Target] = None
    args: Keywords = {}


def _callback_form(v):
    if isinstance(v, str):
        if v in BUILTIN_CALLBACKS:
            return {"name": v}
        if not FACTORY_RE.match(v):
            raise mistake(f"expected {TARGET} or a built-in ({', '.join(BUILTIN_CALLBACKS)})", v)
        return {"factory": v}
    if isinstance(v, dict) and "factory" in v:
        return v
    if not isinstance(v, dict) or len(v) != 1 or next(iter(v)) not in BUILTIN_CALLBACKS:
        raise mistake(f"expected one of {', '.join(BUILTIN_CALLBACKS)} (as NAME: {{args}}), "
                      f"'module:function' or {{factory, args}}", v)
    name, args = next(iter(v.items()))
    if args is not None and not isinstance(args, dict):
        raise mistake(f"{name}: expected a mapping of keyword arguments", args)
    return {"name": name, "args": args or {}}


_Builtin = Literal[BUILTIN_CALLBACKS]
CallbackField = Annotated[Callback, BeforeValidator(_callback_form, json_schema_input_type=Union[
    _Builtin, Target, FactoryCall,
    Annotated[dict[_Builtin, Optional[dict[str, Any]]], Field(min_length=1, max_length=1)]])]


class TensorBoard(Section):
    dir: OptionalText = Field(None, description=(
        "the log directory; relative: in the run directory (default <run_dir>/tensorboard)"))
    every_steps: Integer(0) = Field(100, description=(
        "also write at every multiple of N global steps; 0: per epoch only"))


def _tensorboard_form(v):
    if v is False or v is None:
        return None
    if v is True or isinstance(v, str):
        return {} if v is True else {"dir": v}
    if not isinstance(v, dict):
        raise mistake("expected true, false, a log directory or a mapping "
                      "{dir: PATH, every_steps: N}", v)
    return v


class Export(Section):
    """What the end of a run writes for inference (train/export.py)."""

    at_end: Boolean = Field(True, description=(
        "export when the run completes (false: only `orchestrator export RUN_DIR` does)"))
    saved_model: Boolean = Field(True, description=(
        "a SavedModel too, where TensorFlow imports (a JAX run imports it for this alone)"))


def _export_form(v):
    if isinstance(v, bool):
        return {"at_end": v}
    if not isinstance(v, dict):
        raise mistake("expected true, false or a mapping {at_end: BOOL, saved_model: BOOL}", v)
    return v


def _file_name(v) -> bool:
    return os.path.basename(v) == v and not v.startswith(".")


FileName = _text("expected a file name next to the job file", _file_name)


class Code(Section):
    """The functions of ``orchestrator.run(model=fn, ...)``, carried by value (cellcode.py);
    written by orchestrator.run into the frozen job, never by hand."""

    file: FileName = Field(
        description="the cloudpickled functions, next to the job file")
    sha256: Sha256 = Field(description="the file's hash, checked before it is unpickled")
    fingerprint: Union[Sha256, Literal[""]] = Field("", description=(
        "identifies the code itself; part of the training hash"))


def _standby_form(v):
    """YAML 1.1 reads a bare ``off`` as false and ``on`` as true: they mean the modes."""
    return {False: StandbyMode.OFF, True: StandbyMode.ON}.get(v, v) if isinstance(v, bool) else v


Resources = Annotated[dict[str, Number(0, above=True)], Field(min_length=1), _checked(
    lambda v: isinstance(v, dict) and bool(v),
    "expected a mapping of Ray resource names to amounts, e.g. {CPU: 1, GPU: 1}")]


Name = _text("expected letters, digits, '.', '_' or '-' only",
             lambda v: re.match(r"^[\w.-]+$", v), pattern=r"^[\w.-]+$")


class JobFile(Section):
    """A job: what to train, how long, and how to survive the runtime's failures."""

    model_config = ConfigDict(title="orchestrator job")

    name: Name = Field(
        description="the run's name (its default run_dir is runs/<name>)")
    model: FactoryField = Field(description="module:function returning a keras.Model")
    data: FactoryField = Field(description=(
        "module:function returning {train: ..., validation: ...}, a dataset or a generator"))
    epochs: Integer(1) = Field(description="epochs to train")
    batch_size: Integer(1) = Field(description="per replica: the global batch is this x replicas")
    strategy: Choice(STRATEGIES) = Field("auto", description=(
        "auto: TPU, then GPU, then CPU"))
    seed: Integer(0) = Field(0, description="seeds Python, NumPy and Keras")
    run_dir: OptionalText = Field(None, description=(
        "the run's folder, relative to the current directory (default runs/<name>)"))
    compile: Optional[Compile] = Field(None, description=(
        "compile the model (none: the model factory compiles it)"))
    checkpoint: Checkpoint = Field(Checkpoint(), description="when to checkpoint, what to keep")
    restarts: Restarts = Field(Restarts(), description="the restart budgets and backoff")
    heartbeat_interval: Number(0.05) = Field(1.0, description=(
        "seconds between the worker's heartbeats"))
    deterministic: Boolean = Field(False, description=(
        "seed + op determinism: exact resume"))
    learning_rate: Optional[LearningRate] = Field(None, description=(
        "the rate of each epoch: a built-in schedule, or module:function(epoch, lr) -> lr"))
    callbacks: Annotated[tuple[CallbackField, ...], _checked(
        lambda v: isinstance(v, list), "expected a list, e.g. [{early_stopping: {patience: 3}}, "
        "my_module:make_callback]", tuple)] = Field((), description="Keras callbacks")
    hang_timeout: Number(0.1) = Field(300.0, description=(
        "no heartbeat for this long while training: a hang"))
    startup_timeout: Number(0.1) = Field(1800.0, description=(
        "... before the first training heartbeat of an attempt"))
    stop_grace: Number(0) = Field(10.0, description=(
        "seconds from SIGTERM to SIGKILL of a worker's process group"))
    preempt_grace: Number(0) = Field(20.0, description=(
        "seconds from SIGTERM to the emergency checkpoint's end (spot VMs: ~30 s)"))
    standby: Annotated[Choice(STANDBY_MODES), BeforeValidator(_standby_form)] = Field(
        StandbyMode.AUTO, description="a warm standby worker: auto | on | off | import_only")
    probe_interval: Number(0.1) = Field(60.0, description=(
        "seconds between accelerator probes while an attempt runs"))
    lock_stale_after: Number(2.0) = Field(120.0, description=(
        "a lock silent this long may be taken over (another VM)"))
    workers: Integer(1) = Field(1, description=(
        "worker processes training together (MultiWorkerMirrored)"))
    engine: Choice(ENGINES) = Field("local", description=(
        "local: processes here; ray: placed by Ray"))
    address: OptionalText = Field(None, description=(
        "the Ray cluster (default RAY_ADDRESS, else a local Ray)"))
    worker_resources: Resources = Field({"CPU": 1.0}, description=(
        "what Ray reserves for each worker"))
    recovery: Recovery = Field(Recovery(), description="what each kind of failure gets")
    tensorboard: Annotated[Optional[TensorBoard], BeforeValidator(
        _tensorboard_form, json_schema_input_type=Union[bool, str, TensorBoard, None])] = Field(
            None, description="true, a log directory, or {dir, every_steps}; false: no logs")
    export: Annotated[Export, BeforeValidator(
        _export_form, json_schema_input_type=Union[bool, Export])] = Field(
            Export(), description="true, false (no export at the end) or {at_end, saved_model}")
    code: Optional[Code] = Field(None, description=(
        "the carried functions of orchestrator.run(model=fn, ...)"))
    backend: Choice(BACKENDS) = Field("auto", description=(
        "Keras's backend (auto: KERAS_BACKEND, keras.json, what is installed)"))


def json_schema() -> dict:
    """The JSON Schema of a job file, for an editor's YAML support."""
    schema = JobFile.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}

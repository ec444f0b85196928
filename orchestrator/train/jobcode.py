"""The job's own code as the worker-side processes meet it: factories, data, model, compile.

The worker (attempt.py), the exporter (export.py) and the doctor's probe (jobcheck.py) all
resolve the job's ``module:function`` factories and build and compile its model through here.
Every mistake found here is the job's: a ``JobError`` naming the job file, the key and what was
expected, which the worker turns into ``EXIT_CONFIG`` (not retried).
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import re
import sys
from dataclasses import dataclass, field

from orchestrator.core import cellcode
from orchestrator.core.spec import CELL_MODULE, JobSpec
from orchestrator.train import backends, datasets, holders, schedules
from orchestrator.train.errors import JobError
from orchestrator.train.schedules import get_learning_rate

log = logging.getLogger(__name__)

# Names ``Model.compile`` resolves itself by the labels' shape, which Keras's ``get`` does not
# know (keras/src/trainers/compile_utils.py: get_metric, get_loss).
_COMPILE_ALIASES = {"loss": ("crossentropy", "ce"), "metrics": ("accuracy", "acc")}
# What a shape mismatch between the model and the data says (Keras layer input checks, loss
# rank checks, TensorFlow's shape-incompatible kernels, a sparse label out of range).
_MISMATCH = re.compile(r"shape|rank|ndim|incompatible|dimension|label value", re.I)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Keras puts the layer's message in bold


def import_framework(spec: JobSpec):
    """The run's backend (train/backends), its framework imported, or a ``JobError`` that says
    in one line which extra to install. ``KERAS_BACKEND`` is set before Keras is imported."""
    backend = backends.for_name(spec.backend)
    backend.import_framework()
    return backend


def _where(spec: JobSpec, key: str) -> str:
    return f"{spec.job_path}: key '{key}'"


@dataclass(frozen=True)
class Factory:
    """One of the job's ``module:function`` factories, resolved: the function, the args the
    job file gives it, and where it comes from (the key and the module's file)."""

    key: str
    target: str
    func: object
    args: dict = field(default_factory=dict)
    file: str | None = None
    where: str = ""

    def __call__(self, *positional):
        """Call it with the job's args; a ``TypeError`` names the key, the args and, when they
        do not fit, the function's signature."""
        shown = ", ".join([repr(p) for p in positional]
                          + [f"{k}={v!r}" for k, v in self.args.items()])
        call = f"{self.target}({shown})"
        try:
            sig = inspect.signature(self.func)
        except (TypeError, ValueError):  # a builtin or a C function: the call will say
            sig = None
        if sig is not None:
            try:
                sig.bind(*positional, **self.args)
            except TypeError as exc:
                raise JobError(f"{self.where}: {call} does not fit the function's signature "
                               f"{self.target.split(':')[1]}{sig}: {exc}", self.key) from None
        try:
            return self.func(*positional, **self.args)
        except TypeError as exc:
            raise JobError(f"{self.where}: {call} raised TypeError: {exc}", self.key) from exc


def resolve(spec: JobSpec, factory, key: str) -> Factory:
    """Import ``module:function`` of the job (from its directory first), or take
    ``__cell__:function`` from the code ``orchestrator.run(model=fn, ...)`` carried."""
    module_name, func_name = factory.target.split(":")
    if module_name == CELL_MODULE:
        return _carried(spec, factory, key)
    if spec.job_dir not in sys.path:
        sys.path.insert(0, spec.job_dir)
    where = _where(spec, key)
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as exc:
        raise JobError(f"{where}: module '{module_name}' does not compile: {exc.msg} "
                       f"({exc.filename}:{exc.lineno})", key) from exc
    except ImportError as exc:
        raise JobError(f"{where}: cannot import module '{module_name}' "
                       f"(looked in {spec.job_dir} and sys.path): {exc}"
                       f"{_no_tensorflow_hint(spec, exc)}", key) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise JobError(f"{where}: module '{module_name}' has no function '{func_name}'", key)
    return Factory(key, factory.target, func, dict(factory.args),
                   getattr(module, "__file__", None), where)


def _carried(spec: JobSpec, factory, key: str) -> Factory:
    """A function of the job's carried code, which ``cellcode.load`` checks (owner, mode,
    sha256) before it unpickles anything."""
    where = _where(spec, key)
    if spec.code is None:
        raise JobError(f"{where}: {factory.target} names carried code, but the job has no "
                       f"'code' section", key)
    try:
        functions = cellcode.load(spec.job_path, spec.code)
    except cellcode.CodeError as exc:
        raise JobError(f"{where}: {exc}", key) from exc
    name = factory.target.split(":")[1]
    if not callable(functions.get(name)):
        raise JobError(f"{where}: the carried code ({spec.code.file}) has no function "
                       f"'{name}'; it has {', '.join(functions) or 'none'}", key)
    return Factory(key, factory.target, functions[name], dict(factory.args), None, where)


def factories(spec: JobSpec) -> list[Factory]:
    """Every factory the job names, resolved (imports each of the job's modules)."""
    out = [resolve(spec, spec.model, "model"), resolve(spec, spec.data, "data")]
    out += [resolve(spec, c.factory, f"callbacks[{i}]")
            for i, c in enumerate(spec.callbacks) if not c.name]
    if spec.learning_rate is not None and spec.learning_rate.function:
        out.append(resolve(spec, spec.learning_rate.function, "learning_rate"))
    return out


def load_data(spec: JobSpec):
    """The data factory's result as ``datasets.JobData``."""
    try:
        return datasets.normalise(resolve(spec, spec.data, "data")(), _where(spec, "data"))
    except datasets.DataError as exc:
        raise JobError(str(exc), "data") from exc
    except ModuleNotFoundError as exc:
        hint = _no_tensorflow_hint(spec, exc)
        if not hint:
            raise
        raise JobError(f"{_where(spec, 'data')}: {spec.data.target}() failed: {exc}{hint}",
                       "data") from exc


def _no_tensorflow_hint(spec: JobSpec, exc: ImportError) -> str:
    """On JAX, a job whose code imports TensorFlow (a tf.data pipeline) where it is not
    installed: say so before training, with what to do."""
    if getattr(exc, "name", None) != "tensorflow" or spec.backend != "jax":
        return ""
    return ("; the job trains on JAX, and its code imports TensorFlow (a tf.data pipeline?), "
            "which is not installed here: give NumPy arrays, or install TensorFlow beside JAX")


def _accepted(module, base: type, aliases=()) -> list[str]:
    """The names ``module.get`` resolves, asked of Keras itself: the public functions and the
    classes' lower or snake-case names, kept when ``get`` takes them."""
    names = set(aliases)
    for n, obj in vars(module).items():
        if n.startswith("_") or n in ("get", "serialize", "deserialize"):
            continue
        if inspect.isclass(obj) and issubclass(obj, base) and obj is not base:
            names.update({n.lower(), re.sub(r"(?<!^)(?=[A-Z][a-z])", "_", n).lower()})
        elif inspect.isfunction(obj):
            names.add(n)
    ok = []
    for n in sorted(names):
        try:
            if n in aliases or module.get(n) is not None:
                ok.append(n)
        except Exception:  # noqa: BLE001 - not a name get() takes (needs arguments ...)
            continue
    return ok


def _check_identifier(spec: JobSpec, key: str, ident, module, base, aliases=()) -> None:
    if isinstance(ident, str) and ident.lower() in aliases:
        return
    try:
        module.get(ident)
        return
    except (ValueError, TypeError) as exc:
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    accepted = _accepted(module, base, aliases)
    close = (difflib.get_close_matches(ident.lower(), accepted, n=3)
             if isinstance(ident, str) else [])
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise JobError(f"{_where(spec, key)}: Keras does not accept {ident!r} ({problem}); {hint}"
                   f"Keras accepts {', '.join(accepted)} (or a class name, or a mapping "
                   f"{{class_name: ..., config: {{...}}}})", key)


def check_compile(spec: JobSpec) -> None:
    """The job's compile identifiers, checked against Keras's own ``get`` (what ``compile``
    uses) before the model is built: ``Model.compile`` resolves metrics only at the first
    training step, and a mistake there was retried as ``unknown``."""
    import keras

    c = spec.compile
    if c is None:
        return
    _check_identifier(spec, "compile.optimizer", c.optimizer, keras.optimizers,
                      keras.optimizers.Optimizer)
    if isinstance(c.loss, dict) and "class_name" not in c.loss:  # one loss per output
        losses = {f"compile.loss.{name}": loss for name, loss in c.loss.items()}
    else:
        losses = {"compile.loss": c.loss}
    for key, loss in losses.items():
        if loss is None:  # the model computes its own (a train_step or compute_loss)
            continue
        _check_identifier(spec, key, loss, keras.losses, keras.losses.Loss,
                          _COMPILE_ALIASES["loss"])
    for i, m in enumerate(c.metrics):
        _check_identifier(spec, f"compile.metrics[{i}]", m, keras.metrics, keras.metrics.Metric,
                          _COMPILE_ALIASES["metrics"])


def compile_model(model, spec: JobSpec, checked: bool = False) -> None:
    """Compile with the job's ``compile`` section, or keep the factory's compiled model (a
    model with a ``compile`` of its own, ``compile(d_optimizer, g_optimizer, loss_fn)``, is
    compiled by its factory: the section is optional)."""
    if spec.compile is not None:
        if not checked:
            check_compile(spec)
        try:
            model.compile(optimizer=spec.compile.optimizer, loss=spec.compile.loss,
                          metrics=list(spec.compile.metrics))
        except TypeError as exc:
            raise JobError(
                f"{_where(spec, 'compile')}: the model's own compile"
                f"{inspect.signature(model.compile)} does not take the job's compile section "
                f"(optimizer, loss, metrics): {exc}; compile the model in its factory "
                f"({spec.model.target}) and drop the 'compile' section", "compile") from exc
    elif not getattr(model, "compiled", False):
        raise JobError(f"{spec.job_path}: the model factory returned an uncompiled model and "
                       f"the job has no 'compile' section (give compile: {{optimizer, loss}}, "
                       f"or compile the model in {spec.model.target})", "compile")


def _shapes(t) -> str:
    import keras

    shapes = [tuple(getattr(x, "shape", ())) for x in keras.tree.flatten(t)]
    return ", ".join(str(s) for s in shapes) if shapes else "none"


def custom_step(model) -> bool:
    """Whether the model trains with a ``train_step`` of its own (a GAN, a VAE): then only the
    job's code knows what a batch is, and which optimizer applies to which variables."""
    import keras

    return type(model).train_step is not keras.Model.train_step


def _has_call(model) -> bool:
    """Whether the model has a forward pass (keras-io's GAN and VAE have none: their
    ``train_step`` calls the sub-models)."""
    import keras

    return type(model).call is not keras.Model.call


def _built(model) -> bool:
    return all(layer.built for layer in model._flatten_layers())


def _kept_still(model):
    """The seed-generator states before the check, put back after it: a layer that draws
    even with ``training=False`` (a VAE's sampling layer) must not start training from a
    state a plain ``fit`` would not have."""
    found = holders.discover(model)
    seeds = [v for g in found.groups if g.kind == holders.SEED for v in g.variables]
    seeds += [v for v in model.non_trainable_variables if "seed" in (v.path or "")]
    return [(v, v.numpy()) for v in seeds]


def _forward_and_loss(model, x, y, sample_weight):
    """The forward pass and the loss as Keras's ``train_step`` computes them, not training."""
    y_pred = model(x, training=False)
    loss = getattr(model, "_compute_loss", None)
    if loss is not None:
        loss(x, y, y_pred, sample_weight, training=False)
    elif "training" in inspect.signature(model.compute_loss).parameters:
        model.compute_loss(x, y, y_pred, sample_weight, training=False)
    else:  # a model of the job's that overrides compute_loss the Keras 3.0 way
        model.compute_loss(x, y, y_pred, sample_weight)
    return y_pred


def first_step(spec: JobSpec, model, batch):
    """What ``fit`` will first do with a sample batch, before training: a model and data that
    do not fit fail here, named by both keys, instead of in ``fit`` as ``unknown``. It never
    refuses what ``fit`` trains:

    - Keras's own ``train_step``: the forward pass and the loss (``compute_loss`` as the step
      calls it, the job's override included), with ``training=False``; a model with no loss at
      all (no compiled loss, no ``add_loss``, no ``compute_loss`` of its own) is named, as
      ``fit`` would stop on it;
    - a ``train_step`` of the model's own: only what ``fit`` may do before it, build an unbuilt
      model that has a forward pass on x, never refusing (TensorFlow's ``fit`` leaves the build
      to the step); what a batch means is the job's code.

    Seed-generator states are put back afterwards: nothing the resume sees has moved."""
    x, y, sample_weight = datasets.unpack(batch)
    custom = custom_step(model)
    if custom and (_built(model) or not _has_call(model)):
        return None
    kept = _kept_still(model)
    if custom:  # build it as fit may; where x is not its input, its train_step knows better
        try:
            return model(x, training=False)
        except Exception as exc:  # noqa: BLE001 - fit on TensorFlow defers the build: no refusal
            log.info(f"the model is not built before its first step ({type(exc).__name__}"
                     f": {str(exc).splitlines()[0] if str(exc) else ''}); its train_step builds "
                     f"it; a checkpoint restores only into a model its factory builds")
            return None
        finally:
            _put_back(kept)
    try:
        y_pred = _forward_and_loss(model, x, y, sample_weight)
    except backends.current().input_errors() as exc:
        # Keras wraps a layer's error in "Exception encountered when calling ..." and appends
        # "Arguments received by ...", whose tensor reprs say "shape": read the error itself.
        core = _ANSI.sub("", str(exc)).split("Arguments received by")[0]
        text = [ln.strip() for ln in core.splitlines()
                if ln.strip() and not ln.startswith("Exception encountered when calling")]
        if "No loss to compute" in core:
            raise JobError(
                f"{_where(spec, 'compile.loss')}: the model from {spec.model.target} has no "
                f"loss: Keras's train_step needs compile: {{loss: ...}}, a loss the model adds "
                f"(add_loss), or a compute_loss or train_step of the model's own", "compile.loss"
            ) from exc
        if not _MISMATCH.search("\n".join(text)):
            raise
        inputs = ", ".join(str(tuple(i.shape)) for i in getattr(model, "inputs", None) or [])
        raise JobError(
            f"{spec.job_path}: keys 'model' and 'data' do not fit: the model from "
            f"{spec.model.target} (inputs {inputs or 'not declared'}) on a batch from "
            f"{spec.data.target} (x {_shapes(x)}; y {_shapes(y)}) fails in the first step: "
            f"{type(exc).__name__}: {text[0] if text else ''}", "model, data") from exc
    finally:
        _put_back(kept)
    return y_pred


def _put_back(kept) -> None:
    import numpy as np

    for v, value in kept:
        if not np.array_equal(v.numpy(), value):  # drawn from: put back
            v.assign(value)


def build_model(spec: JobSpec, strategy, data):
    """Build and compile the job's model in ``strategy``'s scope, with every variable a
    checkpoint holds created now (model, metrics, ``model.optimizer``). Optimizers a custom
    ``train_step`` holds are built at its first step, as under ``fit``; a restore builds them
    from the checkpoint's record (state.restore)."""
    import keras

    check_compile(spec)  # outside the scope: the throwaway optimizers it makes are not placed
    with strategy.scope():
        model = resolve(spec, spec.model, "model")()
        if not isinstance(model, keras.Model):
            raise JobError(f"{_where(spec, 'model')}: the factory returned "
                           f"{type(model).__name__}, expected a keras.Model", "model")
        compile_model(model, spec, checked=True)
        batch = datasets.sample_batch(data, 2)
        y_pred = first_step(spec, model, batch)  # builds the model
        if (y_pred is not None and not custom_step(model)
                and getattr(model, "_compile_metrics", None) is not None):
            x, y, sample_weight = datasets.unpack(batch)
            try:  # and the metrics, whose running state a mid-epoch checkpoint holds
                model.compute_metrics(x, y, y_pred, sample_weight)
            except Exception as exc:  # noqa: BLE001 - built at the first step instead
                log.info(f"metrics not built before training ({exc}); a mid-epoch "
                         f"resume then restarts the epoch's metrics")
        model.reset_metrics()
        if model.optimizer is not None and not model.optimizer.built:
            # what fit does before its first step (Trainer._symbolic_build)
            model.optimizer.build(model.trainable_variables)
    return model


def job_callbacks(spec: JobSpec) -> list:
    """The job's own callbacks: built-ins by name, or whatever its factories return."""
    import keras

    builtins = {"early_stopping": keras.callbacks.EarlyStopping,
                "reduce_lr_on_plateau": keras.callbacks.ReduceLROnPlateau,
                "terminate_on_nan": keras.callbacks.TerminateOnNaN}
    out = []
    for i, c in enumerate(spec.callbacks):
        key = f"callbacks[{i}]"
        if c.name:
            try:
                made = builtins[c.name](**c.args)
            except TypeError as exc:
                raise JobError(f"{_where(spec, key)}: {exc}", key) from exc
        else:
            made = resolve(spec, c.factory, key)()
        for cb in made if isinstance(made, (list, tuple)) else [made]:
            if not isinstance(cb, keras.callbacks.Callback):
                raise JobError(f"{_where(spec, key)}: expected a keras.callbacks.Callback, got "
                               f"{type(cb).__name__}", key)
            out.append(cb)
    return out


def schedule(spec: JobSpec, optimizer):
    """The spec's learning-rate schedule, or None; checks the optimizer's rate can be set."""
    if spec.learning_rate is None:
        return None
    if optimizer is None:
        raise JobError(f"{_where(spec, 'learning_rate')}: the model has no model.optimizer "
                       f"(compiled with optimizer=None) for the schedule to set; schedule the "
                       f"job's own optimizers in its code, or drop the key", "learning_rate")
    base = get_learning_rate(optimizer)  # as compiled, before any checkpoint is restored
    try:
        optimizer.learning_rate = base
    except TypeError as exc:  # built with a keras LearningRateSchedule: not settable
        raise JobError(f"{_where(spec, 'learning_rate')}: the optimizer's rate cannot be "
                       f"set ({exc}); drop the spec's schedule or the optimizer's",
                       "learning_rate") from exc
    fn = (resolve(spec, spec.learning_rate.function, "learning_rate")
          if spec.learning_rate.function else None)
    return schedules.build(spec.learning_rate, base, spec.epochs, fn)

"""What holds a model's training state, found by walking the model (worker side).

``model.variables`` is the weights and the seed-generator states of the layers Keras tracks;
``model.optimizer.variables`` is one optimizer. A model that ``fit`` trains may hold more:
a GAN's two optimizers as attributes (``self.d_optimizer``), an optimizer of a nested model or
layer, a ``SeedGenerator`` kept where Keras's tracking does not look (under an attribute of a
plain Python object, or set under ``no_automatic_dependency_tracking``), the global seed
generator that unseeded ``keras.random`` calls draw from, a metric tracker the ``metrics``
property leaves out. Everything that decides the next step must be in the checkpoint, so the
checkpoint is made of *groups*, one per holder, each named by where it was found:

========================  =========================================================
``model``                 ``model.variables`` (weights, BatchNorm statistics, tracked seeds)
``optimizer``             ``model.optimizer`` (the name checkpoints always had)
``optimizer@d_optimizer`` any other optimizer, by its attribute path from the model
``seed@noise.gen``        a ``SeedGenerator`` whose state ``model.variables`` misses
``seed@global``           Keras's global seed generator (unseeded ``keras.random`` calls)
``metric@tracker``        a metric that ``model.metrics`` misses (fit never resets it)
========================  =========================================================

The running state of ``model.metrics`` (reset by ``fit`` at every epoch) is not a group here:
a mid-epoch checkpoint adds it (``state.capture_metrics``).

The walk goes through layers (``keras.layers.Layer``, models included) and the lists, tuples
and dicts they hold, public attributes first and breadth first, so that a holder is named by
its shortest public path. It does not enter optimizers (a ``LossScaleOptimizer``'s variables
include its inner optimizer's), metrics or arbitrary Python objects. The same walk notes what
cannot be checkpointed: NumPy and Python random generators held by a layer (``outside``).
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

MODEL, OPTIMIZER, SEED, METRIC = "model", "optimizer", "seed", "metric"
GLOBAL_SEED = "seed@global"
# Attributes never walked: bulky and holding no state of their own (the JAX trainer's copy of
# the state, the functional graph's nodes, Keras's tracker of the very attributes walked).
_SKIP = frozenset({"_jax_state", "_inbound_nodes", "_outbound_nodes", "_tracker",
                   "_compile_config",  # compile's arguments: the optimizer before any wrapping
                   "_self_unconditional_checkpoint_dependencies",
                   "_self_unconditional_dependency_names", "_self_saveable_object_factories"})


@dataclass
class Group:
    """One holder's variables under one name (``name`` prefixes its keys in the checkpoint)."""

    name: str
    kind: str
    where: str           # a path from the model, for messages: model.d_optimizer
    cls: str             # the holder's class, for messages
    holder: object = field(repr=False, default=None)

    @property
    def variables(self) -> list:
        """Read each time: an optimizer builds its slots at its first step."""
        if self.kind == MODEL:
            return list(self.holder.variables)
        if self.kind == SEED:
            return [self.holder.state]
        return list(self.holder.variables)


@dataclass
class Found:
    groups: list[Group]
    outside: list[str]   # state no checkpoint can hold, said as "model.rng (numpy Generator)"


def _kinds():
    import keras

    return (keras.optimizers.Optimizer, keras.random.SeedGenerator, keras.metrics.Metric,
            keras.layers.Layer)


def _attributes(obj) -> list[tuple[str, object]]:
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    items = [(k, v) for k, v in vars(obj).items() if k not in _SKIP]
    items.sort(key=lambda kv: kv[0].startswith("_"))  # stable: public first, in order set
    return [(f".{k}", v) for k, v in items]


def _walk(model):
    """(path, object) of every optimizer, seed generator, metric and random generator reachable
    from ``model``, each once, by its shortest public-first path."""
    Optimizer, SeedGenerator, Metric, Layer = _kinds()
    seen = {id(model)}
    queue = deque([("model", model)])
    while queue:
        path, obj = queue.popleft()
        for name, value in _attributes(obj):
            if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float,
                                                                         np.ndarray)):
                continue
            where = path + name
            if isinstance(value, (Optimizer, SeedGenerator, Metric, np.random.Generator,
                                  np.random.RandomState, random.Random)):
                seen.add(id(value))
                yield where, value
            elif isinstance(value, (Layer, list, tuple, dict)):
                seen.add(id(value))
                queue.append((where, value))


def _attr_path(where: str) -> str:
    return where[len("model."):] if where.startswith("model.") else where


def discover(model) -> Found:
    """The model's state holders, in an order that is the same for the same model code."""
    import keras

    Optimizer, SeedGenerator, Metric, _ = _kinds()
    groups = [Group(MODEL, MODEL, "model.variables", type(model).__name__, model)]
    primary = getattr(model, "optimizer", None)
    if primary is not None:
        groups.append(Group(OPTIMIZER, OPTIMIZER, "model.optimizer", type(primary).__name__,
                            primary))
    tracked = {id(v) for v in model.variables}
    metered = {id(v) for v in model.metrics_variables}
    held = {id(v) for v in (primary.variables if primary is not None else [])}
    outside = []
    for where, obj in _walk(model):
        if isinstance(obj, Optimizer):
            if obj is primary or all(id(v) in held for v in obj.variables):
                continue  # a wrapped optimizer (LossScaleOptimizer's inner) is its wrapper's
            held.update(id(v) for v in obj.variables)
            groups.append(Group(f"{OPTIMIZER}@{_attr_path(where)}", OPTIMIZER, where,
                                type(obj).__name__, obj))
        elif isinstance(obj, SeedGenerator):
            if id(obj.state) not in tracked:
                groups.append(Group(f"{SEED}@{_attr_path(where)}", SEED, where,
                                    "SeedGenerator", obj))
        elif isinstance(obj, Metric):
            if obj.variables and not any(id(v) in metered for v in obj.variables):
                groups.append(Group(f"{METRIC}@{_attr_path(where)}", METRIC, where,
                                    type(obj).__name__, obj))
        else:
            outside.append(f"{where} ({type(obj).__module__.split('.')[0]} "
                           f"{type(obj).__name__}): a random generator outside Keras, whose "
                           f"state no checkpoint holds")
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    gen = global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)
    if isinstance(gen, keras.random.SeedGenerator):
        groups.append(Group(GLOBAL_SEED, SEED, "keras.random (unseeded calls)",
                            "SeedGenerator", gen))
    return Found(groups, outside)


def global_seed_generator():
    """Keras's global seed generator, created if no unseeded ``keras.random`` call made it yet
    (a resumed process restores its state before the first draw)."""
    from keras.src.random import seed_generator

    return seed_generator.global_seed_generator()


def built_over(group: Group, model_variables: list) -> list[int] | None:
    """For an optimizer: the indices in the ``model`` group of the variables it was built over
    (``None`` while it is not built); -1 for a variable outside the model. A restore builds an
    optimizer that the job builds only at its first step (a custom ``train_step``) over these,
    before assigning its slots."""
    if group.kind != OPTIMIZER or not getattr(group.holder, "built", False):
        return None
    index = {id(v): i for i, v in enumerate(model_variables)}
    return [index.get(id(v), -1) for v in group.holder._trainable_variables]


# Public number attributes Keras's own Model/Layer set (bools are never counted).
_KERAS_NUMBERS = frozenset({"steps_per_execution", "unrolled_steps_per_execution", "input_dim",
                            "units", "rate"})


def user_scalars(model) -> dict[str, float]:
    """Public ``int``/``float`` attributes of the job's own layer and model classes (Keras's
    are left out): if one changes during training it is state outside the variables (a Python
    step counter in a ``train_step``), which no checkpoint holds. Read when training begins and
    at each checkpoint (callbacks.CheckpointCallback)."""
    out = {}
    for layer in model._flatten_layers(include_self=True):
        if type(layer).__module__.split(".")[0] == "keras":
            continue
        for k, v in vars(layer).items():
            if (not k.startswith("_") and k not in _KERAS_NUMBERS and not isinstance(v, bool)
                    and isinstance(v, (int, float))):
                out[f"{layer.name}.{k}"] = v
    return out

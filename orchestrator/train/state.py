"""Training state as plain arrays: capture, restore and fingerprint a Keras model (worker side).

The state is every variable of every holder ``holders.discover`` finds: the model's variables
(weights, BatchNorm statistics and the Dropout seed-generator states, which ``model.variables``
includes and ``tf.train.Checkpoint`` leaves out), ``model.optimizer``'s (iterations, learning
rate, slots), every other optimizer the model holds (a GAN's two), seed generators and metrics
Keras's tracking misses, saved in order as content-addressed blobs (checkpoint/blobs.py, format
2 of docs/checkpoint-format.md) under keys ``<group>.<index>``. The
manifest names each group (``holders``: where, class, count, what an optimizer was built over),
so that a changed model is refused naming the group that is missing or extra. Why
not ``tf.train.Checkpoint``: reading values to host arrays makes a checkpoint independent of the
strategy that wrote it (8 TPU replicas restore on 1 CPU and back), an unchanged array (a frozen
layer) is stored once per tier, and it can be verified and fingerprinted without TensorFlow. A
checkpoint is raw bytes named by a manifest (format 1's ``.npz`` is read with
``allow_pickle=False``): data, never code.

A mid-epoch checkpoint also holds the metric state (``model.metrics_variables``: running sums
and counts of the epoch so far), so that the resumed epoch still reports metrics over the whole
epoch, and callbacks may add arrays of their own (under keys ``callbacks.*``).
"""
from __future__ import annotations

import os
import threading

import numpy as np

from orchestrator.checkpoint import blobs
from orchestrator.checkpoint.store import Checkpoint, CheckpointStore
from orchestrator.train import backends, holders


class StateMismatch(Exception):
    """The checkpoint was written by a different model or optimizer than the job builds now."""


def sync(model) -> None:
    """Put the training state back into the Keras variables before they are read. During
    ``fit`` the JAX trainer holds it outside them (``model._jax_state``) and empties them; the
    trainer takes it from the variables again at its next step. Nothing to do on TensorFlow,
    or outside ``fit``."""
    jax_state_sync = getattr(model, "jax_state_sync", None)
    if jax_state_sync is not None:
        jax_state_sync()


def group_of(key: str) -> str | None:
    """The holder group of a checkpoint key (``optimizer@d_optimizer.0003`` ->
    ``optimizer@d_optimizer``); None for the other arrays a checkpoint holds (``metrics.*``,
    ``callbacks.*``)."""
    group = key.rsplit(".", 1)[0]
    return group if group in (holders.MODEL, holders.OPTIMIZER) or "@" in group else None


def _groups(model, found: holders.Found | None = None) -> dict[str, list]:
    sync(model)
    return _by_group(found or holders.discover(model))


def _by_group(found: holders.Found) -> dict[str, list]:
    """Each holder group's variables, without reading them (JAX's stay the trainer's)."""
    return {g.name: g.variables for g in found.groups}


def _keyed(groups: dict[str, list]) -> list[tuple[str, object]]:
    """Each variable with its checkpoint key (``optimizer.0003``), in the groups' order."""
    return [(f"{g}.{i:04d}", v) for g, vs in groups.items() for i, v in enumerate(vs)]


def layout(model, found: holders.Found | None = None) -> dict[str, dict]:
    """Each group of the checkpoint, for its manifest (``holders``): where its holder is, its
    class, how many variables, and for an optimizer the model variables it was built over
    (which a restore needs to build it before the job's first step does)."""
    found = found or holders.discover(model)
    model_vars = next(g.variables for g in found.groups if g.kind == holders.MODEL)
    return {g.name: {"where": g.where, "class": g.cls, "kind": g.kind,
                     "variables": len(g.variables),
                     **({"built_over": holders.built_over(g, model_vars)}
                        if g.kind == holders.OPTIMIZER else {})}
            for g in found.groups}


def describe(model, found: holders.Found | None = None) -> list[dict]:
    return [{"key": k, "path": v.path, "shape": list(v.shape), "dtype": str(v.dtype)}
            for k, v in _keyed(_groups(model, found))]


def capture(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v.numpy()) for k, v in _keyed(_groups(model))}


def capture_metrics(model) -> dict[str, np.ndarray]:
    sync(model)
    return {f"metrics.{i:04d}": np.array(v.numpy(), copy=True)
            for i, v in enumerate(model.metrics_variables)}


def restore_metrics(model, arrays: dict[str, np.ndarray]) -> bool:
    """Put back the epoch's running metric state; False if the checkpoint has none that fits."""
    saved = sorted(k for k in arrays if k.startswith("metrics."))
    variables = list(model.metrics_variables)
    if not saved or len(saved) != len(variables) or any(
            tuple(arrays[k].shape) != tuple(v.shape) for k, v in zip(saved, variables)):
        return False
    for k, v in zip(saved, variables):
        v.assign(arrays[k])
    return True


def load_arrays(checkpoint: "Checkpoint | str") -> dict[str, np.ndarray]:
    """The arrays of a checkpoint (or of the checkpoint directory at a path), read from the
    tier that holds it and checked against their hashes as they are read."""
    if isinstance(checkpoint, Checkpoint) and checkpoint.tier is not None:
        return checkpoint.tier.read_arrays(checkpoint.path)
    path = checkpoint.path if isinstance(checkpoint, Checkpoint) else checkpoint
    return CheckpointStore(os.path.dirname(os.path.abspath(path))).read_arrays(path)


def _saved_groups(arrays: dict[str, np.ndarray]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k in sorted(arrays):
        g = group_of(k)
        if g is not None:
            out.setdefault(g, []).append(k)
    return out


def _named(name: str, info: dict | None) -> str:
    if not info:
        return name
    return f"{name} ({info.get('class')} at {info.get('where')}, {info.get('variables')} variables)"


def _same_groups(saved: dict, groups: dict, saved_layout: dict) -> None:
    """A group on one side only is a changed model: ``StateMismatch`` names each."""
    missing = [n for n in saved if n not in groups]
    extra = [n for n in groups if n not in saved]
    if missing or extra:
        parts = []
        if missing:
            parts.append("the checkpoint holds " + "; ".join(
                _named(n, saved_layout.get(n)) for n in missing) + ", which the job's model "
                "does not have")
        if extra:
            parts.append("the job's model has " + "; ".join(
                f"{n} ({groups[n].cls} at {groups[n].where})" for n in extra) + ", which the "
                "checkpoint does not hold")
        raise StateMismatch(f"{', and '.join(parts)}: the model changed since the checkpoint "
                            f"was written")


def restore(model, arrays: dict[str, np.ndarray], saved_layout: dict | None = None) -> int:
    """Assign saved values to every holder's variables (holders.py); return how many.

    The checkpoint's groups and the model's must be the same set: a group missing on either
    side is a changed model, refused by name (``StateMismatch``) before anything is assigned.
    An optimizer the job builds only at its first step (an attribute optimizer of a custom
    ``train_step``) is built here first, over the variables ``saved_layout`` (the manifest's
    ``holders``) says it was built over. Keras's global seed generator is created when the
    checkpoint holds it (unseeded ``keras.random`` calls drew from it before the kill)."""
    saved = _saved_groups(arrays)
    found = holders.discover(model)
    if holders.GLOBAL_SEED in saved and not any(g.name == holders.GLOBAL_SEED
                                                for g in found.groups):
        holders.global_seed_generator()
        found = holders.discover(model)
    groups = {g.name: g for g in found.groups
              if g.name != holders.GLOBAL_SEED or holders.GLOBAL_SEED in saved}
    saved_layout = saved_layout or {}
    _same_groups(saved, groups, saved_layout)
    sync(model)
    model_vars = groups[holders.MODEL].variables
    for name, g in groups.items():
        if g.kind != holders.OPTIMIZER or g.holder.built or len(saved[name]) == len(g.variables):
            continue
        over = (saved_layout.get(name) or {}).get("built_over")
        if not over or min(over) < 0 or max(over) >= len(model_vars):
            raise StateMismatch(
                f"optimizer {g.where} ({g.cls}) is not built yet and the checkpoint does not "
                f"say over which of the model's variables it was built (manifest 'holders'."
                f"{name}.built_over: {over}): it cannot be restored")
        g.holder.build([model_vars[i] for i in over])
    plan = []
    for name, g in groups.items():
        variables, keys = g.variables, saved[name]
        if len(keys) != len(variables):
            hint = ""
            if g.kind == holders.MODEL and len(variables) < len(keys):
                hint = (" (or the model creates variables only in its first train_step: build "
                        "it in its factory, by calling it on a batch or giving its layers "
                        "their input shapes)")
            raise StateMismatch(
                f"the checkpoint holds {len(keys)} variables of "
                f"{_named(name, saved_layout.get(name))}, the job's {g.cls} at {g.where} has "
                f"{len(variables)}: the model or optimizer changed since it was written{hint}")
        for key, v in zip(keys, variables):
            a = arrays[key]
            if tuple(a.shape) != tuple(v.shape):
                raise StateMismatch(f"{name} variable {v.path} ({g.where}): checkpoint shape "
                                    f"{a.shape}, model shape {tuple(v.shape)}")
            plan.append((v, a))
    for v, a in plan:
        v.assign(a)
    return len(plan)


class Snapshot:
    """Host copies of every model and optimizer variable, taken on the training thread at a
    step boundary in about a millisecond (ResNet-20 on a CPU: 204 variables, 1.4 ms against 6.5
    ms read one by one), so that the checkpoint's write can go on in the background while
    training changes the variables. Without a distribution strategy all variables are read by
    one compiled function (one call instead of one per variable); distributed variables (TPU,
    several replicas) are read one by one, as ``capture`` does. The arrays are copies, never
    views of the framework's buffers, which the next step may update in place (or JAX donate).

    The copies go into host buffers kept from one snapshot to the next: a snapshot is valid
    until the next ``take``, which the writer admits only once the previous write is done.
    A fresh 1.26 GB allocation per checkpoint cost its page faults in the stall, 3-6 s beside
    the page cache that the checkpoint files fill (BENCHMARKS.md, issue 37).

    The layout (keys, description, which keys are the weights) is recomputed only when the set
    of variables changes (an optimizer built late). ``compiled=False`` (checkpoints written in
    line) reads one by one, as before the background writer: no tracing in the first stall."""

    def __init__(self, model, compiled: bool = True):
        self.model, self.compiled = model, compiled
        self._lock = threading.Lock()  # warm() may run in the writer's thread
        self._ids: tuple = ()
        self._found: holders.Found | None = None
        self._found_for: tuple = ()
        self.keys: list[str] = []
        self.weight_keys: list[str] = []
        self.description: list[dict] = []
        self.holders: dict[str, dict] = {}   # state.layout: the manifest's ``holders``
        self.outside: list[str] = []          # what holders.discover saw no checkpoint holds
        self._read = None
        self._buffers: dict[str, np.ndarray] = {}  # the host copies, reused (``_copy``)

    def _discover(self) -> holders.Found:
        """The walk (holders.discover) again only when the model's variables or the global
        seed generator changed: a checkpoint's stall stays a read of the variables."""
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator

        key = (tuple(id(v) for v in self.model.variables),
               id(global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)))
        if self._found is None or key != self._found_for:
            self._found, self._found_for = holders.discover(self.model), key
            self.outside = list(self._found.outside)
        return self._found

    def _layout(self):
        found = self._discover()
        keyed = _keyed(_groups(self.model, found))  # synced: the values are read next
        variables = [v for _, v in keyed]
        ids = tuple(id(v) for v in variables)
        if ids == self._ids:
            return variables
        self._ids = ids
        self.keys = [k for k, _ in keyed]
        by_id = dict(zip(ids, self.keys))
        self.weight_keys = [by_id[id(w)] for w in self.model.weights]
        self.description = describe(self.model, found)
        self.holders = layout(self.model, found)
        self._read = backends.current().reader(variables) if self.compiled else None
        return variables

    def warm(self) -> None:
        """Trace the compiled reader now (about 60 ms for ResNet-20) and fill the host buffers
        once (their page faults: 1.08 s for 1.26 GB on JAX), not in the first checkpoint's
        stall; the worker runs this in the writer's thread after its first step."""
        with self._lock:
            if backends.current().traced_reader:
                variables = self._layout()
                if self._read is None:
                    return
                # traced, not run: values held here while training goes on made TensorFlow
                # copy every variable the next step updated (copy-on-write: +1.1 GB for 1.26 GB)
                trace = getattr(self._read, "get_concrete_function", None)
                if trace is not None:
                    trace()
                keyed = list(zip(self.keys, variables))
            else:  # JAX: nothing to trace, and the values are the trainer's until the
                # training thread syncs them (``sync``); the shapes are the variables' own
                keyed = _keyed(_by_group(self._discover()))
            for k, v in keyed:
                buf = self._buffers[k] = np.empty(tuple(v.shape), blobs.dtype_of(str(v.dtype)))
                buf.fill(0)  # its pages faulted now

    def take(self) -> dict[str, np.ndarray]:
        with self._lock:
            variables = self._layout()
            if self._read is not None:
                values = self._read()
            else:
                values = [v.numpy() for v in variables]
            return {k: self._copy(k, a) for k, a in zip(self.keys, values)}

    def _copy(self, key: str, value) -> np.ndarray:
        """``value`` copied into ``key``'s host buffer, allocated again only when its shape or
        dtype changed."""
        a = np.asarray(value)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != a.shape or buf.dtype != a.dtype:
            buf = self._buffers[key] = np.empty(a.shape, a.dtype)
        np.copyto(buf, a)
        return buf

    def fingerprints(self, refs: dict[str, blobs.ArrayRef]) -> tuple[str, str]:
        """(weights sha256, state sha256) of a snapshot from the hashes its commit writes its
        blobs under (blobs.hash_arrays: one hash per chunk, computed once), equal to
        ``fingerprint(model)`` and ``state_fingerprint(model)`` of the model it was taken from
        (computed off the training thread)."""
        return (blobs.digest(refs[k] for k in self.weight_keys),
                blobs.digest(refs[k] for k in sorted(self.keys)))


def fingerprint(model) -> str:
    sync(model)
    view = backends.current().view
    return blobs.weights_fingerprint(view(w) for w in model.weights)


def state_fingerprint(model) -> str:
    """A digest over everything that decides the next step: weights, BatchNorm statistics,
    seed-generator states and optimizer variables (iterations, learning rate, slots); the
    checkpoint's ``state_sha256`` of the same state. Each value is hashed from a view and let
    go: no copy of the whole state (a restore checks it before the first step)."""
    view = backends.current().view
    return blobs.weights_fingerprint(view(v) for _, v in sorted(_keyed(_groups(model)),
                                                                key=lambda kv: kv[0]))

"""Job spec: a YAML file turned into validated dataclasses.

Every error names the file, the line, the key and what was expected, because the person reading
it is usually looking at a notebook cell hours after they wrote the YAML. Only
``yaml.SafeLoader`` is used: a job file must never be able to run code by being parsed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

STRATEGIES = ("auto", "tpu", "gpu", "cpu")
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class SpecError(Exception):
    """A job file that cannot be used; the message is meant for the user as it is."""

    def __init__(self, path: str, line: int | None, key: str | None, expected: str):
        self.path, self.line, self.key, self.expected = path, line, key, expected
        where = f"{path}:{line}" if line else path
        what = f"key '{key}': " if key else ""
        super().__init__(f"{where}: {what}{expected}")


@dataclass(frozen=True)
class Factory:
    """A user function named ``module:function``, called with ``args`` as keyword arguments."""

    target: str
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CompileSpec:
    optimizer: Any = "adam"
    loss: Any = None
    metrics: tuple = ()


@dataclass(frozen=True)
class CheckpointSpec:
    every_epochs: int = 1
    keep: int = 3


@dataclass(frozen=True)
class RestartSpec:
    max: int = 3
    backoff_initial: float = 1.0
    backoff_max: float = 60.0
    backoff_multiplier: float = 2.0


@dataclass(frozen=True)
class JobSpec:
    name: str
    model: Factory
    data: Factory
    epochs: int
    batch_size: int
    run_dir: str
    job_path: str
    job_dir: str
    strategy: str = "auto"
    seed: int = 0
    compile: CompileSpec | None = None
    checkpoint: CheckpointSpec = CheckpointSpec()
    restarts: RestartSpec = RestartSpec()
    heartbeat_interval: float = 1.0

    def training_hash(self) -> str:
        """A hash of what decides the trained model (not epochs, restarts or paths)."""
        relevant = {
            "model": dataclasses.asdict(self.model),
            "data": dataclasses.asdict(self.data),
            "compile": dataclasses.asdict(self.compile) if self.compile else None,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }
        blob = json.dumps(relevant, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()


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


class _Reader:
    """Reads typed values out of a mapping, raising SpecError with file, line and key."""

    def __init__(self, path: str, lines: dict):
        self.path, self.lines = path, lines

    def fail(self, key: str, expected: str):
        line = self.lines.get(key)
        if line is None and "." in key:
            line = self.lines.get(key.rsplit(".", 1)[0])
        raise SpecError(self.path, line, key, expected)

    def mapping(self, data, prefix: str, allowed: set, required: set = frozenset()) -> dict:
        if not isinstance(data, dict):
            self.fail(prefix or "(top level)", f"expected a mapping, got {type(data).__name__}")
        for k in data:
            if str(k) not in allowed:
                key = f"{prefix}.{k}" if prefix else str(k)
                self.fail(key, f"unknown key; expected one of: {', '.join(sorted(allowed))}")
        for k in sorted(required):
            if k not in data:
                key = f"{prefix}.{k}" if prefix else k
                raise SpecError(self.path, self.lines.get(prefix), key, "required key is missing")
        return data

    def integer(self, data, key, full, default=None, minimum=None):
        if key not in data:
            return default
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
            bound = f" >= {minimum}" if minimum is not None else ""
            self.fail(full, f"expected an integer{bound}, got {v!r}")
        return v

    def number(self, data, key, full, default=None, minimum=None):
        if key not in data:
            return default
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            minimum is not None and v < minimum
        ):
            bound = f" >= {minimum}" if minimum is not None else ""
            self.fail(full, f"expected a number{bound}, got {v!r}")
        return float(v)

    def string(self, data, key, full, default=None, choices=None):
        if key not in data:
            return default
        v = data[key]
        if not isinstance(v, str) or not v.strip():
            self.fail(full, f"expected a non-empty string, got {v!r}")
        if choices and v not in choices:
            self.fail(full, f"expected one of {', '.join(choices)}, got {v!r}")
        return v

    def factory(self, data, key) -> Factory:
        v = data[key]
        args: dict = {}
        target = v
        if isinstance(v, dict):
            self.mapping(v, key, {"factory", "args"}, {"factory"})
            target = v["factory"]
            args = v.get("args") or {}
            if not isinstance(args, dict):
                self.fail(f"{key}.args", f"expected a mapping of keyword arguments, got {args!r}")
            key = f"{key}.factory"
        if not isinstance(target, str) or not _FACTORY_RE.match(target):
            self.fail(key, f"expected 'module:function' (e.g. my_job:build_model), got {target!r}")
        return Factory(target, dict(args))


TOP_KEYS = {
    "name", "model", "data", "compile", "epochs", "batch_size", "strategy", "run_dir", "seed",
    "checkpoint", "restarts", "heartbeat_interval",
}


def load(path: str, run_dir: str | None = None) -> JobSpec:
    """Read and validate a job file. ``run_dir`` overrides the file's ``run_dir``."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise SpecError(path, None, None, f"cannot read the job file: {exc.strerror}") from None
    data, lines = _compose(text, path)
    r = _Reader(path, lines)
    if data is None:
        raise SpecError(path, None, None, "the job file is empty; expected a mapping with "
                        "name, model, data, epochs and batch_size")
    r.mapping(data, "", TOP_KEYS, {"name", "model", "data", "epochs", "batch_size"})

    name = r.string(data, "name", "name")
    if not re.match(r"^[\w.-]+$", name):
        r.fail("name", f"expected letters, digits, '.', '_' or '-' only, got {name!r}")

    compile_spec = None
    if "compile" in data:
        c = r.mapping(data["compile"], "compile", {"optimizer", "loss", "metrics"}, {"loss"})
        opt = c.get("optimizer", "adam")
        if not isinstance(opt, (str, dict)):
            r.fail("compile.optimizer", f"expected a name like 'adam' or a mapping "
                   f"{{class_name: ..., config: ...}}, got {opt!r}")
        if not isinstance(c["loss"], (str, dict)):
            r.fail("compile.loss", f"expected a loss name like 'sparse_categorical_crossentropy', "
                   f"got {c['loss']!r}")
        metrics = c.get("metrics", [])
        if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
            r.fail("compile.metrics", f"expected a list of metric names, got {metrics!r}")
        compile_spec = CompileSpec(opt, c["loss"], tuple(metrics))

    ckpt = CheckpointSpec()
    if "checkpoint" in data:
        c = r.mapping(data["checkpoint"], "checkpoint", {"every_epochs", "keep"})
        ckpt = CheckpointSpec(
            every_epochs=r.integer(c, "every_epochs", "checkpoint.every_epochs", 1, 1),
            keep=r.integer(c, "keep", "checkpoint.keep", 3, 1),
        )

    restarts = RestartSpec()
    if "restarts" in data:
        c = r.mapping(data["restarts"], "restarts", {"max", "backoff"})
        b = {}
        if "backoff" in c:
            b = r.mapping(c["backoff"], "restarts.backoff", {"initial", "max", "multiplier"})
        restarts = RestartSpec(
            max=r.integer(c, "max", "restarts.max", 3, 0),
            backoff_initial=r.number(b, "initial", "restarts.backoff.initial", 1.0, 0),
            backoff_max=r.number(b, "max", "restarts.backoff.max", 60.0, 0),
            backoff_multiplier=r.number(b, "multiplier", "restarts.backoff.multiplier", 2.0, 1),
        )

    job_dir = os.path.dirname(os.path.abspath(path))
    rd = run_dir if run_dir is not None else r.string(data, "run_dir", "run_dir",
                                                      os.path.join("runs", name))
    return JobSpec(
        name=name,
        model=r.factory(data, "model"),
        data=r.factory(data, "data"),
        epochs=r.integer(data, "epochs", "epochs", minimum=1),
        batch_size=r.integer(data, "batch_size", "batch_size", minimum=1),
        strategy=r.string(data, "strategy", "strategy", "auto", STRATEGIES),
        seed=r.integer(data, "seed", "seed", 0, 0),
        run_dir=os.path.abspath(os.path.expanduser(rd)),
        job_path=os.path.abspath(path),
        job_dir=job_dir,
        compile=compile_spec,
        checkpoint=ckpt,
        restarts=restarts,
        heartbeat_interval=r.number(data, "heartbeat_interval", "heartbeat_interval", 1.0, 0.05),
    )

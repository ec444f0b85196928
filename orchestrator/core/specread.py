"""Reading a job file's mapping: typed values with file, line and key in every error.

``specload.py`` reads the job file section by section through this reader; the key sets each
section allows are derived here from the dataclass fields of ``spec.py``, so that a key is
written once, on its field.
"""
from __future__ import annotations

import dataclasses

from orchestrator.core.spec import _FACTORY_RE, Factory, SpecError


class Reader:
    """Reads typed values out of a mapping, with file, line and key in every error.

    A value of the wrong type or out of bounds, and an unknown key, are noted and reading goes
    on (the field takes its default), so that ``load`` reports every such mistake of a job
    file at once; a structural one (not a mapping, a required key missing) stops at once."""

    def __init__(self, path: str, lines: dict):
        self.path, self.lines = path, lines
        self.errors: list[SpecError] = []

    def error(self, key: str, expected: str) -> SpecError:
        line = self.lines.get(key)
        if line is None and "." in key:
            line = self.lines.get(key.rsplit(".", 1)[0])
        return SpecError(self.path, line, key, expected)

    def fail(self, key: str, expected: str):
        raise self.error(key, expected)

    def note(self, key: str, expected: str, default=None):
        """A mistake that does not stop the reading: noted, and ``default`` taken instead."""
        self.errors.append(self.error(key, expected))
        return default

    def mapping(self, data, prefix: str, allowed: set, required: set = frozenset()) -> dict:
        if not isinstance(data, dict):
            self.fail(prefix or "(top level)", f"expected a mapping, got {type(data).__name__}")
        for k in data:
            if str(k) not in allowed:
                key = f"{prefix}.{k}" if prefix else str(k)
                self.note(key, f"unknown key; expected one of: {', '.join(sorted(allowed))}")
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
            return self.note(full, f"expected an integer{bound}, got {v!r}", default)
        return v

    def number(self, data, key, full, default=None, minimum=None):
        if key not in data:
            return default
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            minimum is not None and v < minimum
        ):
            bound = f" >= {minimum}" if minimum is not None else ""
            return self.note(full, f"expected a number{bound}, got {v!r}", default)
        return float(v)

    def strings(self, data, key, full, default=()):
        if key not in data:
            return default
        v = data[key]
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            return self.note(full, f"expected a list of strings, got {v!r}", default)
        return tuple(v)

    def string(self, data, key, full, default=None, choices=None):
        if key not in data:
            return default
        v = data[key]
        if choices and (not isinstance(v, str) or v not in choices):
            return self.note(full, f"expected one of {', '.join(choices)}, got {v!r}", default)
        if not isinstance(v, str) or not v.strip():
            return self.note(full, f"expected a non-empty string, got {v!r}", default)
        if choices and v not in choices:
            return self.note(full, f"expected one of {', '.join(choices)}, got {v!r}", default)
        return v

    def boolean(self, data, key, full, default=False):
        if key not in data:
            return default
        if not isinstance(data[key], bool):
            return self.note(full, f"expected true or false, got {data[key]!r}", default)
        return data[key]

    def factory(self, data, key) -> Factory:
        return self.factory_value(data[key], key)

    def factory_value(self, v, key) -> Factory:
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


def keys(cls, nested=(), internal=()) -> set:
    """A section's keys, from its dataclass's fields: a field ``<n>`` or ``<n>_<key>`` with
    ``n`` in ``nested`` is read from the section's mapping ``<n>: {...}`` (``backoff_max`` from
    ``backoff: {max: ...}``); ``internal`` fields are filled by ``load``, never written."""
    keys = set()
    for f in dataclasses.fields(cls):
        if f.name not in internal:
            keys.add(next((n for n in nested if f.name == n or f.name.startswith(n + "_")),
                          f.name))
    return keys


def subkeys(cls, nested: str) -> set:
    """The keys of a nested mapping: ``backoff: {initial, max, ...}`` from ``backoff_*``."""
    return {f.name[len(nested) + 1:] for f in dataclasses.fields(cls)
            if f.name.startswith(nested + "_")}

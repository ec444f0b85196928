"""Job code carried by value: the functions given to ``orchestrator.run(model=fn, data=fn, ...)``.

A job defined in a notebook cell or in a script's ``__main__`` has no module the worker could
import, so its functions travel to the worker by value, pickled with cloudpickle:

- ``carry`` (the calling process, before any worker starts) pickles each function on its own,
  so that one that cannot be carried fails at once, named by its key and by the reference that
  holds the culprit (``load_data -> 'log' is an open file ...``). An open file, a TensorFlow
  tensor, variable, layer, model or dataset, or a JAX array of the calling process is refused
  even where pickle would take it: what the worker got would be a snapshot of this process's
  state (a file's content read now, a tensor copied off the device), never what the function
  meant.
- ``fingerprint``: what the code *is*, the same in every process that runs the same cell, for
  the training hash. The pickle's own bytes are not: they hold the bytecode (which changes with
  the Python version), line numbers, and a random id cloudpickle gives each class of the cell
  in each process. So a code object counts by its source text (bytecode for a lambda, whose
  source line may hold the whole call), a class by its name. (One gap: a set of strings that a
  function reaches through its globals or closure is pickled in an order that moves with the
  hash seed, so its fingerprint differs between processes; pickle gives no hook for sets.) A recycled VM that runs the same cell again gets
  the same fingerprint and resumes; changed code is an incompatible resume (unless forced).
- ``CellJob.freeze`` (the supervisor, once the run is admitted) writes the code file next to the
  frozen job in the run directory, mode 0600, and the frozen job with the file's sha256.
- ``load`` (the worker and the exporter): the security boundary. Unpickling runs code, so only
  a file this user wrote is ever unpickled. The code file and the frozen job that names its
  hash are each opened without following a symlink and refused unless they are regular files
  owned by the current uid and not writable by group or others; the code file's sha256 must be
  the one the frozen job records. Another user who can write into the run directory can delete
  or replace the files, but cannot make a file owned by this user: whatever they put there is
  refused, never loaded (root, who can do anything, is outside any such boundary).
"""
from __future__ import annotations

import hashlib
import inspect
import io
import os
import re
import stat
import sys
import textwrap
import types
from dataclasses import dataclass

import cloudpickle

from orchestrator.core.osutil import write_atomic
from orchestrator.core.spec import CodeSpec, SpecError

CODE_FILE = CodeSpec.file
_PROTOCOL = 5  # fixed, not cloudpickle's default: the fingerprint must not move with it
# Objects of these packages whose class (or a base) is named so hold this process's state,
# recognised by their class's module name: this side never imports a framework to check.
# A jax.Array (jaxlib's ArrayImpl, its base jax.Array, a PRNG key array) lives on this
# process's devices; pickle would copy it to a NumPy array, which is not what the code meant.
_TF_STATEFUL = re.compile(r"Tensor|Variable|Layer|Model|Optimizer|Dataset")
_JAX_STATEFUL = re.compile(r"Array|Tracer")
_TF = ("TensorFlow", _TF_STATEFUL, "in this process's TensorFlow")
_KERAS = ("Keras", _TF_STATEFUL, "in this process's Keras backend")
_JAX = ("JAX", _JAX_STATEFUL, "on this process's devices")
_HELD_ROOTS = {"tensorflow": _TF, "keras": _KERAS, "tf_keras": _KERAS, "jax": _JAX,
               "jaxlib": _JAX}
_STD_STREAMS = ("stdout", "stderr", "stdin", "__stdout__", "__stderr__", "__stdin__")
# cloudpickle names each class of the cell with a random id (to rebuild it once per process)
_tracker_id = getattr(cloudpickle.cloudpickle, "_get_or_create_tracker_id", None)


class CarryError(SpecError):
    """A function given to ``orchestrator.run`` cannot be carried to the worker."""


class CodeError(Exception):
    """The carried code file is refused (owner, mode, hash) or cannot be loaded."""


class _Refused(Exception):
    """Raised inside the pickler: this object belongs to the calling process."""


@dataclass(frozen=True)
class Carried:
    blob: bytes        # the functions by slot name, cloudpickled: the code file's content
    sha256: str        # of ``blob``
    fingerprint: str   # of the code itself (see the module's docstring)
    names: tuple = ()  # the slot names, as the job's ``__cell__:name`` targets say them


def held_here(obj) -> str | None:
    """Why ``obj`` cannot leave this process, or None."""
    if isinstance(obj, io.IOBase) and not any(obj is getattr(sys, s, None) for s in _STD_STREAMS):
        name = getattr(obj, "name", None)
        what = f" ({name!r}, mode {getattr(obj, 'mode', '?')!r})" if name is not None else ""
        return (f"an open file{what}: a file handle belongs to this process; open the file "
                f"inside the function")
    for c in type(obj).__mro__:
        framework, stateful, lives = _HELD_ROOTS.get(c.__module__.split(".")[0], (None,) * 3)
        if framework and stateful.search(c.__name__):
            return (f"a {framework} {type(obj).__name__} of this process (a "
                    f"{c.__module__}.{c.__name__}): it lives {lives}; "
                    f"create it inside the function (a NumPy array can be carried)")
    return None


class _Carrier(cloudpickle.Pickler):
    """cloudpickle, refusing what ``held_here`` names."""

    def reducer_override(self, obj):
        why = held_here(obj)
        if why:
            raise _Refused(why)
        return super().reducer_override(obj)


class _Fingerprinter(_Carrier):
    """Pickles what the code is, not where this process met it (see the module's docstring).
    The result is hashed, never loaded."""

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            return tuple, (_code_identity(obj),)
        rv = super().reducer_override(obj)
        if (isinstance(obj, type) and isinstance(rv, tuple) and _tracker_id is not None
                and getattr(rv[0], "__name__", "").startswith("_make_skeleton")):
            tid = _tracker_id(obj)
            args = tuple(obj.__qualname__ if isinstance(a, str) and a == tid else a
                         for a in rv[1])
            rv = (rv[0], args, *rv[2:])
        return rv


def _code_identity(code: types.CodeType) -> tuple:
    if code.co_name != "<lambda>":
        try:
            return ("source", code.co_name, textwrap.dedent(inspect.getsource(code)))
        except (OSError, TypeError):  # no source (exec of a string): the bytecode then
            pass
    consts = tuple(("frozenset", tuple(sorted(map(repr, c)))) if isinstance(c, frozenset) else c
                   for c in code.co_consts)  # a frozenset's order moves with the hash seed
    return ("bytecode", code.co_name, code.co_code, code.co_names, code.co_varnames,
            code.co_freevars, code.co_cellvars, code.co_argcount, code.co_kwonlyargcount,
            code.co_posonlyargcount, code.co_flags, consts)


def _dumps(obj, pickler=_Carrier) -> bytes:
    buf = io.BytesIO()
    pickler(buf, protocol=_PROTOCOL).dump(obj)
    return buf.getvalue()


def label(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def carry(functions, source: str) -> Carried:
    """Pickle ``functions`` (``(key, name, function)`` triples: the job's key, the name the job
    calls it by) into one code file's content; a function that cannot be carried raises a
    ``CarryError`` naming ``source``, its key, the function and the cause."""
    table = {}
    for key, name, fn in functions:
        if not callable(fn):
            raise CarryError(source, None, key, f"expected a function, got {type(fn).__name__}")
        try:
            _dumps(fn)
        except Exception as exc:  # noqa: BLE001 - whatever pickling raised, it is this function's
            raise CarryError(source, None, key, f"{label(fn)} cannot be carried to the worker "
                             f"by value: {culprit(fn, exc)}") from None
        table[name] = fn
    blob = _dumps(table)
    fingerprint = hashlib.sha256(_dumps(dict(sorted(table.items())), _Fingerprinter)).hexdigest()
    return Carried(blob, hashlib.sha256(blob).hexdigest(), fingerprint, tuple(table))


def culprit(fn, exc: BaseException, path: tuple = (), depth: int = 0) -> str:
    """Which of ``fn``'s references (closure, globals, defaults; a helper function's, three
    deep) cannot be pickled, and why, as ``fn -> helper -> 'name' is ...``."""
    path = path or (label(fn),)
    for name, value in _references(fn):
        try:
            _dumps(value)
        except Exception as inner:  # noqa: BLE001 - the cause is named, not handled
            if isinstance(value, types.FunctionType) and depth < 3:
                return culprit(value, inner, path + (name,), depth + 1)
            return f"{' -> '.join(path)} -> {name!r} is {_why(value, inner)}"
    return f"{' -> '.join(path)}: {_why(fn, exc) if isinstance(exc, _Refused) else _cause(exc)}"


def _why(value, exc: BaseException) -> str:
    if isinstance(exc, _Refused):
        return str(exc)
    return f"a {type(value).__name__}, which cannot be pickled ({_cause(exc)})"


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _references(fn):
    """``(name, value)`` of what pickling ``fn`` pickles besides its code."""
    if isinstance(fn, types.FunctionType):
        code = fn.__code__
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                yield name, cell.cell_contents
            except ValueError:  # an empty cell
                continue
        for name in _global_names(code):
            if name in fn.__globals__:
                yield name, fn.__globals__[name]
        params = code.co_varnames[:code.co_argcount]
        for name, value in zip(params[len(params) - len(fn.__defaults__ or ()):],
                               fn.__defaults__ or ()):
            yield name, value
        yield from (fn.__kwdefaults__ or {}).items()
    elif hasattr(fn, "func") and hasattr(fn, "args"):  # functools.partial
        yield "func", fn.func
        yield from ((f"args[{i}]", a) for i, a in enumerate(fn.args))
        yield from (fn.keywords or {}).items()
    else:  # a callable object: its attributes
        yield from getattr(fn, "__dict__", {}).items()


def _global_names(code: types.CodeType):
    seen = []
    for name in code.co_names:
        if name not in seen:
            seen.append(name)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            seen += [n for n in _global_names(c) if n not in seen]
    return seen


@dataclass(frozen=True)
class CellJob:
    """What ``orchestrator.run(model=fn, ...)`` hands the supervisor: the frozen job's text and
    the carried code, written into the run directory only once the run is admitted (a refused
    resume must not overwrite the code of the run it refused)."""

    text: str
    code: Carried

    def freeze(self, job_file: str) -> str:
        """Write the code file (first: the job names its hash) and the frozen job, both 0600;
        return the code file's path."""
        path = os.path.join(os.path.dirname(job_file), CODE_FILE)
        write_atomic(path, self.code.blob, mode=0o600)
        write_atomic(job_file, self.text.encode(), mode=0o600)
        return path


_LOADED: dict = {}


def load(job_file: str, code: CodeSpec) -> dict:
    """The carried functions by name, from the code file next to ``job_file``, once checked
    (see the module's docstring); ``CodeError`` says which file was refused and why."""
    path = os.path.join(os.path.dirname(os.path.abspath(job_file)), code.file)
    if (path, code.sha256) not in _LOADED:
        _read_owned(job_file)  # it names the hash: it must be this user's too
        blob = _read_owned(path)
        digest = hashlib.sha256(blob).hexdigest()
        if digest != code.sha256:
            raise CodeError(f"{path}: refused: its sha256 is {digest[:12]}, the frozen job "
                            f"{job_file} records {code.sha256[:12]}; it was not written by "
                            f"this run (run orchestrator.run(...) again to rewrite it)")
        try:
            table = cloudpickle.loads(blob)
        except Exception as exc:  # noqa: BLE001 - anything the unpickling raised, named
            raise CodeError(f"{path}: the carried code cannot be loaded in this process "
                            f"({sys.executable}): {type(exc).__name__}: {exc}") from exc
        if not isinstance(table, dict):
            raise CodeError(f"{path}: expected the carried functions by name, got "
                            f"{type(table).__name__}")
        _LOADED[(path, code.sha256)] = table
    return _LOADED[(path, code.sha256)]


def _read_owned(path: str) -> bytes:
    """The content of ``path``, if it is a regular file (not a symlink) of this user's that no
    one else may write; checked on the open file, so that it cannot be swapped in between."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise CodeError(f"{path}: cannot open the carried code's file ({exc.strerror}; a "
                        f"symlink is refused)") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CodeError(f"{path}: refused: not a regular file")
        if st.st_uid != os.getuid():
            raise CodeError(f"{path}: refused: owned by uid {st.st_uid}, not by this user "
                            f"(uid {os.getuid()}); only code this user wrote is unpickled")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CodeError(f"{path}: refused: writable by group or others (mode "
                            f"{stat.S_IMODE(st.st_mode):o}); the supervisor writes it 600")
        return f.read()

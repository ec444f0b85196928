"""Evidence in layers, the most specific first: what a failure text says beyond the signatures.

The signatures (``failure_signatures.yaml``) name texts we have seen. A real failure often comes
in a form they were not written from: another op, path, wrapper or library version. Measured on
the kept-out failure texts of ``tests/fixtures/failure_texts.yaml`` (real texts, none used to
write a signature or a rule), the signatures alone name 73 of 115 right; with the layers below,
104 (90 %). Fresh batches of Keras 3, JAX and CUDA texts, each measured once when new, did worse
(6, 3 and 4 of 12; the fifth, 13 of 20 before its own catalogue texts' rules and 19 after): a
sentence of a kind the catalogue has is named, a new one often is not.

Each layer is a small object with a ``name`` and ``find(source, job) -> [Finding]``; a list of
them is consulted in order and the first layer that finds anything decides (like tenacity's
composed stop/retry conditions, the order is the policy and each part stays testable alone):

1. ``signatures`` (recovery/failures.py): the catalogue, as before;
2. ``exception``: the class at the end of a traceback and where it was raised;
3. ``errno``: an OS error number or its text (ENOSPC, EIO, ENOTCONN, ESTALE, EROFS, EDQUOT);
4. ``grpc``: a gRPC / absl status code, by name, number or tf.errors class;
5. ``driver_log``: allocator and driver lines (BFC allocator, CUDA_ERROR_*, cuDNN, cuBLAS).

``consult(..., exhaustive=True)`` runs every layer and ranks all the candidates (layer, then
source, then the one found last in the text first) for ``orchestrator diagnose``.
"""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field

from orchestrator.core.kinds import Kind
from orchestrator.recovery import tracebacks


@dataclass(frozen=True)
class JobContext:
    """What belongs to the job: its directory, its modules, its factory functions."""

    dir: str | None = None
    modules: frozenset = frozenset()
    functions: frozenset = frozenset()

    @classmethod
    def from_spec(cls, spec) -> "JobContext":
        targets = [spec.model, spec.data, *(c.factory for c in spec.callbacks),
                   spec.learning_rate.function if spec.learning_rate else None]
        targets = [t.target for t in targets if t is not None]
        modules = {t.split(":")[0].split(".")[0] for t in targets}
        try:
            modules |= {n[:-3] for n in os.listdir(spec.job_dir) if n.endswith(".py")}
        except OSError:
            pass
        return cls(spec.job_dir, frozenset(modules), frozenset(t.split(":")[1] for t in targets))

    def owns(self, path: str) -> bool:
        """A frame in the job's own code (its directory or modules), or any user code that is
        not an installed package, the standard library or the orchestrator."""
        p = path.replace("\\", "/")
        if self.dir and p.startswith(self.dir.rstrip("/") + "/"):
            return True
        if tracebacks.module_of(p) in self.modules:
            return True
        return not tracebacks.is_library(p)


@dataclass(frozen=True)
class Source:
    """One text to read: ``head`` is what the signatures match (the error record's
    ``type: message``, as before), ``text`` what the other layers read (its traceback)."""

    name: str
    text: str
    head: str = ""


@dataclass(frozen=True)
class Finding:
    kind: str
    layer: str
    matched: str          # what the layer matched, in words
    evidence: str         # the line it matched in
    position: int = 0     # where in the text: found last = closer to the cause
    signature: object = None
    source: str = ""

    def as_dict(self) -> dict:
        return {"layer": self.layer, "kind": self.kind, "matched": self.matched,
                "evidence": self.evidence}


@dataclass(frozen=True)
class Verdict:
    decided: Finding | None
    candidates: tuple = field(default_factory=tuple)  # ranked; [0] is ``decided``

    @property
    def conflict(self) -> bool:
        return len({c.kind for c in self.candidates}) > 1


def consult(sources, job: JobContext | None, layers, exhaustive: bool = False) -> Verdict:
    """The first layer (in order) that finds anything in any source decides; within it the
    error record before the log, and in a text the evidence found last."""
    job = job or JobContext()
    ranked = []
    for layer in layers:
        for src in sources:
            found = layer.find(src, job)
            ranked += sorted((_tag(f, src.name) for f in found), key=lambda f: -f.position)
        if ranked and not exhaustive:
            break
    return Verdict(ranked[0] if ranked else None, tuple(ranked))


def _tag(f: Finding, source: str) -> Finding:
    return Finding(f.kind, f.layer, f.matched, f.evidence, f.position, f.signature, source)


def _line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start:end if end >= 0 else len(text)].strip()[:300]


# --- 2. the exception class at the end of a traceback, and where it was raised --------------

# Libraries whose import or load failing means the TensorFlow / accelerator install is broken.
_ACCEL_LIB = re.compile(r"(tensorflow|tf_keras|keras|jaxlib|\bjax\b|libtpu|\btpu|cuda|cudnn|"
                        r"cublas|cufft|curand|cusolver|cusparse|nccl|nvinfer|nvrtc|tensorrt|xla)",
                        re.I)
_LOADER = re.compile(r"cannot open shared object file|undefined symbol|DLL load failed|"
                     r"symbol not found")
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")
# ``cannot import name 'x' from 'jaxlib.xla_extension'``: two installed libraries that disagree.
_CANNOT_IMPORT = re.compile(r"cannot import name '?[\w.]+'? from '([\w.]+)'")
# A call that does not fit the function's signature: the caller's code is wrong wherever it was
# raised (a job's factory given a wrong argument, an API that renamed one).
_BAD_CALL = re.compile(r"([\w.<>]+)\(\) (?:got an unexpected keyword|missing \d+ required|"
                       r"takes \d+ positional|got multiple values)")
# Mistakes in code: raised in the job's code, or in a library the job's code called.
_CODE_ERRORS = {"TypeError", "ValueError", "AttributeError", "KeyError", "IndexError",
                "NameError", "UnboundLocalError", "AssertionError", "ZeroDivisionError",
                "SyntaxError", "IndentationError", "TabError", "NotImplementedError"}
# Not the job's mistake wherever raised: OS errors are the errno layer's, signals are kills.
_NOT_CODE = {"OSError", "IOError", "EnvironmentError", "KeyboardInterrupt", "SystemExit",
             "GeneratorExit", "FileNotFoundError", "PermissionError", "ConnectionError",
             "TimeoutError", "BrokenPipeError", "ConnectionResetError", "InterruptedError"}


class ExceptionLayer:
    """Layer 2. A ``*MemoryError`` is host memory; a failed import or library load names the
    library (TensorFlow, JAX, CUDA, TPU, or two of them that disagree: ``accelerator_context``;
    any other missing module, the job's own or a package it needs: ``user_error``, which a
    restart cannot install); otherwise an error raised in the job's own files or factories, a
    call that does not fit the function's signature wherever raised, or a mistake (TypeError,
    ValueError ...) raised in a library the job's code called, is ``user_error``. Any other
    class raised in library code with no job frame decides nothing."""

    name = "exception"

    def find(self, src: Source, job: JobContext) -> list:
        r = tracebacks.last_raised(src.text or src.head)
        if r is None:
            return []
        hit = self._judge(r, job)
        if hit is None:
            return []
        kind, why = hit
        return [Finding(kind, self.name, f"{r.name} {why}", r.line, r.position)]

    def _judge(self, r: tracebacks.Raised, job: JobContext):
        if r.name.endswith("MemoryError"):
            return Kind.OUT_OF_MEMORY, "(host memory)"
        missing = _NO_MODULE.search(r.message) if r.name.endswith(("ImportError",
                                                                   "ModuleNotFoundError")) else None
        if missing and missing.group(1).split(".")[0] in job.modules:
            return Kind.USER_ERROR, f"importing the job's module {missing.group(1)}"
        clash = _CANNOT_IMPORT.search(r.message) if r.name.endswith("ImportError") else None
        if missing or clash or _LOADER.search(r.message):
            what = (missing or clash).group(1) if missing or clash else _library_named(r.message)
            if _ACCEL_LIB.search(what):
                return Kind.ACCELERATOR_CONTEXT, f"loading {what}"
        if missing:  # not a framework: the job's own module or a package it needs is missing
            return Kind.USER_ERROR, f"importing {missing.group(1)} (not installed, or not on the path)"
        if r.name in _NOT_CODE or r.name.endswith(("OSError", "IOError")):
            return None
        inner = r.innermost
        if inner is not None and job.owns(inner.path):
            return Kind.USER_ERROR, f"raised in the job's {_where(inner)}"
        called = _BAD_CALL.match(r.message) if r.name == "TypeError" else None
        if called and called.group(1).split(".")[-1] in job.functions:
            return Kind.USER_ERROR, f"calling the job's factory {called.group(1)}()"
        if called:
            return Kind.USER_ERROR, f"calling {called.group(1)}() with arguments it does not take"
        if r.name in _CODE_ERRORS:
            mine = next((f for f in reversed(r.frames) if job.owns(f.path)), None)
            if mine is not None:
                return Kind.USER_ERROR, f"from a library the job's {_where(mine)} called"
        return None


def _library_named(message: str) -> str:
    m = re.search(r"([\w./-]+\.so(?:\.[\d.]+)?)", message)
    return m.group(1) if m else message[:200]


def _where(f: tracebacks.Frame) -> str:
    return f"{os.path.basename(f.path)}" + (f":{f.line}" if f.line else "") + \
        (f" in {f.function}" if f.function else "")


# --- 3. errno in OS error texts ---------------------------------------------------------------

_STORAGE_ERRNO = {errno.ENOSPC, errno.EIO, errno.ENOTCONN, errno.ESTALE, errno.EROFS,
                  errno.EDQUOT}
_ERRNO_NUMBER = re.compile(r"\[Errno (\d+)\]|\berrno\s*=\s*(\d+)|\bos error (\d+)|"
                           r"Os \{ code: (\d+)", re.I)
_ERRNO_NAME = re.compile(r"\b(" + "|".join(errno.errorcode[n] for n in _STORAGE_ERRNO) + r")\b")
_STRERROR = {os.strerror(n).lower(): n for n in _STORAGE_ERRNO}


class ErrnoLayer:
    """Layer 3. ENOSPC, EIO, ENOTCONN, ESTALE, EROFS and EDQUOT, as ``[Errno 28]``, h5py's
    ``errno = 28``, the symbolic name or the C library's text, are ``storage``."""

    name = "errno"

    def find(self, src: Source, job: JobContext) -> list:
        text, out = src.text or src.head, []
        for m in _ERRNO_NUMBER.finditer(text):
            n = int(next(g for g in m.groups() if g))
            if n in _STORAGE_ERRNO:
                out.append(self._hit(n, text, m.start()))
        for m in _ERRNO_NAME.finditer(text):
            out.append(self._hit(getattr(errno, m.group(1)), text, m.start()))
        low = text.lower()
        for words, n in _STRERROR.items():
            p = low.rfind(words)
            if p >= 0:
                out.append(self._hit(n, text, p))
        return out

    def _hit(self, n: int, text: str, pos: int) -> Finding:
        return Finding(Kind.STORAGE, self.name, f"errno {errno.errorcode[n]} ({n}): "
                       f"{os.strerror(n)}", _line_at(text, pos), pos)


# --- 4. gRPC status codes and names ------------------------------------------------------------

# absl/gRPC status codes; tf.errors classes carry the same codes (UnavailableError = 14 ...).
_GRPC = {"UNAVAILABLE": 14, "DEADLINE_EXCEEDED": 4, "RESOURCE_EXHAUSTED": 8, "ABORTED": 10,
         "INTERNAL": 13}
_BY_CODE = {v: k for k, v in _GRPC.items()}
_STATUS = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|ABORTED|INTERNAL)\b|"
                     r"\b(Unavailable|DeadlineExceeded|ResourceExhausted|Aborted)Error\b|"
                     r"\b(Unavailable|Deadline [Ee]xceeded|Resource exhausted|Aborted|Internal)\b[:.]|"
                     r"grpc_status\W{0,3}(\d+)|StatusCode\.([A-Z_]+)")
# INTERNAL is the accelerator runtime failing only where XLA (JAX, jaxlib, PJRT, libtpu) says it:
# TensorFlow and gRPC use it for much else.
_XLA_RUNTIME = re.compile(r"XlaRuntimeError|JaxRuntimeError|Execution of replica|"
                          r"Bad StatusOr access|\bxla\b|pjrt|jaxlib|libtpu", re.I)
# What TF itself takes for a lost worker/session (cluster_coordinator._is_worker_failure and
# fault_tolerance_test_base): an ABORTED with one of these is the accelerator going away.
_SESSION_LOST = re.compile(r"Session \w+ is not found|context_id|device incarnation|"
                           r"was probably restarted|has restarted|preempt|Socket closed|"
                           r"Connection reset by peer|Transport closed|"
                           r"failed to connect to all addresses", re.I)


class GrpcLayer:
    """Layer 4. UNAVAILABLE and DEADLINE_EXCEEDED are ``accelerator_unavailable``, and so is
    ABORTED with a lost session; RESOURCE_EXHAUSTED is ``out_of_memory``; INTERNAL from XLA's
    runtime (a CUDA library, a kernel launch, ptxas, the TPU runtime) is
    ``accelerator_context``, except on a line that is not a failure (a failed cuInit that
    TensorFlow logs and goes on without the GPU)."""

    name = "grpc"

    def find(self, src: Source, job: JobContext) -> list:
        text, out = src.text or src.head, []
        lost = _SESSION_LOST.search(text)
        xla = _XLA_RUNTIME.search(text)
        for m in _STATUS.finditer(text):
            code = self._code(m)
            if code == "ABORTED" and not lost:
                continue
            if code == "INTERNAL" and (not xla or _NOT_FAILURES.search(_line_at(text, m.start()))):
                continue
            kind = Kind.OUT_OF_MEMORY if code == "RESOURCE_EXHAUSTED" else \
                Kind.ACCELERATOR_CONTEXT if code == "INTERNAL" else \
                Kind.ACCELERATOR_UNAVAILABLE if code in _GRPC else None
            if kind:
                why = f" with a lost session ({lost.group(0)})" if code == "ABORTED" else ""
                out.append(Finding(kind, self.name, f"status {code}{why}",
                                   _line_at(text, m.start()), m.start()))
        return out

    @staticmethod
    def _code(m: re.Match) -> str | None:
        name = m.group(1) or m.group(2) or m.group(3) or m.group(5)
        if m.group(4):
            return _BY_CODE.get(int(m.group(4)))
        name = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name).replace(" ", "_").upper()
        return name if name in _GRPC else None


# --- 5. allocator and driver log lines ---------------------------------------------------------

_DRIVER = [  # (pattern, kind, what): first match per line, in this order
    (re.compile(r"bfc_allocator.*?(ran out of memory|Allocator \(\w+\) ran out)|"
                r"Allocator \(\w+_bfc\) ran out of memory|EigenAllocator for GPU ran out",
                re.I), Kind.OUT_OF_MEMORY, "BFC allocator out of memory"),
    (re.compile(r"CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"), Kind.OUT_OF_MEMORY,
     "CUDA_ERROR_OUT_OF_MEMORY"),
    (re.compile(r"could not create cudnn handle|CUDNN_STATUS_\w+|DNN library is not found|"
                r"cuDNN launch failure", re.I), Kind.ACCELERATOR_CONTEXT, "cuDNN failed"),
    (re.compile(r"failed to create cublas handle|CUBLAS_STATUS_\w+|Blas \w+ launch failed",
                re.I), Kind.ACCELERATOR_CONTEXT, "cuBLAS failed"),
    (re.compile(r"CUDA_ERROR_(NO_DEVICE|DEVICE_UNAVAILABLE|ECC_UNCORRECTABLE|LAUNCH_FAILED|"
                r"ILLEGAL_ADDRESS)"), Kind.ACCELERATOR_UNAVAILABLE, "CUDA device lost"),
    (re.compile(r"CUDA_ERROR_[A-Z_]+"), Kind.ACCELERATOR_CONTEXT, "CUDA driver error"),
]
# Lines that look like the above and are not failures: BFC's retry warning says so itself;
# TF logs a failed cuInit at E level and goes on on the CPU (a GPU job then fails on its own).
_NOT_FAILURES = re.compile(r"The caller indicates that this is not a failure|"
                           r"failed call to cuInit", re.I)


class DriverLogLayer:
    """Layer 5. BFC allocator out-of-memory lines and CUDA_ERROR_OUT_OF_MEMORY are
    ``out_of_memory``; cuDNN/cuBLAS initialisation failures and other CUDA driver errors are
    ``accelerator_context``; a lost device is ``accelerator_unavailable``."""

    name = "driver_log"

    def find(self, src: Source, job: JobContext) -> list:
        text, out, pos = src.text or src.head, [], 0
        for line in text.splitlines(keepends=True):
            if not _NOT_FAILURES.search(line):
                for rx, kind, what in _DRIVER:
                    m = rx.search(line)
                    if m:
                        out.append(Finding(kind, self.name, f"{what} ({m.group(0)})",
                                           line.strip()[:300], pos + m.start()))
                        break
            pos += len(line)
        return out


EXCEPTION, ERRNO, GRPC, DRIVER_LOG = ExceptionLayer(), ErrnoLayer(), GrpcLayer(), DriverLogLayer()
AFTER_SIGNATURES = (EXCEPTION, ERRNO, GRPC, DRIVER_LOG)

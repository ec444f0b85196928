"""What kind of failure an attempt died of: signatures (data), then evidence in layers.

A failed attempt leaves an exit status or a signal, maybe an error record (the exception the
worker caught) and its log. The kind decides the recovery, so it must come from the stable part
of a message, whatever wrapper the failure came in. The signatures live in
``failure_signatures.yaml`` next to this module; this module normalises and matches them and is
the first of the ``LAYERS`` (the others, for texts no signature was written from, are in
``evidence.py``). Supervisor side: never imports TensorFlow.
"""
from __future__ import annotations

import functools
import os
import re
import signal
from dataclasses import dataclass
from importlib import resources

import yaml

from orchestrator.core.rundir import EXIT_CONFIG
from orchestrator.core.kinds import KINDS, Kind
from orchestrator.recovery import evidence
from orchestrator.recovery.evidence import Finding, JobContext, Source

IGNORE = "ignore"
# Signals that come from outside (the user, the OOM killer, a recycled VM, our own stop).
_KILL_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
LOG_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class Signature:
    id: str
    kind: str
    match: tuple  # alternatives; each a tuple of normalised needles that must all occur
    source: str = ""
    raise_: dict | None = None
    escalate: dict | None = None


@dataclass(frozen=True)
class Diagnosis:
    kind: str
    signature: str | None
    evidence: str
    escalate: dict | None = None
    layer: str | None = None      # which evidence layer decided (None: exit status, signal ...)
    matched: str | None = None    # what that layer matched, in words

    def as_dict(self) -> dict:
        return {"kind": self.kind, "signature": self.signature, "evidence": self.evidence,
                "layer": self.layer, "matched": self.matched}


def normalise(text: str) -> str:
    """Lower case, escapes and every run of non-alphanumerics -> one space, padded."""
    text = re.sub(r"\\[ntr\"']", " ", text.lower())
    return " " + re.sub(r"[^a-z0-9]+", " ", text).strip() + " "


@functools.lru_cache(maxsize=None)
def catalogue(path: str | None = None) -> tuple[Signature, ...]:
    """The signatures, in file order (default: the package's failure_signatures.yaml)."""
    if path is None:
        text = resources.files(__package__).joinpath("failure_signatures.yaml").read_text()
        path = "orchestrator/recovery/failure_signatures.yaml"
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    entries = yaml.safe_load(text)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of signatures")
    out = []
    for i, e in enumerate(entries):
        where = f"{path}: signature {i + 1} ({e.get('id') if isinstance(e, dict) else e!r})"
        if not isinstance(e, dict) or not {"id", "kind", "match"} <= set(e):
            raise ValueError(f"{where}: expected a mapping with id, kind and match")
        if e["kind"] not in KINDS + (IGNORE,):
            raise ValueError(f"{where}: key 'kind': expected one of {', '.join(KINDS)}, ignore")
        alternatives = []
        for alt in e["match"]:
            needles = [alt] if isinstance(alt, str) else alt
            if not isinstance(needles, list) or not all(isinstance(n, str) for n in needles):
                raise ValueError(f"{where}: key 'match': expected strings or lists of strings")
            alternatives.append(tuple(normalise(n) for n in needles))
        out.append(Signature(e["id"], e["kind"], tuple(alternatives), e.get("source", ""),
                             e.get("raise"), e.get("escalate")))
    return tuple(out)


def injectable(kind: str) -> Signature | None:
    """The first signature of ``kind`` that says which real exception to raise for it."""
    return next((s for s in catalogue() if s.kind == kind and s.raise_), None)


@dataclass(frozen=True)
class Match:
    signature: Signature
    position: int
    evidence: str


def match_text(text: str, signatures=None) -> Match | None:
    """The signature found last in ``text`` (ignored texts masked first), or None."""
    found = match_all(text, signatures)
    return found[0] if found else None


def match_all(text: str, signatures=None) -> list[Match]:
    """Every signature that matches ``text``, the one found last first (ties: file order)."""
    if not text:
        return []
    signatures = catalogue() if signatures is None else signatures
    lines = text.splitlines() or [text]
    starts, parts, pos = [], [], 1
    for line in lines:  # one space between lines: a message wrapped over lines still matches
        part = normalise(line).strip()
        starts.append(pos)
        if part:
            parts.append(part)
            pos += len(part) + 1
    norm = " " + " ".join(parts) + " "
    for s in signatures:  # mask the known non-failures
        if s.kind == IGNORE:
            for alt in s.match:
                for needle in alt:
                    norm = norm.replace(needle, " " * len(needle))
    best: dict[str, tuple[int, int, Signature]] = {}
    for order, s in enumerate(signatures):
        if s.kind == IGNORE:
            continue
        for alt in s.match:
            found = [norm.rfind(n) for n in alt]
            if min(found) < 0:
                continue
            p = max(found)
            if s.id not in best or p > best[s.id][0]:
                best[s.id] = (p, order, s)
    out = []
    for p, _, sig in sorted(best.values(), key=lambda b: (-b[0], b[1])):
        line_no = max(i for i, st in enumerate(starts) if st <= p + 1)  # needles start with ' '
        out.append(Match(sig, p, lines[line_no].strip()[:300]))
    return out


class SignatureLayer:
    """Layer 1: the catalogue. On an error record it reads ``type: message`` only, as before."""

    name = "signatures"

    def find(self, src: Source, job: JobContext) -> list[Finding]:
        return [Finding(m.signature.kind, self.name, f"signature {m.signature.id}", m.evidence,
                        m.position, m.signature) for m in match_all(src.head or src.text)]


SIGNATURES = SignatureLayer()
#: The evidence layers in the order they are consulted; each only when those above found nothing.
LAYERS = (SIGNATURES, *evidence.AFTER_SIGNATURES)


def sources_of(error: dict | None, log: str) -> list[Source]:
    """The error record (its ``type: message`` for the signatures, its traceback for the other
    layers), then the log."""
    out = []
    if error:
        head = f"{error.get('qualified_type') or error.get('type')}: {error.get('message', '')}"
        out.append(Source("error record", error.get("traceback") or head, head))
    if log:
        out.append(Source("log", log, log))
    return out


def read_tail(path: str, nbytes: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - nbytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def classify(exit_code: int | None = None, error: dict | None = None, log: str = "",
             hang_s: float | None = None, oom: str | None = None,
             job: JobContext | None = None, layers=LAYERS) -> Diagnosis:
    """The kind of one failed attempt, from the most to the least specific evidence.
    ``oom``: the kernel's evidence that a SIGKILL was its OOM killer's (recovery/oom.py);
    ``job``: what belongs to the job (its files, modules, factories) for the exception layer."""
    if hang_s is not None:
        return Diagnosis(Kind.HANG, None, f"no heartbeat for {hang_s:.1f} s")
    if oom:
        return Diagnosis(Kind.OUT_OF_MEMORY, None, f"killed by the kernel's OOM killer ({oom})")
    if error and error.get("fatal"):
        return Diagnosis(Kind.USER_ERROR, None, _error_line(error))
    if exit_code is not None and exit_code < 0 and -exit_code in _KILL_SIGNALS:
        return Diagnosis(Kind.KILLED, None, f"killed by {signal_name(-exit_code)}")
    f = evidence.consult(sources_of(error, log), job, layers).decided
    if f is not None:
        sig = f.signature
        return Diagnosis(f.kind, sig.id if sig else None,
                         _error_line(error) if f.source == "error record" else f.evidence,
                         sig.escalate if sig else None, f.layer, f.matched)
    if exit_code == EXIT_CONFIG:
        return Diagnosis(Kind.USER_ERROR, None, f"exit code {EXIT_CONFIG} (configuration)")
    if exit_code is not None and exit_code > 128 and exit_code - 128 in _KILL_SIGNALS:
        return Diagnosis(Kind.KILLED, None, f"exit code {exit_code} ({signal_name(exit_code - 128)})")
    if error:
        return Diagnosis(Kind.UNKNOWN, None, _error_line(error))
    if exit_code is not None and exit_code < 0:
        return Diagnosis(Kind.UNKNOWN, None, f"killed by {signal_name(-exit_code)}")
    return Diagnosis(Kind.UNKNOWN, None, f"exit code {exit_code}" if exit_code is not None
                     else "no known signature")


def _error_line(error: dict) -> str:
    msg = (error.get("message") or "").strip().splitlines()
    return f"{error.get('type')}: {msg[0] if msg else ''}"[:300]

def kind_of(ended: dict) -> str | None:
    """The failure kind of an ``attempt_ended`` event, None for a success."""
    if ended.get("kind"):
        return ended["kind"]
    code = ended.get("exit_code")
    if code == 0:
        return None
    if ended.get("signal") or (isinstance(code, int) and code < 0):
        return Kind.KILLED
    if code == EXIT_CONFIG:
        return Kind.USER_ERROR
    return Kind.UNKNOWN

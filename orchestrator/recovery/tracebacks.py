"""The exception that ends a pasted traceback, and the frames it was raised through.

Failure texts reach the supervisor as Python tracebacks (``File "x.py", line 3, in f``), as
IPython/Colab tracebacks (``<ipython-input-4-..> in <module>``, ``[/usr/.../drive.py](...) in
_mount(...)``), with per-rank prefixes (``[rank1]: ``) or as a bare ``Type: message`` line.
This module only reads them; deciding what they mean is ``evidence.py``'s job.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

_PREFIX = r"(?:\[[\w ]+\]:\s*)?"  # torchrun/accelerate-style "[rank1]: " prefixes
_FRAME = re.compile(_PREFIX + r'\s*File "([^"]+)", line (\d+)(?:, in (\S+))?')
_IPY_FRAME = re.compile(r"^\[?(<ipython-input-[^>]+>|[^\s\[\]()]+\.py)\]?(?:\([^)]*\))? in "
                        r"(<module>|<cell line: \d+>|[\w.<>]+)")
# A line that starts with an exception class (dotted path allowed) and a colon or nothing.
_EXC = re.compile("^" + _PREFIX + r"((?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit|"
                  r"Interrupt|Warning)|StopIteration|KeyboardInterrupt))(?::\s?(.*))?\s*$")
_MESSAGE_CHARS = 2000

# Paths that are not the job's code: installed packages, the standard library, compiled modules,
# this orchestrator itself (installed -e from a checkout its frames are not in site-packages).
_LIBRARY = re.compile(r"(site-packages|dist-packages|/lib/python\d[\d.]*/|^<frozen |^<string>|"
                      r"\.pyx$|\.so$|(^|/)orchestrator/(train|core|recovery|supervise|"
                      r"checkpoint|ops)/|(^|/)orchestrator/(api|cli|__main__)\.py$)")


@dataclass(frozen=True)
class Frame:
    path: str
    line: int | None
    function: str | None


@dataclass(frozen=True)
class Raised:
    """The last exception in a text: its class, message and the frames above it."""

    qualified: str       # as written: tensorflow.python.framework.errors_impl.NotFoundError
    name: str            # the class name alone: NotFoundError
    message: str         # the rest of its line and what follows (capped)
    frames: tuple        # outermost first; the last one is where it was raised
    position: int        # character offset of the exception line in the text
    line: str            # the exception line itself, for evidence

    @property
    def innermost(self) -> Frame | None:
        return self.frames[-1] if self.frames else None


def last_raised(text: str) -> Raised | None:
    """The exception line found last in ``text`` and the frames of its traceback block."""
    if not text:
        return None
    lines = text.splitlines()
    offsets, pos = [], 0
    for line in lines:
        offsets.append(pos)
        pos += len(line) + 1
    for i in range(len(lines) - 1, -1, -1):
        m = _EXC.match(lines[i])
        if not m or lines[i][:1].isspace():
            continue
        frames = []
        for j in range(i - 1, -1, -1):  # walk up to the start of this traceback block
            if _EXC.match(lines[j]) and not lines[j][:1].isspace():
                break
            f = _FRAME.match(lines[j]) or _IPY_FRAME.match(lines[j])
            if f:
                frames.append(_frame(f))
        rest = "\n".join([m.group(3) or ""] + lines[i + 1:])[:_MESSAGE_CHARS]
        return Raised(m.group(1), m.group(2), rest, tuple(reversed(frames)), offsets[i],
                      lines[i].strip()[:300])
    return None


def _frame(m: re.Match) -> Frame:
    if m.re is _FRAME:
        return Frame(m.group(1), int(m.group(2)), m.group(3))
    return Frame(m.group(1), None, m.group(2))


def is_library(path: str) -> bool:
    """Installed packages, the standard library and the orchestrator: not the job's code."""
    return bool(_LIBRARY.search(path.replace("\\", "/")))


def module_of(path: str) -> str:
    """``/content/job/digits_job.py`` -> ``digits_job``."""
    return os.path.splitext(os.path.basename(path.replace("\\", "/")))[0]

"""The orchestrator's log lines: one ``logging`` hierarchy under ``orchestrator``, one format.

Every module logs to its own logger (``log = logging.getLogger(__name__)``). A line reads as it
always has: ``[tag] message``, the tag naming who speaks (``orchestrator`` for the supervisor,
``worker``, ``standby``, ``export``, ``fault`` in the worker's and the exporter's logs,
``orchestrator colab`` for the outer loop), chosen from the logger's name (``TAGS``) or a
record's own ``tag``. INFO goes to standard output, WARNING and above to standard error, each
line flushed (a worker's log file interleaves them with Keras's own output in order).

Two places set this up, nothing else adds a handler:

- ``configure()``, called by each process's entry point (the CLI, the worker, the
  exporter): the lines to the process's streams;
- ``routed(write)``, which a run's console holds for the length of the run (in a notebook as
  on the command line): INFO lines go to ``write`` instead (the console, which wipes its
  progress bar before a line and writes to the cell or terminal it was given), WARNING and
  above still to standard error.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Callable

ROOT = "orchestrator"

#: the tag of a logger's lines: the longest of these that its name starts with
TAGS = {
    ROOT: "orchestrator",
    f"{ROOT}.colab": "orchestrator colab",
    f"{ROOT}.train": "worker",
    f"{ROOT}.checkpoint.writer": "worker",
    f"{ROOT}.train.standby": "standby",
    f"{ROOT}.train.export": "export",
    f"{ROOT}.recovery.faults": "fault",
}

_lock = threading.Lock()


def tag_of(name: str) -> str:
    best = ROOT
    for prefix in TAGS:
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return TAGS[best]


class Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"[{getattr(record, 'tag', None) or tag_of(record.name)}] {record.getMessage()}"


class Lines(logging.Handler):
    """INFO to ``write`` (standard output when None), WARNING and above to standard error;
    the streams are looked up at each line (a notebook or a test may replace them)."""

    def __init__(self, write: Callable[[str], None] | None = None):
        super().__init__(logging.INFO)
        self.write = write
        self.setFormatter(Format())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if record.levelno >= logging.WARNING:
                print(text, file=sys.stderr, flush=True)
            elif self.write is not None:
                self.write(text)
            else:
                print(text, file=sys.stdout, flush=True)
        except Exception:  # noqa: BLE001 - logging's own rule: a line never raises
            self.handleError(record)


def configure() -> None:
    """A process's entry point: the orchestrator's lines to its standard streams (once), and
    not to the root logger's handlers as well (TensorFlow's absl sets one up in the worker:
    every line would be written twice)."""
    logger = logging.getLogger(ROOT)
    with _lock:
        if not any(isinstance(h, Lines) for h in logger.handlers):
            logger.addHandler(Lines())
        logger.setLevel(logging.INFO)
        logger.propagate = False


@contextlib.contextmanager
def routed(write: Callable[[str], None]):
    """For the length of a run, the orchestrator's INFO lines go to ``write`` only (the
    console), and nowhere else: not to ``configure``'s handler, nor to a notebook's root
    logger (no line twice)."""
    logger = logging.getLogger(ROOT)
    with _lock:
        saved = logger.handlers[:], logger.level, logger.propagate
        logger.handlers = [Lines(write)]
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        yield
    finally:
        with _lock:
            logger.handlers, level, logger.propagate = saved[0], saved[1], saved[2]
            logger.setLevel(level)

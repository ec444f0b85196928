"""What a person watching a run sees: one line per epoch, faults that stand out, a live bar.

The supervisor calls this module at each moment worth a line (attempt started, epoch committed,
fault, restart); every other line is a log line of the ``orchestrator`` loggers, which a run
routes here (``line``, core/logs.py). Each epoch line says the attempt, the restarts so far,
the last checkpoint and the ETA. Where the output is a terminal or a notebook cell, a bar within
the epoch is drawn by tqdm (``tqdm.auto``: a widget in a notebook with ipywidgets, as on Colab,
a text bar on a terminal) from the worker's ``heartbeat.json`` (watched with watchdog, not
polled); elsewhere (a log file, a pipe) no bar is ever made, only whole lines, because log files
and the tests that read them rely on one line per epoch. The worker's own output, TensorFlow's
log noise included, goes to ``attempts/<n>.log`` and never here.
"""
from __future__ import annotations

import os
import threading
import time
import warnings

from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from orchestrator.core import heartbeat
from orchestrator.core.journal import Journal
from orchestrator.core.formatting import fmt_duration, fmt_metrics
from orchestrator.core.events import Event

PREFIX = "[orchestrator]"
REDRAW_S = 0.2   # read the heartbeat at most this often (it may change every batch)
_RED, _BOLD, _RESET = "\x1b[31m", "\x1b[1m", "\x1b[0m"


def is_interactive(out) -> bool:
    """A terminal, or a Jupyter/Colab cell (ipykernel's stream, which renders ``\\r``)."""
    if type(out).__module__.split(".")[0] == "ipykernel":
        return True
    isatty = getattr(out, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class _HeartbeatEvents(FileSystemEventHandler):
    def __init__(self, path: str, callback):
        self.path, self.callback = os.path.abspath(path), callback

    def on_moved(self, event):  # heartbeat.json is replaced by a rename
        if os.path.abspath(event.dest_path) == self.path:
            self.callback()

    def on_modified(self, event):
        if os.path.abspath(event.src_path) == self.path:
            self.callback()

    on_created = on_modified


class Progress:
    def __init__(self, out, run_dir: str, epochs: int,
                 interactive: bool | None = None):
        self.out, self.run_dir, self.epochs = out, run_dir, epochs
        self.interactive = is_interactive(out) if interactive is None else interactive
        self.attempt = 0
        self.restarts = 0
        self.checkpoint = None     # (epoch, step) of the last committed checkpoint
        self._commits: list[tuple[float, int, int]] = []  # (time, epoch, attempt)
        self._steps_per_epoch: dict[int, int] = {}
        self._bar = None           # the tqdm bar of the epoch in progress, if any
        self._bar_key: tuple[int, int] | None = None     # (attempt, epoch) it shows
        self._last_draw = 0.0
        self._lock = threading.Lock()
        self._observer = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Watch the heartbeat for the bar (interactive output only)."""
        if not self.interactive:
            return
        self._observer = Observer()
        self._observer.schedule(_HeartbeatEvents(os.path.join(self.run_dir, heartbeat.FILE),
                                                 self._on_heartbeat), self.run_dir,
                                recursive=False)
        self._observer.start()

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None
        with self._lock:
            self._close_bar()

    # ------------------------------------------------------------------ moments
    def _say(self, msg: str) -> None:
        self.line(f"{PREFIX} {msg}")

    def fault(self, msg: str) -> None:
        """A fault, its kind and the action taken: a line that stands out."""
        text = f"{PREFIX} !! {msg}"
        self.line(f"{_BOLD}{_RED}{text}{_RESET}" if self.interactive else text)

    def attempt_started(self, n: int, from_epoch: int) -> None:
        self.attempt = n
        # no "of N": preemptions and errors have budgets of their own, on the fault line
        self._say(f"attempt {n} started at epoch {from_epoch}/{self.epochs}"
                 + (f" (restart {self.restarts})" if self.restarts else ""))

    def restarted(self, restarts: int, attempt: int, kind: str, how: str, action: str) -> None:
        self.restarts = restarts
        self.fault(f"FAULT {kind}: {how} -> {action}")

    def epoch_completed(self, epoch: int, metrics: dict, attempt, step: int | None,
                        committed_at: float | None) -> None:
        if step is not None:
            self.checkpoint = (epoch, step)
            self._commits.append((committed_at or time.time(), epoch, attempt))
        ckpt = (f"checkpoint epoch {self.checkpoint[0]} (step {self.checkpoint[1]})"
                if self.checkpoint else "no checkpoint yet")
        eta = self.eta(epoch)
        self._say(f"epoch {epoch}/{self.epochs} {fmt_metrics(metrics)} | attempt {attempt}, "
                 f"{self.restarts} restart(s), {ckpt}"
                 + (f", ETA {fmt_duration(eta)}" if eta is not None else ""))

    def eta(self, done: int) -> float | None:
        """Seconds left: epochs left times the recent time per epoch within one attempt."""
        rates = []
        for (t0, e0, a0), (t1, e1, a1) in zip(self._commits, self._commits[1:]):
            if a0 == a1 and e1 > e0 and t1 > t0:
                rates.append((t1 - t0) / (e1 - e0))
        if not rates or done >= self.epochs:
            return None
        recent = rates[-5:]
        return max(0.0, self.epochs - done) * sum(recent) / len(recent)

    # ------------------------------------------------------------------ the bar
    def _on_heartbeat(self) -> None:
        if not self.interactive:
            return  # a log file gets whole lines only
        hb = heartbeat.read(self.run_dir)
        if not hb or hb.get("attempt") != self.attempt or not hb.get("batch"):
            return  # batch 0: between epochs, the epoch line says it all
        now = time.time()
        if now - self._last_draw < REDRAW_S:
            return
        spe = self._steps_per_epoch.get(self.attempt) or self._read_steps_per_epoch()
        key, batch = (self.attempt, int(hb.get("epoch", 0)) + 1), int(hb["batch"])
        with self._lock:
            self._last_draw = now
            if self._bar is not None and (self._bar_key != key or batch < self._bar.n):
                self._close_bar()
            if self._bar is None:
                # ``initial``: a resumed epoch starts mid-way; tqdm's rate and ETA count
                # only the batches seen here
                self._bar = _tqdm()(total=spe, initial=batch, file=self.out, leave=False,
                                    desc=f"{PREFIX} epoch {key[1]}/{self.epochs}",
                                    unit="batch", mininterval=REDRAW_S)
                self._bar_key = key
            else:
                self._bar.update(batch - self._bar.n)

    def _read_steps_per_epoch(self) -> int | None:
        for e in Journal(os.path.join(self.run_dir, "events.jsonl")).iter(Event.WORKER_READY):
            if e.get("attempt") == self.attempt and e.get("steps_per_epoch"):
                self._steps_per_epoch[self.attempt] = int(e["steps_per_epoch"])
        return self._steps_per_epoch.get(self.attempt)

    def _close_bar(self) -> None:
        """Wipe the bar (``leave=False``), so that a line never continues it."""
        if self._bar is not None:
            self._bar.close()
            self._bar, self._bar_key = None, None

    def line(self, text: str) -> None:
        """A whole line (the bar wiped first): the console's own, and the orchestrator's log
        lines while a run routes them here (core/logs.routed)."""
        with self._lock:
            self._close_bar()
            print(text, file=self.out, flush=True)


def _tqdm():
    """``tqdm.auto.tqdm``, imported on first use. Without ipywidgets in a notebook it falls
    back to the text bar (which a notebook renders) and warns once; that warning would be
    the only noise in the cell, so it is silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from tqdm.auto import tqdm
    return tqdm

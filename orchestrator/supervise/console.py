"""What a person watching a run sees: one line per epoch, faults that stand out, a live bar.

The supervisor calls this module at each moment worth a line (attempt started, epoch committed,
fault, restart, end). Each epoch line says the attempt, the restarts so far, the last
checkpoint and the ETA. Where the output is a terminal or a notebook cell, a bar within the
epoch is redrawn in place from the worker's ``heartbeat.json`` (watched with watchdog, not
polled); elsewhere (a log file, a pipe) there is no bar, only whole lines. The worker's own
output, TensorFlow's log noise included, goes to ``attempts/<n>.log`` and never here.
"""
from __future__ import annotations

import os
import threading
import time

from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from orchestrator.core import heartbeat
from orchestrator.core.journal import Journal
from orchestrator.core.formatting import fmt_duration, fmt_metrics
from orchestrator.core.events import Event

PREFIX = "[orchestrator]"
BAR_WIDTH = 24
REDRAW_S = 0.2
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
        self._bar_shown = False
        self._last_draw = 0.0
        self._batch_rate: tuple[float, int] | None = None  # (time, batch) at epoch start
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
            self._clear_bar()

    # ------------------------------------------------------------------ moments
    def say(self, msg: str) -> None:
        self._line(f"{PREFIX} {msg}")

    def fault(self, msg: str) -> None:
        """A fault, its kind and the action taken: a line that stands out."""
        text = f"{PREFIX} !! {msg}"
        self._line(f"{_BOLD}{_RED}{text}{_RESET}" if self.interactive else text)

    def attempt_started(self, n: int, from_epoch: int) -> None:
        self.attempt = n
        self._batch_rate = None
        # no "of N": preemptions and errors have budgets of their own, on the fault line
        self.say(f"attempt {n} started at epoch {from_epoch}/{self.epochs}"
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
        self.say(f"epoch {epoch}/{self.epochs} {fmt_metrics(metrics)} | attempt {attempt}, "
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
        hb = heartbeat.read(self.run_dir)
        if not hb or hb.get("attempt") != self.attempt or not hb.get("batch"):
            return  # batch 0: between epochs, the epoch line says it all
        now = time.time()
        if now - self._last_draw < REDRAW_S:
            return
        spe = self._steps_per_epoch.get(self.attempt) or self._read_steps_per_epoch()
        epoch, batch = int(hb.get("epoch", 0)), int(hb["batch"])
        if self._batch_rate is None or batch < self._batch_rate[1]:
            self._batch_rate = (now, batch)
        t0, b0 = self._batch_rate
        rate = (batch - b0) / (now - t0) if now > t0 and batch > b0 else None
        with self._lock:
            self._last_draw = now
            self._draw(render_bar(epoch + 1, self.epochs, batch, spe, rate))

    def _read_steps_per_epoch(self) -> int | None:
        for e in Journal(os.path.join(self.run_dir, "events.jsonl")).iter(Event.WORKER_READY):
            if e.get("attempt") == self.attempt and e.get("steps_per_epoch"):
                self._steps_per_epoch[self.attempt] = int(e["steps_per_epoch"])
        return self._steps_per_epoch.get(self.attempt)

    def _draw(self, bar: str) -> None:
        self.out.write("\r" + bar + " " * 4)
        self.out.flush()
        self._bar_shown = True

    def _clear_bar(self) -> None:
        if self._bar_shown:
            self.out.write("\r" + " " * (BAR_WIDTH + 80) + "\r")
            self._bar_shown = False

    def _line(self, text: str) -> None:
        with self._lock:
            self._clear_bar()
            print(text, file=self.out, flush=True)


def render_bar(epoch: int, epochs: int, batch: int, steps_per_epoch: int | None,
               rate: float | None) -> str:
    """``epoch 3/10 [#########.........] 120/300 12.0 batch/s, epoch ETA 15s``"""
    if steps_per_epoch:
        filled = min(BAR_WIDTH, int(BAR_WIDTH * batch / steps_per_epoch))
        bar = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {batch}/{steps_per_epoch}"
    else:
        bar = f"batch {batch}"
    text = f"{PREFIX} epoch {epoch}/{epochs} {bar}"
    if rate:
        text += f" {rate:.1f} batch/s"
        if steps_per_epoch and batch < steps_per_epoch:
            text += f", epoch ETA {fmt_duration((steps_per_epoch - batch) / rate)}"
    return text

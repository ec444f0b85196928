"""A standby's own process: its lowered priority, and the promotion line it waits for.

No project module beyond this one: the fake worker's standby (tests/fakes) uses it too, and
reads its line as soon as it starts.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

log = logging.getLogger("orchestrator.train.standby")

STANDBY_NICE = 19
STANDBY_OOM_SCORE_ADJ = 1000  # the kernel's OOM killer takes the standby before the worker
OOM_SCORE_ADJ = "/proc/self/oom_score_adj"


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        return [0]


def _set_priority(nice: int) -> None:
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def _oom_score_adj(value: int) -> None:
    with open(OOM_SCORE_ADJ, "w", encoding="ascii") as f:
        f.write(str(value))


def lower_priority(nice: int = STANDBY_NICE) -> int:
    """Every thread of this process to ``nice``, and this process first in line for the
    kernel's OOM killer (it holds about as much memory as the worker, which must not be the
    one to go); returns the nice value before."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    _set_priority(max(before, nice))
    try:
        _oom_score_adj(STANDBY_OOM_SCORE_ADJ)  # raising it needs no privilege
    except OSError as exc:  # no procfs: only the priority is lowered
        log.info(f"oom_score_adj not raised ({exc})")
    return before


def restore_priority(before: int) -> str | None:
    """Every thread back to ``before``, the OOM score back to neutral; None when done, else
    why not (it stays lowered)."""
    try:
        _set_priority(before)
        _oom_score_adj(0)
    except PermissionError as exc:
        return (f"stays at nice {os.getpriority(os.PRIO_PROCESS, 0)} or OOM score "
                f"{STANDBY_OOM_SCORE_ADJ}: {exc} (restoring them needs root)")
    except FileNotFoundError:  # no procfs: the priority was all there was to restore
        return None
    return None


def wait_for_promotion(stream) -> dict | None:
    """Block until the supervisor writes the promotion line; None when the pipe closes (the
    supervisor discarded this standby or is gone). A line that is not the expected JSON
    object is an error: the two processes are the same version of this package."""
    line = stream.readline()
    if not line:
        return None
    order = json.loads(line)
    if not isinstance(order, dict) or not isinstance(order.get("attempt"), int):
        raise ValueError(f"promotion line {line!r}: expected {{\"attempt\": N}}")
    return order


class Promotion:
    """The promotion line, read on a thread of its own from the start of the warm-up, so that a
    standby can be *adopted* before it is ready: the supervisor promotes one still warming up
    when the worker dies (a kill 1-2 s after an attempt's first step finds it importing), and
    it gets its priority back at once (from this thread, every thread of the process) and
    finishes its start-up as the attempt, skipping what only a waiting standby needs (the
    traced step, which ``fit`` then does). It is never slower than a cold start: the same code
    from the same point, with the part already done behind it."""

    def __init__(self, stream, nice_before: int):
        self.stream, self.nice_before = stream, nice_before
        self.arrived = threading.Event()
        self.order: dict | None = None
        self.error: BaseException | None = None
        self.priority_why_not: str | None = None
        self.arrived_at: float | None = None
        threading.Thread(target=self._read, name="promotion", daemon=True).start()

    def _read(self) -> None:
        try:
            self.order = wait_for_promotion(self.stream)
        except Exception as exc:  # noqa: BLE001 - raised in the main thread by wait()
            self.error = exc
        if self.order is not None:
            self.arrived_at = time.time()
            self.priority_why_not = restore_priority(self.nice_before)
        self.arrived.set()

    def adopted(self) -> bool:
        """The line came while warming up (checked between the warm-up's stages)."""
        return self.arrived.is_set() and self.order is not None

    def closed(self) -> bool:
        """The pipe closed while warming up: discarded, or the supervisor is gone."""
        return self.arrived.is_set() and self.order is None and self.error is None

    def pending(self) -> bool:
        """Neither adopted nor closed: the warm-up goes on."""
        return not (self.adopted() or self.closed())

    def wait(self) -> dict | None:
        self.arrived.wait()
        if self.error is not None:
            raise self.error
        return self.order

"""Which checkpoints retention keeps (the job's ``checkpoint.keep*``): a policy, not a store.

It lives in core/, below the checkpoint store that applies it, so that the job spec can build it
(``CheckpointSpec.retention``) without importing the store: options never import what they
configure. It reads only a checkpoint's ``step``, ``epoch`` and ``manifest``
(checkpoint/store.Checkpoint); checkpoint/store.py, which applies it, imports it from here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Retention:
    """Which checkpoints to keep: the last ``keep``, every ``every_epochs``-th epoch-end one,
    and the best by ``best_metric`` (``best_mode`` min or max). Only verified ones count, so a
    corrupt checkpoint never pushes a good one out."""

    keep: int = 3
    every_epochs: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    def select(self, verified: list) -> set[int]:
        """The steps to keep among ``verified`` checkpoints (``Checkpoint``s, any order)."""
        ordered = sorted(verified, key=lambda c: c.step)
        keep = {c.step for c in ordered[-self.keep:]} if self.keep > 0 else set()
        if self.every_epochs:
            for c in ordered:
                if c.manifest.get("batch", 0) == 0 and c.epoch and c.epoch % self.every_epochs == 0:
                    keep.add(c.step)
        if self.best_metric:
            scored = [c for c in ordered
                      if isinstance((c.manifest.get("metrics") or {}).get(self.best_metric),
                                    (int, float))]
            if scored:
                sign = -1.0 if self.best_mode == "max" else 1.0
                best = min(scored, key=lambda c: (sign * c.manifest["metrics"][self.best_metric],
                                                  -c.step))
                keep.add(best.step)
        return keep

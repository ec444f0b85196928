"""How durations and metrics read in the console, status and the report (one way everywhere)."""
from __future__ import annotations


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 10:
        return f"{max(s, 0.0):.1f}s"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_metrics(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in metrics.items())

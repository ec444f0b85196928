"""Small statistics and formatting for the bench: medians, paired ratios, Markdown tables.

Absolute times on a shared machine are noisy, so the bench runs its arms interleaved
(A B A B ...) and quotes the median of the ratios of neighbouring runs, not a ratio of medians
taken at different moments.
"""
from __future__ import annotations

import statistics
from typing import Iterable, Sequence


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none."""
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


def spread(values: Iterable[float | None]) -> tuple[float, float] | None:
    """(min, max) of the values that are not None."""
    vs = [v for v in values if v is not None]
    return (min(vs), max(vs)) if vs else None


def paired_ratios(a: Sequence[float | None], b: Sequence[float | None]) -> list[float]:
    """a[i] / b[i] for each repetition i where both were measured (b > 0)."""
    return [x / y for x, y in zip(a, b) if x is not None and y is not None and y > 0]


def interleaved(arms: Sequence[str], reps: int) -> list[tuple[int, str]]:
    """The run order A B C A B C ...: every arm once per repetition, side by side."""
    return [(rep, arm) for rep in range(reps) for arm in arms]


def fmt_s(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}x"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def fmt_yes(v: bool | None) -> str:
    """A check's cell: yes, a bold no (it must stand out), or '-' when not checked."""
    return {True: "yes", False: "**no**", None: "-"}[v]


def fmt_median(values: Sequence[float | None], digits: int = 2) -> str:
    """'median (min-max, n=k)' of the measured values, or '-'."""
    m, r = median(values), spread(values)
    n = sum(v is not None for v in values)
    if m is None:
        return "-"
    if n == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ({r[0]:.{digits}f}-{r[1]:.{digits}f}, n={n})"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; cells are str()-ed, '|' escaped."""
    def cell(v):
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def side_by_side(arms_by_backend: dict[str, Sequence[str]],
                 reps: int) -> list[tuple[int, str, str]]:
    """The run order with several backends: per repetition, each arm on every backend that
    runs it, one after the other (TF A, JAX A, TF B, JAX B, TF C, ...), so that the two runs
    compared across backends are neighbours in time, as the arms of one backend are."""
    order: list[str] = []
    for arms in arms_by_backend.values():
        order += [a for a in arms if a not in order]
    return [(rep, backend, arm) for rep in range(reps) for arm in order
            for backend, arms in arms_by_backend.items() if arm in arms]

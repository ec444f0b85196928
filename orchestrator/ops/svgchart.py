"""A few SVG drawing primitives for the report's charts, written as text.

Why not a plotting library: ``orchestrator report`` must work on a plain install (the runtime
it is read on may have nothing but this package), and the page must stay one file that can be
mailed. Inline SVG needs no encoder and no image decoder, stays sharp at any zoom, keeps its
text selectable and searchable, and gives every mark a native tooltip (``<title>``) without
JavaScript. The charts need little: rectangles, lines, markers, text, "nice" ticks and a
legend that wraps; that is all this module has.
"""
from __future__ import annotations

import html
import math

FONT = "system-ui,-apple-system,'Segoe UI',Roboto,sans-serif"
TEXT, MUTED, GRID = "#222222", "#666666", "#e4e4e4"


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def text_width(s: str, size: float) -> float:
    """A conservative width estimate for a sans-serif label (used to avoid overlaps)."""
    return 0.6 * size * len(s)


def nice_ticks(lo: float, hi: float, target: int = 5, integer: bool = False) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 x 10^k) covering [lo, hi], about ``target`` of them."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if integer:
        step = max(1.0, round(step))
    first = math.ceil(lo / step - 1e-9) * step
    ticks, v = [], first
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 12))
        v += step
    return ticks


def fmt_tick(v: float, ticks: list[float]) -> str:
    """As few decimals as the tick spacing needs (0.2 -> 1, 0.25 -> 2, 5 -> 0)."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    decimals = next((d for d in range(7) if abs(round(step, d) - step) < step * 1e-6), 6)
    return f"{v:.{decimals}f}"


class Canvas:
    """An SVG document being written; ``str(canvas)`` is the ``<svg>`` element."""

    def __init__(self, width: int, height: int, label: str, element_id: str):
        self.width, self.height, self.label, self.id = width, height, label, element_id
        self.parts: list[str] = []

    def __str__(self) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" id="{esc(self.id)}" role="img" '
                f'width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" font-family="{esc(FONT)}" '
                f'font-size="11" aria-label="{esc(self.label)}"><title>{esc(self.label)}</title>'
                + "".join(self.parts) + "</svg>")

    def _add(self, tag: str, attrs: dict, tip: str | None = None, body: str = "") -> None:
        a = " ".join(f'{k.rstrip("_").replace("_", "-")}="{esc(v)}"'
                     for k, v in attrs.items() if v is not None)
        inner = (f"<title>{esc(tip)}</title>" if tip else "") + body
        self.parts.append(f"<{tag} {a}>{inner}</{tag}>" if inner else f"<{tag} {a}/>")

    def rect(self, x, y, w, h, fill, tip=None, **kw) -> None:
        self._add("rect", dict(x=_r(x), y=_r(y), width=_r(max(w, 0)), height=_r(max(h, 0)),
                               fill=fill, **kw), tip)

    def line(self, x1, y1, x2, y2, stroke, width=1.0, dash=None, tip=None) -> None:
        self._add("line", dict(x1=_r(x1), y1=_r(y1), x2=_r(x2), y2=_r(y2), stroke=stroke,
                               stroke_width=width, stroke_dasharray=dash), tip)

    def polyline(self, points, stroke, width=1.5, dash=None) -> None:
        pts = " ".join(f"{_r(x)},{_r(y)}" for x, y in points)
        self._add("polyline", dict(points=pts, fill="none", stroke=stroke, stroke_width=width,
                                   stroke_dasharray=dash, stroke_linejoin="round"))

    def marker(self, shape: str, x, y, size, fill, tip=None) -> None:
        """circle | square | triangle (pointing down) | cross | tick (a vertical bar)."""
        h = size / 2
        if shape == "circle":
            self._add("circle", dict(cx=_r(x), cy=_r(y), r=_r(h), fill=fill), tip)
        elif shape == "square":
            self.rect(x - h * 0.9, y - h * 0.9, size * 0.9, size * 0.9, fill, tip)
        elif shape == "triangle":
            pts = f"{_r(x - h)},{_r(y - h)} {_r(x + h)},{_r(y - h)} {_r(x)},{_r(y + h)}"
            self._add("polygon", dict(points=pts, fill=fill), tip)
        elif shape == "cross":
            d = (f"M{_r(x - h)},{_r(y - h)}L{_r(x + h)},{_r(y + h)}"
                 f"M{_r(x - h)},{_r(y + h)}L{_r(x + h)},{_r(y - h)}")
            self._add("path", dict(d=d, stroke=fill, stroke_width=2, fill="none"), tip)
        elif shape == "tick":
            self.rect(x - 1, y - h, 2, size, fill, tip)
        else:
            raise ValueError(f"unknown marker shape {shape!r}")

    def text(self, x, y, s, size=11, anchor="start", fill=TEXT, weight=None, rotate=None,
             baseline="middle", tip=None) -> None:
        transform = f"rotate({rotate} {_r(x)} {_r(y)})" if rotate else None
        self._add("text", dict(x=_r(x), y=_r(y), font_size=size, text_anchor=anchor, fill=fill,
                               font_weight=weight, transform=transform,
                               dominant_baseline=baseline), body=esc(s) + (
            f"<title>{esc(tip)}</title>" if tip else ""))


def _r(v) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(v)


def legend(c: Canvas, x: float, y: float, items, max_width: float, size: int = 11) -> float:
    """Draw ``(symbol, colour, label)`` items left to right, wrapping; return the height used.

    ``symbol``: a marker shape, ``line``, ``dash``, ``dotted`` (a vertical dotted rule) or
    ``swatch`` (a filled box)."""
    row_h, cx, cy = size + 8, x, y
    for symbol, colour, label in items:
        w = 22 + text_width(label, size) + 14
        if cx > x and cx + w > x + max_width:
            cx, cy = x, cy + row_h
        if symbol in ("line", "dash"):
            c.line(cx, cy, cx + 16, cy, colour, 2, "5 3" if symbol == "dash" else None)
        elif symbol == "dotted":
            c.line(cx + 8, cy - 6, cx + 8, cy + 6, colour, 1.5, "2 2")
        elif symbol == "swatch":
            c.rect(cx + 1, cy - 5, 14, 10, colour)
        else:
            c.marker(symbol, cx + 8, cy, 8, colour)
        c.text(cx + 22, cy, label, size)
        cx += w
    return cy - y + row_h


class Axes:
    """A plot area of ``c`` at (x, y, w, h) with data limits; maps data to pixels."""

    def __init__(self, c: Canvas, x, y, w, h, xlim, ylim):
        self.c, self.x, self.y, self.w, self.h = c, x, y, w, h
        self.x0, self.x1 = xlim
        self.y0, self.y1 = ylim

    def px(self, v: float) -> float:
        return self.x + (v - self.x0) / ((self.x1 - self.x0) or 1.0) * self.w

    def py(self, v: float) -> float:
        return self.y + self.h - (v - self.y0) / ((self.y1 - self.y0) or 1.0) * self.h

    def y_axis(self, ticks, label: str | None = None) -> None:
        """Grid lines at ``ticks``, their labels on the left, the axis title rotated."""
        for t in ticks:
            self.c.line(self.x, self.py(t), self.x + self.w, self.py(t), GRID)
            self.c.text(self.x - 6, self.py(t), fmt_tick(t, ticks), 10, "end", MUTED)
        if label:
            self.c.text(self.x - 48, self.y + self.h / 2, label, 11, "middle", TEXT, "600",
                        rotate=-90)

    def x_axis(self, ticks, label: str | None = None, fmt=None, grid: bool = True) -> None:
        base = self.y + self.h
        self.c.line(self.x, base, self.x + self.w, base, MUTED)
        for t in ticks:
            if grid:
                self.c.line(self.px(t), self.y, self.px(t), base, GRID)
            self.c.line(self.px(t), base, self.px(t), base + 4, MUTED)
            self.c.text(self.px(t), base + 14, (fmt or (lambda v: fmt_tick(v, ticks)))(t), 10,
                        "middle", MUTED)
        if label:
            self.c.text(self.x + self.w / 2, base + 32, label, 11, "middle", TEXT, "600")


def message(width: int, text: str, element_id: str, label: str) -> str:
    """A small chart-sized box that says why there is no chart (yet)."""
    c = Canvas(width, 60, label, element_id)
    c.rect(0.5, 0.5, width - 1, 59, "#fafafa", stroke="#dddddd")
    c.text(width / 2, 30, text, 12, "middle", MUTED)
    return str(c)

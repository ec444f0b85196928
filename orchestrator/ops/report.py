"""``orchestrator report RUN_DIR``: one self-contained HTML page and its SVG charts.

For the person who comes back hours later: the training curves by epoch, coloured by the
attempt that produced each epoch, with every restart marked; a timeline of the supervised wall
time cut by cause (training kept, start-up, each fault kind) with faults, recoveries and
checkpoints on it; the time lost per cause and the goodput (defined in ``timeline``). The charts
are inline SVG drawn by ``svgchart`` (no plotting library: the report works on a plain install),
written next to the page as well; the page needs nothing else, so it can be mailed or opened
offline. Every mark has a tooltip with its exact values. Nothing here imports TensorFlow.
"""
from __future__ import annotations

import html
import os
import time

from orchestrator.ops import timeline
from orchestrator.ops.svgchart import (MUTED, Axes, Canvas, legend, message, nice_ticks,
                                       text_width)
from orchestrator.core.formatting import fmt_duration, fmt_metrics
from orchestrator.ops.status import (format_budgets, format_outage, format_runtime,
                                     format_workers, load_run, run_status)
from orchestrator.core.kinds import Kind

# Fixed colours, so a reader (and the rendering test) can tell the series apart.
ATTEMPT_COLOURS = ["#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                   "#bcbd22", "#7f7f7f"]
CAUSE_COLOURS = {
    "useful": "#2ca02c", "in_progress": "#98df8a", "startup": "#aec7e8",
    "overhead": "#c7c7c7", "stopped": "#dbdb8d",
    Kind.KILLED: "#d62728", Kind.HANG: "#ff9896", Kind.OUT_OF_MEMORY: "#e6550d",
    Kind.ACCELERATOR_CONTEXT: "#843c39", Kind.ACCELERATOR_UNAVAILABLE: "#ad494a",
    Kind.ACCELERATOR_BUSY: "#d6616b", Kind.STORAGE: "#7b4173", Kind.USER_ERROR: "#636363",
    Kind.UNKNOWN: "#bd9e39",
}
FAULT_COLOUR = "#d62728"


WIDTH = 940
CHARTS = ("curves.svg", "timeline.svg", "time_by_cause.svg")
# Beyond this many epochs the markers would merge into a band: the line alone carries the colour.
MAX_MARKERS = 80


def write_report(run_dir: str, out_dir: str | None = None, now: float | None = None) -> dict:
    """Write ``report.html`` and the SVG charts into ``out_dir`` (default RUN_DIR/report)."""
    now = time.time() if now is None else now
    rd, events, running = load_run(run_dir)
    tl = timeline.build(events, running=running, now=now)
    status = run_status(run_dir, now=now)
    out_dir = out_dir or os.path.join(rd.root, "report")
    os.makedirs(out_dir, exist_ok=True)
    charts = dict(zip(CHARTS, (_curves(tl), _timeline(tl), _by_cause(status))))
    paths = {}
    for name, svg in charts.items():
        paths[name] = os.path.join(out_dir, name)
        with open(paths[name], "w", encoding="utf-8") as f:
            f.write('<?xml version="1.0" encoding="utf-8"?>\n' + svg + "\n")
    page = render_html(status, tl, charts, now)
    paths = {"report.html": os.path.join(out_dir, "report.html"), **paths}
    with open(paths["report.html"], "w", encoding="utf-8") as f:
        f.write(page)
    return paths


# ---------------------------------------------------------------------- charts
def _attempt_colour(n) -> str:
    return ATTEMPT_COLOURS[(int(n or 1) - 1) % len(ATTEMPT_COLOURS)]


def _series(tl: timeline.Timeline) -> dict[str, dict[int, tuple[float, int]]]:
    """metric -> epoch -> (value, attempt that trained it); numbers only."""
    out: dict[str, dict[int, tuple[float, int]]] = {}
    for e in tl.epochs:
        for k, v in (e.get("metrics") or {}).items():
            if isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):
                out.setdefault(k, {})[int(e["epoch"])] = (float(v), e.get("attempt"))
    return out


def _limits(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.08 or abs(hi) * 0.1 or 1.0
    return lo - pad, hi + pad


def _curves(tl: timeline.Timeline) -> str:
    series = _series(tl)
    bases = sorted({k[4:] if k.startswith("val_") else k for k in series},
                   key=lambda k: (k != "loss", k))
    if not bases:
        return message(WIDTH, "no epoch completed yet: the curves start with the first one",
                       "curves", "training curves")
    epochs = sorted({x for pts in series.values() for x in pts})
    attempts = sorted({a for pts in series.values() for _, a in pts.values()},
                      key=lambda n: n or 0)
    resumes = [a for a in tl.attempts if (a.n > 1 or a.session > 0)
               and epochs[0] - 1 <= a.from_epoch < epochs[-1]]
    items = [("line", MUTED, "training"), ("dash", MUTED, "validation (val_)")]
    if len(attempts) <= 16:
        items += [("circle", _attempt_colour(n), f"attempt {n}") for n in attempts]
    else:
        items += [("circle", _attempt_colour(n), f"attempt {n}") for n in attempts[:8]]
        items.append(("swatch", "#ffffff", f"... colours repeat every {len(ATTEMPT_COLOURS)}"))
    items.append(("dotted", FAULT_COLOUR, "restart (the next epoch is the new attempt's)"))
    left, right, panel_h, gap = 76, 16, 170, 34
    c = Canvas(WIDTH, 0, "training curves by epoch, coloured by attempt", "curves")
    # a strip above the first panel names the restarts, clear of the data
    top = 10 + legend(c, left, 18, items, WIDTH - left - right) + (22 if resumes else 8)
    xlim = (epochs[0] - 0.5, epochs[-1] + 0.5)
    xticks = [t for t in nice_ticks(epochs[0], epochs[-1], 10, integer=True)
              if epochs[0] <= t <= epochs[-1]] or [epochs[0]]
    for i, base in enumerate(bases):
        names = [n for n in (base, f"val_{base}") if n in series]
        ylim = _limits([v for n in names for v, _ in series[n].values()])
        ax = Axes(c, left, top + i * (panel_h + gap), WIDTH - left - right, panel_h, xlim, ylim)
        ax.y_axis(nice_ticks(*ylim, 4), base)
        last = i == len(bases) - 1
        ax.x_axis(xticks, "epoch" if last else None)
        for a in resumes:
            x = ax.px(a.from_epoch + 0.5)
            prev = next((p for p in tl.attempts if p.n == a.n - 1), None)
            why = f"attempt {a.n} from epoch {a.from_epoch + 1}" + (
                f", after {prev.kind}" if prev and prev.kind else "")
            c.line(x, ax.y - (16 if i == 0 else 0), x, ax.y + ax.h, FAULT_COLOUR, 1.5, "3 3",
                   tip=why)
        for name in names:
            _plot(c, ax, series[name], name, dashed=name != base)
    height = top + len(bases) * (panel_h + gap) + 12
    if resumes:
        _restart_labels(c, Axes(c, left, top, WIDTH - left - right, panel_h, xlim, (0, 1)),
                        resumes, tl)
    c.height = height
    return str(c)


def _plot(c: Canvas, ax: Axes, points: dict, name: str, dashed: bool) -> None:
    """The line in pieces, each in the colour of the attempt that trained its later epoch
    (so the colour survives where markers are too dense), then the markers."""
    xs = sorted(points)
    dash = "6 4" if dashed else None
    run: list[tuple[float, float]] = []
    for i, x in enumerate(xs):
        pt = (ax.px(x), ax.py(points[x][0]))
        if run and (points[x][1] != points[xs[i - 1]][1] or x != xs[i - 1] + 1):
            c.polyline(run, _attempt_colour(points[xs[i - 1]][1]), 2, dash)
            run = [run[-1]] if x == xs[i - 1] + 1 else []
        run.append(pt)
    if run:
        c.polyline(run, _attempt_colour(points[xs[-1]][1]), 2, dash)
    if len(xs) > MAX_MARKERS:
        return
    for x in xs:
        v, a = points[x]
        c.marker("square" if dashed else "circle", ax.px(x), ax.py(v), 8, _attempt_colour(a),
                 tip=f"{name} = {v:.6g} at epoch {x} (attempt {a})")


def _restart_labels(c: Canvas, ax: Axes, resumes, tl) -> None:
    """Name each restart above the first panel, skipping a label that would overlap."""
    end = -1e9
    for a in resumes:
        prev = next((p for p in tl.attempts if p.n == a.n - 1), None)
        label = f"attempt {a.n}" + (f" after {prev.kind}" if prev and prev.kind else "")
        x = ax.px(a.from_epoch + 0.5) + 4
        if x < end or x + text_width(label, 10) > ax.x + ax.w:
            continue
        c.text(x, ax.y - 9, label, 10, "start", FAULT_COLOUR)
        end = x + text_width(label, 10) + 8


def _time_unit(total: float) -> tuple[float, str]:
    return (1.0, "s") if total <= 600 else (60.0, "min") if total <= 5 * 3600 else (3600.0, "h")


def _offset_fn(tl: timeline.Timeline):
    """Map a timestamp to seconds of supervised time (gaps with no supervisor removed)."""
    starts = []
    acc = 0.0
    for s in tl.sessions:
        starts.append((s.started, s.ended, acc))
        acc += s.ended - s.started

    def offset(ts: float) -> float:
        for s0, s1, base in reversed(starts):
            if ts >= s0:
                return base + min(ts, s1) - s0
        return 0.0

    return offset, starts


def _fault_marks(c: Canvas, faults: list, y: float) -> None:
    """A triangle for each fault at its x, its kind below where the label has room."""
    end = -1e9
    for x, f in faults:
        c.marker("triangle", x, y, 11, FAULT_COLOUR,
                 tip=f"attempt {f.attempt}: {f.kind}: {f.detail} -> {f.action}")
        w = text_width(f.kind, 10)
        if x - w / 2 >= end and x + w / 2 <= WIDTH:
            c.text(x, y + 15, f.kind, 10, "middle", FAULT_COLOUR)
            end = x + w / 2 + 6


def _session_marks(c: Canvas, ax: Axes, sessions: list, xs: list, bases: list) -> None:
    """A dotted rule where a later run resumed, and each supervisor's host (a runtime)."""
    for x in xs[1:]:
        c.line(x, ax.y, x, ax.y + ax.h, "#333333", 1.2, "6 3",
               tip="a later `orchestrator run` resumed the run (time away is not shown)")
    for s, x, base in zip(sessions, xs, bases):
        if s.host:
            c.text(x + 3, ax.y + ax.h - 4, f"on {s.host}", 9, "start", MUTED,
                   tip=f"a supervisor on host {s.host} from {fmt_duration(base)}")


def _timeline(tl: timeline.Timeline) -> str:
    offset, starts = _offset_fn(tl)
    total = sum(s.ended - s.started for s in tl.sessions)
    if total <= 0:
        return message(WIDTH, "nothing supervised yet", "timeline", "timeline")
    scale, unit = _time_unit(total)
    left, right = 96, 20
    c = Canvas(WIDTH, 0, "timeline of the supervised time by cause", "timeline")
    ax = Axes(c, left, 30, WIDTH - left - right, 150, (0, total / scale), (0, 5))
    rows = {"attempts": 4.2, "checkpoints": 2.9, "faults": 1.9, "recoveries": 0.8}
    for name, y in rows.items():
        c.text(left - 10, ax.py(y), name, 11, "end")
    segs = timeline.segments(tl)
    for cause, t0, t1 in segs:
        x0, x1 = ax.px(offset(t0) / scale), ax.px(offset(t1) / scale)
        c.rect(x0, ax.py(4.65), max(x1 - x0, 0.8), ax.py(3.75) - ax.py(4.65),
               CAUSE_COLOURS.get(cause, "#bd9e39"),
               tip=f"{cause}: {fmt_duration(t1 - t0)} (from {fmt_duration(offset(t0))})")
    end = -1e9
    for a in tl.attempts:
        x = ax.px(offset(a.started) / scale)
        c.line(x, ax.py(4.75), x, ax.py(3.65), "#333333", 1)
        if x >= end:
            c.text(x + 2, ax.py(4.95), f"#{a.n}", 10, "start", MUTED,
                   tip=f"attempt {a.n} started at {fmt_duration(offset(a.started))}")
            end = x + text_width(f"#{a.n}", 10) + 6
    for e in tl.events:
        if e.get("event") in timeline.CHECKPOINT_EVENTS:
            c.marker("tick", ax.px(offset(e["ts"]) / scale), ax.py(rows["checkpoints"]), 14,
                     CAUSE_COLOURS["useful"], tip=f"checkpoint committed: epoch "
                     f"{e.get('epoch')}, step {e.get('step')}")
    _fault_marks(c, [(ax.px(offset(f.ts) / scale), f) for f in tl.faults],
                 ax.py(rows["faults"]))
    for ts, ev, detail in tl.markers:
        c.marker("cross", ax.px(offset(ts) / scale), ax.py(rows["recoveries"]), 8, "#7b4173",
                 tip=f"{ev}: {detail}")
    _session_marks(c, ax, tl.sessions, [ax.px(base / scale) for _, _, base in starts],
                   [base for _, _, base in starts])
    ticks = [t for t in nice_ticks(0, total / scale, 8) if t <= total / scale]
    ax.x_axis(ticks, f"supervised time ({unit}); time with no supervisor running is left out",
              grid=False)
    causes = list(dict.fromkeys(cause for cause, _, _ in segs))
    items = [("swatch", CAUSE_COLOURS.get(k, "#bd9e39"), k.replace("_", " ")) for k in causes]
    items += [("tick", CAUSE_COLOURS["useful"], "checkpoint"),
              ("triangle", FAULT_COLOUR, "fault"),
              ("cross", "#7b4173", "recovery / injected fault / hang")]
    if len(starts) > 1:
        items.append(("dotted", "#333333", "resumed by a later run"))
    c.height = int(ax.y + ax.h + 44 + legend(c, left, ax.y + ax.h + 50, items,
                                              WIDTH - left - right) + 6)
    return str(c)


def _by_cause(status: dict) -> str:
    by = status["time_by_cause_s"]
    if not by:
        return message(WIDTH, "no supervised time yet", "time_by_cause", "time by cause")
    left = 16 + max(text_width(k.replace("_", " "), 11) for k in by)
    right, row = 100, 24
    c = Canvas(WIDTH, 20 + row * len(by) + 30, "time by cause", "time_by_cause")
    biggest = max(by.values()) or 1.0
    scale, unit = _time_unit(biggest)
    ax = Axes(c, left, 10, WIDTH - left - right, row * len(by), (0, biggest / scale),
              (0, len(by)))
    ax.x_axis([t for t in nice_ticks(0, biggest / scale, 6) if t <= biggest / scale],
              f"time ({unit})")
    wall = status.get("wall_s") or sum(by.values())
    for i, (cause, secs) in enumerate(by.items()):
        y = ax.y + i * row + 4
        c.text(left - 8, y + (row - 8) / 2, cause.replace("_", " "), 11, "end")
        c.rect(left, y, ax.px(secs / scale) - left, row - 8, CAUSE_COLOURS.get(cause, "#bd9e39"),
               tip=f"{cause}: {fmt_duration(secs)}")
        share = f" ({secs / wall:.0%})" if wall else ""
        c.text(ax.px(secs / scale) + 6, y + (row - 8) / 2, fmt_duration(secs) + share, 10)
    return str(c)


# ---------------------------------------------------------------------- page
_CSS = """
body{font-family:system-ui,sans-serif;font-size:14px;margin:24px;color:#222;
max-width:980px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:28px 0 6px}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top} th{background:#f4f4f4}
.state{font-weight:bold} .fault{color:#b00} svg{max-width:100%;height:auto;display:block}
.summary td:first-child{font-weight:bold;white-space:nowrap} .how{color:#555;font-size:13px;
margin:0 0 8px;max-width:900px} figure{margin:0}
"""


def _figure(svg: str, how: str) -> str:
    """A chart and the sentence that says how to read it."""
    return f'<p class="how">{html.escape(how)}</p><figure>{svg}</figure>'


def _rows(rows) -> str:
    return "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)


def _summary(s: dict) -> list[tuple[str, str]]:
    """The summary table's rows: what ``status`` says, in words."""
    summary = [
        ("state", s["state"]),
        ("epoch", f"{s['epoch']}/{s['epochs']} (step {s['step']})"),
        ("attempts", f"{s['attempts']} ({s['failed_attempts']} failed)"),
        ("restarts", f"{s['restarts']} " + (
            "(" + ", ".join(f"{k}: {n}" for k, n in s["restarts_by_kind"].items()) + ")"
            if s["restarts_by_kind"] else "")),
        ("budgets", format_budgets(s["budgets"]) if s["budgets"] else "-"),
        ("workers", format_workers(s["workers"]) if s["workers"] else "1"),
        ("run directory outages", "; ".join(format_outage(o) for o in s["run_dir_outages"])
         or "none"),
        ("goodput", "-" if s["goodput"] is None else
         f"{s['goodput']:.1%} (useful {fmt_duration(s['useful_s'])} of "
         f"{fmt_duration(s['wall_s'])} supervised)"),
        ("lost to faults", fmt_duration(s["lost_to_faults_s"])),
        ("away (no supervisor)", fmt_duration(s["away_s"])),
        ("runtimes (orchestrator colab)",
         "; ".join(format_runtime(r) for r in s["runtimes"]) or "-"),
        ("last metrics", fmt_metrics(s["metrics"]) if s["metrics"] else "-"),
        ("last error", s["last_error"] or "-"),
        ("weights sha256", s["weights_sha256"] or "-"),
    ]
    for tier, c in s["checkpoints_by_tier"].items():
        summary.append((f"last checkpoint ({tier})",
                        "none" if c is None else f"epoch {c['epoch']}, step {c['step']}"))
    if s.get("failure"):
        summary.append(("failure", "; ".join(
            f"{k}: {', '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in s["failure"].items())))
    return summary


def render_html(s: dict, tl: timeline.Timeline, charts: dict, now: float) -> str:
    esc = html.escape
    offset, _ = _offset_fn(tl)
    summary = _summary(s)
    faults = [(fmt_duration(offset(f.ts)), f.attempt, f.kind, f.detail, f.action)
              for f in tl.faults]
    attempts = [(a.n, a.session + 1, a.from_epoch, a.epoch if a.epoch is not None else "-",
                 fmt_duration((a.ended or now) - a.started),
                 a.how or ("running" if a.ended is None else "-"), a.kind or "-")
                for a in tl.attempts]
    lost = [(k, fmt_duration(v)) for k, v in s["time_by_cause_s"].items()]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>orchestrator report: {esc(str(s['name']))}</title><style>{_CSS}</style></head>
<body>
<h1>Run {esc(str(s['name']))}: <span class="state">{esc(s['state'].upper())}</span></h1>
<div>{esc(s['run_dir'])} &middot; report written {esc(time.strftime('%Y-%m-%d %H:%M:%S',
                                                                     time.localtime(now)))}</div>
<h2>Summary</h2><table class="summary">{_rows(summary)}</table>
<h2>Training curves</h2>
{_figure(charts['curves.svg'], "One panel per metric, by epoch: the solid line is the training "
         "value, the dashed one the validation value; colour says which attempt trained the "
         "epoch, and a red dotted rule marks each restart. Hover a point for its value.")}
<h2>Timeline</h2>
{_figure(charts['timeline.svg'], "The supervised wall time, left to right, coloured by what "
         "it was spent on; below it every committed checkpoint, every fault (with its kind) and "
         "every recovery action. Hover a mark for details.")}
<h2>Where the time went</h2>
{_figure(charts['time_by_cause.svg'], "Each cause's share of the supervised time.")}
<table><tr><th>cause</th><th>time</th></tr>{_rows(lost) or
                                             '<tr><td colspan="2">none yet</td></tr>'}</table>
<p>Goodput is training time whose result was kept (from an attempt's first step to its last
committed checkpoint) over the time a supervisor ran; the rest is charged to the cause that
spent it (a fault's lost progress, the wait and the next start-up).</p>
<h2{' class="fault"' if faults else ''}>Faults and recoveries ({len(faults)})</h2>
<table><tr><th>at (supervised time)</th><th>attempt</th><th>kind</th><th>what happened</th>
<th>action</th></tr>
{_rows(faults) or '<tr><td colspan="5">none</td></tr>'}</table>
<h2>Attempts</h2>
<table><tr><th>attempt</th><th>session</th><th>started after epoch</th>
<th>ended after epoch</th><th>duration</th><th>ended</th><th>kind</th></tr>
{_rows(attempts) or '<tr><td colspan="7">none yet</td></tr>'}</table>
</body></html>
"""

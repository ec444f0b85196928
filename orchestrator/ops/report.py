"""``orchestrator report RUN_DIR``: one self-contained HTML page and its PNG images.

For the person who comes back hours later: the training curves by epoch, coloured by the
attempt that produced each epoch, with every restart marked; a timeline of the supervised wall
time cut by cause (training kept, start-up, each fault kind) with faults, recoveries and
checkpoints on it; the time lost per cause and the goodput (defined in ``timeline``). The images
are written as PNG files and inlined in the page (data URIs), so the page can be mailed or
opened offline. Plotting needs matplotlib (the ``report`` extra); nothing here imports
TensorFlow.
"""
from __future__ import annotations

import base64
import html
import io
import os
import time

from orchestrator.ops import timeline
from orchestrator.core.formatting import fmt_duration, fmt_metrics
from orchestrator.ops.status import (format_budgets, format_outage, format_workers, load_run,
                                     run_status)
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


class ReportUnavailable(RuntimeError):
    """The plotting library is missing."""


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as exc:
        raise ReportUnavailable(
            "the report needs matplotlib: pip install 'orchestrator[report]'") from exc
    matplotlib.rcParams["font.size"] = 9
    return Figure, FigureCanvasAgg


def write_report(run_dir: str, out_dir: str | None = None, now: float | None = None) -> dict:
    """Write ``report.html`` and the PNGs into ``out_dir`` (default RUN_DIR/report)."""
    now = time.time() if now is None else now
    Figure, Canvas = _matplotlib()
    rd, events, running = load_run(run_dir)
    tl = timeline.build(events, running=running, now=now)
    status = run_status(run_dir, now=now)
    out_dir = out_dir or os.path.join(rd.root, "report")
    os.makedirs(out_dir, exist_ok=True)
    images = {
        "curves.png": _curves(Figure, tl),
        "timeline.png": _timeline(Figure, tl),
        "time_by_cause.png": _by_cause(Figure, status),
    }
    paths = {}
    for name, fig in images.items():
        buf = io.BytesIO()
        Canvas(fig).print_png(buf)
        data = buf.getvalue()
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)
        images[name] = data
        paths[name] = os.path.join(out_dir, name)
    page = render_html(status, tl, images, now)
    paths["report.html"] = os.path.join(out_dir, "report.html")
    with open(paths["report.html"], "w", encoding="utf-8") as f:
        f.write(page)
    return paths


# ---------------------------------------------------------------------- charts
def _attempt_colour(n) -> str:
    return ATTEMPT_COLOURS[(int(n or 1) - 1) % len(ATTEMPT_COLOURS)]


def _curves(Figure, tl: timeline.Timeline):
    from matplotlib.ticker import MaxNLocator

    series: dict[str, dict[int, tuple[float, int]]] = {}
    for e in tl.epochs:
        for k, v in (e.get("metrics") or {}).items():
            if isinstance(v, (int, float)):
                series.setdefault(k, {})[e["epoch"]] = (float(v), e.get("attempt"))
    bases = sorted({k[4:] if k.startswith("val_") else k for k in series},
                   key=lambda k: (k != "loss", k))
    fig = Figure(figsize=(9, 2.8 * max(1, len(bases))), dpi=100)
    if not bases:
        ax = fig.subplots()
        ax.text(0.5, 0.5, "no epoch completed yet", ha="center", va="center")
        ax.set_axis_off()
        return fig
    axes = fig.subplots(len(bases), 1, squeeze=False, sharex=True)[:, 0]
    resumes = [a for a in tl.attempts if a.n > 1 or a.session > 0]
    for ax, base in zip(axes, bases):
        for name, style in ((base, "-"), (f"val_{base}", "--")):
            points = series.get(name)
            if not points:
                continue
            xs = sorted(points)
            ax.plot(xs, [points[x][0] for x in xs], style, color="#555555", linewidth=1,
                    label=name, zorder=1)
            for n in sorted({points[x][1] for x in xs}, key=lambda v: v or 0):
                sel = [x for x in xs if points[x][1] == n]
                ax.scatter(sel, [points[x][0] for x in sel], s=36, color=_attempt_colour(n),
                           marker="o" if style == "-" else "s", zorder=2,
                           label=f"attempt {n}" if style == "-" else None)
        for a in resumes:
            prev = next((p for p in tl.attempts if p.n == a.n - 1), None)
            ax.axvline(a.from_epoch + 0.5, color=FAULT_COLOUR, linestyle=":", linewidth=1.5)
            if ax is axes[0]:
                label = f"attempt {a.n}" + (f" after {prev.kind}" if prev and prev.kind else "")
                ax.text(a.from_epoch + 0.55, 0.97, label, transform=ax.get_xaxis_transform(),
                        va="top", fontsize=8, color=FAULT_COLOUR)
        ax.set_ylabel(base)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("epoch (marker colour: attempt that trained it; dotted: restart)")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle("training curves across attempts", fontsize=10)
    fig.tight_layout()
    return fig


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


def _timeline(Figure, tl: timeline.Timeline):
    fig = Figure(figsize=(9, 2.9), dpi=100)
    ax = fig.subplots()
    offset, starts = _offset_fn(tl)
    total = sum(s.ended - s.started for s in tl.sessions) or 1.0
    scale, unit = (60.0, "min") if total > 600 else (1.0, "s")
    segs = timeline.segments(tl)
    seen = set()
    for cause, t0, t1 in segs:
        x0 = offset(t0) / scale
        ax.broken_barh([(x0, (t1 - t0) / scale)], (1.6, 0.8),
                       facecolors=CAUSE_COLOURS.get(cause, "#bd9e39"),
                       label=cause if cause not in seen else None)
        seen.add(cause)
    for a in tl.attempts:
        ax.text(offset(a.started) / scale, 2.5, f"#{a.n}", fontsize=7, va="bottom")
    commits = [e["ts"] for e in tl.events if e.get("event") in timeline.CHECKPOINT_EVENTS]
    ax.scatter([offset(t) / scale for t in commits], [1.2] * len(commits), marker="|", s=80,
               color="#2ca02c", label="checkpoint")
    for f in tl.faults:
        x = offset(f.ts) / scale
        ax.scatter([x], [0.6], marker="v", s=70, color=FAULT_COLOUR, zorder=3)
        ax.text(x, 0.25, f.kind, fontsize=7, ha="center", va="top", color=FAULT_COLOUR)
    for i, (ts, ev, detail) in enumerate(tl.markers):
        ax.scatter([offset(ts) / scale], [0.9], marker="x", s=30, color="#7b4173", zorder=3,
                   label="recovery / injected fault / hang" if i == 0 else None)
    for s0, s1, base in starts[1:]:
        ax.axvline(base / scale, color="#333333", linestyle="--", linewidth=1)
    ax.set_ylim(-0.3, 3.0)
    ax.set_yticks([0.6, 1.2, 2.0], ["faults", "checkpoints", "attempts"])
    ax.set_xlim(0, total / scale)
    ax.set_xlabel(f"supervised time ({unit}; dashed: a later `run` resumed the run)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=6, fontsize=7,
              frameon=False)
    ax.set_title("timeline: where the wall time went", fontsize=10)
    fig.tight_layout()
    return fig


def _by_cause(Figure, status: dict):
    by = status["time_by_cause_s"]
    fig = Figure(figsize=(9, 0.5 + 0.35 * max(1, len(by))), dpi=100)
    ax = fig.subplots()
    names = list(by)[::-1]
    ax.barh(names, [by[k] for k in names],
            color=[CAUSE_COLOURS.get(k, "#bd9e39") for k in names])
    for i, k in enumerate(names):
        ax.text(by[k], i, " " + fmt_duration(by[k]), va="center", fontsize=8)
    gp = status["goodput"]
    ax.set_title(f"time by cause; goodput {gp:.1%}" if gp is not None else "time by cause",
                 fontsize=10)
    ax.set_xlabel("seconds")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------- page
_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:980px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top} th{background:#f4f4f4}
.state{font-weight:bold} .fault{color:#b00} img{max-width:100%;display:block}
.summary td:first-child{font-weight:bold}
"""


def _img(name: str, data: bytes, alt: str) -> str:
    b64 = base64.b64encode(data).decode()
    return f'<img id="{name.split(".")[0]}" alt="{html.escape(alt)}" ' \
           f'src="data:image/png;base64,{b64}">'


def _rows(rows) -> str:
    return "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)


def render_html(s: dict, tl: timeline.Timeline, images: dict, now: float) -> str:
    esc = html.escape
    offset, _ = _offset_fn(tl)
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
        ("last metrics", fmt_metrics(s["metrics"]) if s["metrics"] else "-"),
        ("last error", s["last_error"] or "-"),
        ("weights sha256", s["weights_sha256"] or "-"),
    ]
    for tier, c in s["checkpoints_by_tier"].items():
        summary.append((f"last checkpoint ({tier})",
                        "none" if c is None else f"epoch {c['epoch']}, step {c['step']}"))
    if s.get("failure"):
        summary.append(("failure", "; ".join(f"{k}: {v}" for k, v in s["failure"].items())))
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
<h2>Training curves</h2>{_img('curves.png', images['curves.png'], 'training curves')}
<h2>Timeline</h2>{_img('timeline.png', images['timeline.png'], 'timeline')}
<h2>Time lost per cause</h2>
{_img('time_by_cause.png', images['time_by_cause.png'], 'time by cause')}
<table><tr><th>cause</th><th>time</th></tr>{_rows(lost)}</table>
<p>Goodput is training time whose result was kept (from an attempt's first step to its last
committed checkpoint) over the time a supervisor ran; the rest is charged to the cause that
spent it (a fault's lost progress, the wait and the next start-up).</p>
<h2 class="fault">Faults and recoveries ({len(faults)})</h2>
<table><tr><th>at</th><th>attempt</th><th>kind</th><th>what happened</th><th>action</th></tr>
{_rows(faults) or '<tr><td colspan="5">none</td></tr>'}</table>
<h2>Attempts</h2>
<table><tr><th>attempt</th><th>session</th><th>from epoch</th><th>to epoch</th>
<th>duration</th><th>ended</th><th>kind</th></tr>{_rows(attempts)}</table>
</body></html>
"""

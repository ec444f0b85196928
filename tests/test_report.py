"""`orchestrator report`: a self-contained page with inline SVG charts, on a finished, a failed,
an empty and a long run, with no plotting library; rendered by a real headless Chromium and the
screenshot inspected for the charts' colours."""
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from orchestrator import cli
from orchestrator.ops.report import (ATTEMPT_COLOURS, CAUSE_COLOURS, CHARTS, FAULT_COLOUR,
                                     MAX_MARKERS)
from orchestrator.ops.svgchart import text_width

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SVG = re.compile(r"<svg\b.*?</svg>", re.S)


def _check_self_contained(page: str):
    assert "<script" not in page and "<link" not in page and "<img" not in page
    assert [m.group(0)[:60].split('id="')[1].split('"')[0] for m in SVG.finditer(page)] == [
        "curves", "timeline", "time_by_cause"]
    for svg in SVG.findall(page):
        ET.fromstring(svg)  # well-formed: a browser would show nothing of a broken one
    assert not re.search(r"(href|src)=\"(https?:|file:|/)", page)


@pytest.mark.integration
def test_report_of_a_finished_run(finished_run, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert cli.main(["report", finished_run, "-o", out]) == 0
    printed = capsys.readouterr().out
    assert f"report: {out}/report.html" in printed
    for name in CHARTS:
        assert f"chart:  {out}/{name}" in printed
        root = ET.parse(os.path.join(out, name)).getroot()  # a standalone file opens too
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
    page = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    _check_self_contained(page)
    curves = SVG.findall(page)[0]
    # axis titles, a legend entry per attempt, the restart named, exact values as tooltips
    for text in (">epoch</text>", ">loss</text>", ">attempt 1</text>", ">attempt 2</text>",
                 ">attempt 2 after killed</text>", "<title>loss = 1 at epoch 1 (attempt 1)",
                 "<title>loss = 0.2 at epoch 5 (attempt 2)"):
        assert text in curves, text
    timeline = SVG.findall(page)[1]
    assert ">supervised time (s); time with no supervisor running is left out</text>" in timeline
    assert ">killed</text>" in timeline and ">checkpoint</text>" in timeline
    # the wall time coloured by cause, each piece with its duration as a tooltip
    assert re.search(r'fill="%s"><title>useful: [\d.]+s \(from ' % CAUSE_COLOURS["useful"],
                     timeline)
    assert re.search(r'fill="%s"><title>killed: ' % CAUSE_COLOURS["killed"], timeline)
    assert "Run fake: <span class=\"state\">COMPLETED</span>" in page
    assert "<td>killed</td><td>killed by SIGKILL</td><td>restart in 0 s</td>" in page
    assert "restarts</td><td>1 (killed: 1)" in page
    assert ("budgets</td><td>errors 0 of 2 since the last checkpoint; preemptions 1 (no limit)"
            in page)  # preemptions apart from the job's own failures


@pytest.mark.integration
def test_report_of_a_failed_run(failed_run):
    assert cli.main(["report", failed_run]) == 0
    page = open(os.path.join(failed_run, "report", "report.html"), encoding="utf-8").read()
    _check_self_contained(page)
    assert "FAILED" in page and "Faults and recoveries (3)" in page
    assert "gave up: restart budget of 2 spent" in page
    assert "last error</td><td>attempt 3 (unknown): RuntimeError: planned exit 1" in page


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI") == "true":
        pytest.fail("no Chromium on the CI machine: .ci/run installs the `chromium` package")
    pytest.skip("no headless Chromium here (apt-get install chromium); CI installs it")


def _screenshot(page: str, png: str, tmp_path):
    Image = pytest.importorskip("PIL.Image", reason="the screenshot check needs Pillow")
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1000,2600",
           f"--screenshot={png}", "file://" + page]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0 and os.path.exists(png), p.stderr[-2000:]
    return Image.open(png).convert("RGB")


def _count(img, hex_colour: str, tol: int = 12) -> int:
    want = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return sum(n for n, px in img.getcolors(img.width * img.height)
               if all(abs(a - b) <= tol for a, b in zip(px, want)))


@pytest.mark.integration
def test_report_renders_in_a_real_browser(finished_run, tmp_path):
    out = str(tmp_path / "out")
    assert cli.main(["report", finished_run, "-o", out]) == 0
    page = os.path.join(out, "report.html")
    img = _screenshot(page, str(tmp_path / "report.png"), tmp_path)
    shutil.copy(str(tmp_path / "report.png"), os.path.join(finished_run, "screenshot.png"))
    colours = {"attempt 1 markers": ATTEMPT_COLOURS[0], "attempt 2 markers": ATTEMPT_COLOURS[1],
               "useful time": CAUSE_COLOURS["useful"], "fault (killed)": FAULT_COLOUR}
    counts = {k: _count(img, c) for k, c in colours.items()}
    assert all(n >= 50 for n in counts.values()), counts

    # the same page with its charts emptied: the colours are gone, so the check above is real
    with open(page, encoding="utf-8") as f:
        broken = SVG.sub('<svg xmlns="http://www.w3.org/2000/svg"></svg>', f.read())
    with open(os.path.join(out, "broken.html"), "w", encoding="utf-8") as f:
        f.write(broken)
    img = _screenshot(os.path.join(out, "broken.html"), str(tmp_path / "broken.png"), tmp_path)
    assert all(_count(img, c) < 50 for c in colours.values())


def test_report_of_a_journal_with_later_fields(tmp_path):
    from test_status import TWO_SESSIONS, _journal

    path = _journal(str(tmp_path / "run"), TWO_SESSIONS)
    assert cli.main(["report", path]) == 0
    page = open(os.path.join(path, "report", "report.html"), encoding="utf-8").read()
    _check_self_contained(page)
    assert "Faults and recoveries (3)" in page
    assert "<td>out_of_memory</td><td>ResourceExhaustedError: OOM when allocating tensor</td>" \
           "<td>halve_batch batch 64 -&gt; 32; restart in 2 s</td>" in page
    assert "the supervisor vanished (VM recycled or killed)" in page
    assert "away (no supervisor)</td><td>1h04m" in page
    assert "last checkpoint (durable)</td><td>epoch 3, step 30" in page


@pytest.mark.integration
def test_the_report_needs_no_plotting_library(finished_run, tmp_path):
    """A plain install: matplotlib (or any plotting library) cannot be imported."""
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['PIL'] = None\n"
            "from orchestrator import cli\n"
            f"sys.exit(cli.main(['report', {finished_run!r}, '-o', {str(tmp_path)!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_self_contained((tmp_path / "report.html").read_text(encoding="utf-8"))


def test_report_of_a_run_with_nothing_to_draw_yet(tmp_path):
    from test_status import _journal

    for name, rows in (("empty", []), ("fresh", [(100, "run_started", {"epochs": 3}),
                                                  (100, "attempt_started", {"attempt": 1})])):
        path = _journal(str(tmp_path / name), rows)
        assert cli.main(["report", path]) == 0
        page = open(os.path.join(path, "report", "report.html"), encoding="utf-8").read()
        _check_self_contained(page)
        assert "no epoch completed yet" in page
        assert "nothing supervised yet" in page and "no supervised time yet" in page


def test_report_of_a_long_run_stays_readable(tmp_path):
    """300 epochs, 20 attempts: no markers (the line carries the attempt's colour), the
    legend says the colours repeat, and restart labels that would overlap are left out."""
    from test_status import _journal

    rows, t, epoch = [(0, "run_started", {"epochs": 300})], 0.0, 0
    for n in range(1, 21):
        rows.append((t, "attempt_started", {"attempt": n, "from_epoch": epoch}))
        for _ in range(15):
            epoch, t = epoch + 1, t + 60
            rows += [(t, "epoch_completed", {"epoch": epoch, "attempt": n,
                                             "metrics": {"loss": 3 / epoch}}),
                     (t, "checkpoint_committed", {"epoch": epoch, "step": epoch * 10})]
        t += 5
        rows.append((t, "attempt_ended", {"attempt": n, "exit_code": 0 if n == 20 else -9,
                                          "signal": None if n == 20 else "SIGKILL"}))
    rows.append((t, "run_completed", {}))
    path = _journal(str(tmp_path / "long"), rows)
    assert cli.main(["report", path]) == 0
    page = open(os.path.join(path, "report", "report.html"), encoding="utf-8").read()
    _check_self_contained(page)
    curves = SVG.findall(page)[0]
    assert epoch > MAX_MARKERS and curves.count("<circle") == 8  # the legend's, no markers
    assert f"colours repeat every {len(ATTEMPT_COLOURS)}" in curves
    assert curves.count("<polyline") == 20  # one piece per attempt, each in its colour
    labels = [(float(x), label) for x, label in re.findall(
        r'<text x="([\d.]+)"[^>]*>(attempt \d+ after killed)</text>', curves)]
    assert len(labels) > 3  # some named, the crowded ones left to their tooltips, no overlap:
    assert all(x1 >= x0 + text_width(label, 10) for (x0, label), (x1, _) in zip(labels,
                                                                                labels[1:]))
    assert curves.count("<title>attempt ") == 19
    assert ">time (min)</text>" in SVG.findall(page)[2]

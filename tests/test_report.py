"""`orchestrator report`: a self-contained page with charts, on a finished and a failed run,
rendered by a real headless Chromium and the screenshot inspected for the charts' colours."""
import os
import re
import shutil
import subprocess

import pytest

from orchestrator import cli

pytest.importorskip("matplotlib", reason="the report needs the report extra")
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

from orchestrator.ops.report import ATTEMPT_COLOURS, CAUSE_COLOURS, FAULT_COLOUR  # noqa: E402


def _check_self_contained(page: str):
    assert "<script" not in page and "<link" not in page
    srcs = re.findall(r'src="([^"]*)"', page)
    assert len(srcs) == 3 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert not re.search(r"(href|src)=\"(https?:|file:|/)", page)


def test_report_of_a_finished_run(finished_run, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert cli.main(["report", finished_run, "-o", out]) == 0
    printed = capsys.readouterr().out
    assert f"report: {out}/report.html" in printed
    for name in ("curves.png", "timeline.png", "time_by_cause.png"):
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    page = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    _check_self_contained(page)
    assert "Run fake: <span class=\"state\">COMPLETED</span>" in page
    assert "<td>killed</td><td>killed by SIGKILL</td><td>restart in 0 s</td>" in page
    assert "restarts</td><td>1 (killed: 1)" in page
    assert ("budgets</td><td>errors 0 of 2 since the last checkpoint; preemptions 1 (no limit)"
            in page)  # preemptions apart from the job's own failures


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


def _screenshot(page: str, png: str, tmp_path) -> Image.Image:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1000,2600",
           f"--screenshot={png}", "file://" + page]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0 and os.path.exists(png), p.stderr[-2000:]
    return Image.open(png).convert("RGB")


def _count(img: Image.Image, hex_colour: str, tol: int = 12) -> int:
    want = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return sum(n for n, px in img.getcolors(img.width * img.height)
               if all(abs(a - b) <= tol for a, b in zip(px, want)))


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

    # the same page with its images broken: the colours are gone, so the check above is real
    with open(page, encoding="utf-8") as f:
        broken = re.sub(r'src="data:image/png;base64,[^"]*"', 'src="data:image/png;base64,AA"',
                        f.read())
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

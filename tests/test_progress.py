"""Live progress: one line per epoch with attempt/restarts/checkpoint/ETA, faults that stand out,
a bar (tqdm) within the epoch only on a terminal or in a notebook, and no worker noise."""
import io
import json
import re

import pytest

from helpers import supervise
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.supervise import console
from orchestrator.supervise.console import Progress, is_interactive

# tqdm's text bar: "[orchestrator] epoch 1/2:  25%|##5       | 2/8 [00:00<00:01,  4.10batch/s]"
BAR = r"\[orchestrator\] epoch \d/2: +\d+%\|[^|]*\| \d/8 \[[^\]\r\n]*\]"

KILL_THEN_FINISH = {"exit_at_epoch": {"1": [3, -9]}, "batches": 4, "epoch_s": 0.05}


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.integration
def test_plain_output_has_one_line_per_epoch_and_a_fault_line(fake_job, tmp_path):
    rc, out, _ = supervise(fake_job(epochs=5), KILL_THEN_FINISH)
    assert rc == 0
    lines = out.splitlines()
    epoch_lines = [ln for ln in lines if re.match(r"\[orchestrator\] epoch \d/5 ", ln)]
    assert [ln.split()[2] for ln in epoch_lines] == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    assert epoch_lines[0] == ("[orchestrator] epoch 1/5 loss=1 | attempt 1, 0 restart(s), "
                              "checkpoint epoch 1 (step 10)")
    assert re.fullmatch(r"\[orchestrator\] epoch 4/5 loss=0.25 \| attempt 2, 1 restart\(s\), "
                        r"checkpoint epoch 4 \(step 40\), ETA \d+\.\ds", epoch_lines[3])
    faults = [ln for ln in lines if "!!" in ln]
    assert len(faults) == 1 and re.fullmatch(
        r"\[orchestrator\] !! FAULT killed: attempt 1 failed after [\d.]+ s \(killed by "
        r"SIGKILL\) -> restarting in 0.0 s \(preemption 1\)", faults[0])
    assert "\r" not in out and "\x1b[" not in out  # no bar, no colour in a log file
    assert "oneDNN" not in out  # the worker's noise stays in its attempt log
    assert "oneDNN" in (tmp_path / "run" / "attempts" / "1.log").read_text()


@pytest.mark.integration
def test_a_terminal_gets_a_bar_within_the_epoch_and_red_faults(fake_job):
    term = FakeTerminal()
    plan = {"exit_at_epoch": {"1": [2, -9]}, "batches": 8, "epoch_s": 1.6}
    rc, out, _ = supervise(fake_job(epochs=2), plan, out=term)
    assert rc == 0
    bars = re.findall("\r(" + BAR + ")", out)
    assert bars, out
    assert any(re.search(r"<00:\d\d, +[\d.]+batch/s\]$", b) for b in bars), bars  # rate, ETA
    assert "\x1b[1m\x1b[31m[orchestrator] !! FAULT killed" in out
    # a line never continues a bar: the bar is wiped (\r, blanks, \r) before each line
    assert not re.search(r"\d/8[^\r\n]*\[orchestrator\]", out)
    assert re.search(r"\r {40,}\r\[orchestrator\] epoch 2/2 loss", out)


def _heartbeat(run_dir, attempt, epoch, batch):
    with open(run_dir / "heartbeat.json", "w") as f:
        json.dump({"attempt": attempt, "epoch": epoch, "batch": batch}, f)


def test_the_bar_follows_the_heartbeat_and_a_resumed_epoch_starts_mid_way(tmp_path, monkeypatch):
    monkeypatch.setattr(console, "REDRAW_S", 0.0)
    Journal(str(tmp_path / "events.jsonl")).append(Event.WORKER_READY, attempt=2,
                                                     steps_per_epoch=24)
    term = FakeTerminal()
    p = Progress(term, str(tmp_path), epochs=10, interactive=True)
    p.attempt = 2
    _heartbeat(tmp_path, 2, 2, 6)      # attempt 2 resumed epoch 3 at batch 6
    p._on_heartbeat()
    _heartbeat(tmp_path, 2, 2, 12)
    p._bar.mininterval = 0             # draw every update, as a slow epoch would
    p._on_heartbeat()
    bars = re.findall(r"\r(\[orchestrator\] epoch 3/10:[^\r]*)", term.getvalue())
    assert bars[0].startswith("[orchestrator] epoch 3/10:  25%|") and "| 6/24 [" in bars[0]
    assert "| 12/24 [" in bars[-1], bars
    _heartbeat(tmp_path, 1, 5, 3)      # a late heartbeat of an older attempt: ignored
    p._on_heartbeat()
    assert p._bar.n == 12
    p.epoch_completed(3, {"loss": 0.5}, 2, 72, 100.0)
    assert p._bar is None              # wiped before the line, never continued by it
    assert term.getvalue().endswith("\r[orchestrator] epoch 3/10 loss=0.5 | attempt 2, "
                                     "0 restart(s), checkpoint epoch 3 (step 72)\n")
    _heartbeat(tmp_path, 2, 3, 1)      # the next epoch: a new bar from batch 1
    p._on_heartbeat()
    assert (p._bar.n, p._bar.total, p._bar_key) == (1, 24, (2, 4))
    p.stop()
    assert p._bar is None

    log = io.StringIO()                # a log file: no bar, whatever the heartbeat says
    q = Progress(log, str(tmp_path), epochs=10)
    q.attempt = 2
    q._on_heartbeat()
    assert q._bar is None and log.getvalue() == ""


def test_eta():
    p = Progress(io.StringIO(), "/nonexistent", epochs=10, interactive=False)
    assert p.eta(1) is None
    for t, e, a in ((100, 1, 1), (110, 2, 1), (130, 3, 1), (500, 4, 2)):
        p._commits.append((t, e, a))
    assert p.eta(4) == 6 * 15.0  # mean of 10 s and 20 s an epoch within attempt 1


def test_is_interactive():
    assert not is_interactive(io.StringIO())
    assert is_interactive(FakeTerminal())


def test_a_module_s_log_line_reaches_the_run_s_console_in_the_cli_s_format(capsys):
    """What ``say`` used to carry: a module logs, and while a run routes the orchestrator's
    lines to its console (core/logs.routed) the line is the console's, bar wiped first; a
    warning goes to stderr; nothing reaches the root logger's handlers twice."""
    import logging

    from orchestrator.core import logs

    out, root_lines = FakeTerminal(), []
    progress = Progress(out, "unused", epochs=3, interactive=False)

    class Root(logging.Handler):
        def emit(self, record):
            root_lines.append(record.getMessage())

    root = Root()
    logging.getLogger().addHandler(root)
    try:
        with logs.routed(progress.line):
            logging.getLogger("orchestrator.supervise.lease").info("the lock is ours again")
            logging.getLogger("orchestrator.core.journal").warning("cannot write the journal")
    finally:
        logging.getLogger().removeHandler(root)
    assert out.getvalue() == "[orchestrator] the lock is ours again\n"
    assert capsys.readouterr().err == "[orchestrator] cannot write the journal\n"
    assert root_lines == []
    logging.getLogger("orchestrator.train.standby").info("discarded")  # the worker's format
    assert capsys.readouterr().out == "[standby] discarded\n"

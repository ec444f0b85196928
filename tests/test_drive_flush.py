"""Before a runtime is stopped, Drive's write-back cache is flushed from inside it and what is
not settled is said (colab/remote.flush_drive, colab/loop.py, api.py's notebook path)."""
import contextlib
import io
import json
import os
import sys
import types

import pytest

from orchestrator.colab import remote
from orchestrator.colab.replies import MARK, Reply
from orchestrator.core.events import Event
from test_colab import DONE, ScriptedCLI, _loop


def _run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "0000000010").mkdir(parents=True)
    (run / "checkpoints" / "0000000010" / "state.npz").write_bytes(b"x" * 100)
    (run / "export").mkdir()
    (run / "export" / "model.keras").write_bytes(b"m" * 100)
    (run / "events").mkdir()
    (run / "events" / "000001.jsonl").write_text('{"event": "run_completed"}\n')
    return str(run)


def _exec_snippet(code, flush):
    """Run a snippet as the runtime's kernel would, with ``google.colab.drive`` faked."""
    google, colab = types.ModuleType("google"), types.ModuleType("google.colab")
    colab.drive = types.SimpleNamespace(flush_and_unmount=flush)
    google.colab = colab
    saved = {k: sys.modules.get(k) for k in ("google", "google.colab")}
    sys.modules.update({"google": google, "google.colab": colab})
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<snippet>", "exec"), {})
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    line = next(x for x in out.getvalue().splitlines() if x.startswith(MARK))
    return json.loads(line[len(MARK):])


def test_a_flush_settles_the_final_checkpoint_the_export_and_the_journal(tmp_path):
    calls = []
    found = _exec_snippet(remote.flush_drive(_run_dir(tmp_path), timeout=5),
                          lambda: calls.append("flush"))
    assert calls == ["flush"]
    assert found["ok"] and found["settled"] == ["checkpoint", "export", "journal"]
    assert found["not_settled"] == []


def test_without_a_flush_what_was_just_written_is_not_settled(tmp_path):
    def fails():
        raise OSError("flush failed")

    found = _exec_snippet(remote.flush_drive(_run_dir(tmp_path), timeout=5), fails)
    assert not found["ok"] and "flush failed" in found["error"]
    assert found["not_settled"] == ["checkpoint", "export", "journal"]  # written just now
    old = _run_dir(tmp_path / "older")
    for d, _, files in os.walk(old):
        for n in files:
            os.utime(os.path.join(d, n), (1, 1))   # long ago: the estimate has passed
    found = _exec_snippet(remote.flush_drive(old, timeout=5), fails)
    assert found["settled"] == ["checkpoint", "export", "journal"] and not found["not_settled"]


class FlushCLI(ScriptedCLI):
    def __init__(self, flush_reply, **kw):
        super().__init__(**kw)
        self.flush_reply = flush_reply

    def exec(self, session, code, timeout):
        if "flush_and_unmount" in code:
            return self._r("flush", session, self.flush_reply)
        return super().exec(session, code, timeout)


def _marked(**found):
    return Reply([], 0, MARK + json.dumps(found) + "\n")


def test_the_outer_loop_flushes_drive_before_it_stops_a_completed_runtime(tmp_path):
    cli = FlushCLI(_marked(ok=True, seconds=3.0, settled=["checkpoint", "journal"],
                           not_settled=[]), probes={"orc-digits-1": [DONE]})
    loop, clock, out = _loop(tmp_path, cli)
    assert loop.run() == 0
    verbs = [c[0] for c in cli.calls]
    assert verbs.index("flush") < verbs.index("stop")
    e = loop.journal.events(Event.DRIVE_FLUSHED)[0]
    assert e["ok"] and e["settled"] == ["checkpoint", "journal"]
    assert "Drive flushed on orc-digits-1" in out.getvalue()


def test_a_flush_that_fails_says_what_may_not_have_reached_the_cloud(tmp_path):
    cli = FlushCLI(_marked(ok=False, seconds=300.0, error="no answer in 300 s",
                           settled=["export"], not_settled=["checkpoint", "journal"]),
                   probes={"orc-digits-1": [DONE]})
    loop, clock, out = _loop(tmp_path, cli)
    assert loop.run() == 0
    assert loop.journal.events(Event.DRIVE_FLUSHED)[0]["not_settled"] == ["checkpoint",
                                                                          "journal"]
    assert "checkpoint, journal may not have reached the cloud" in out.getvalue()


def test_the_notebook_s_end_of_a_run_on_colab_flushes_in_the_kernel(tmp_path, monkeypatch,
                                                                      caplog):
    from orchestrator import api
    from orchestrator.core.spec import CheckpointSpec

    calls = []
    google, colab = types.ModuleType("google"), types.ModuleType("google.colab")
    colab.drive = types.SimpleNamespace(flush_and_unmount=lambda: calls.append("flush"))
    google.colab = colab
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    with caplog.at_level("INFO", logger="orchestrator"):
        found = api.settle_drive(_run_dir(tmp_path), CheckpointSpec())
    assert calls == ["flush"] and found["settled"] == ["checkpoint", "export", "journal"]
    assert "Drive flushed" in caplog.text and "Drive is unmounted now" in caplog.text


def test_orchestrator_run_from_the_command_line_leaves_drive_mounted(monkeypatch, tmp_path):
    """`orchestrator colab` runs the CLI in a runtime and flushes from outside afterwards: a
    flush by the CLI's run would unmount Drive before the export is brought home (seen)."""
    from orchestrator import api, cli

    seen = {}
    monkeypatch.setattr(api, "run", lambda *a, **kw: seen.update(kw) or 0)
    assert cli.main(["run", str(tmp_path / "job.yaml")]) == 0
    assert seen["flush_drive"] is False

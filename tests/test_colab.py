"""The outer loop of ``orchestrator colab`` without Colab and without a process: the CLI's
replies as its source (and the released 0.7.5) prints them, the policy's decisions, and the
loop driven by a scripted CLI and a clock that moves only when told."""
import io
import json
import os
import re

import pytest

from helpers import ROOT, FakeClock
from orchestrator.colab import bundle, policy, remote, replies
from orchestrator.colab.colabcli import Reply
from orchestrator.colab.kinds import runtime_kind
from orchestrator.colab.loop import EXIT_BUDGET, EXIT_LOGIN, ColabLoop, Plan
from orchestrator.colab.policy import Backoff, Budgets, OuterPolicy
from orchestrator.core import hosts
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.ops import timeline

# What the released CLI (0.7.5) printed here, with no token and no terminal
OAUTH_NEEDED = Reply(["colab", "new"], 1,
                     "[colab] Creating session 't1'...\nEnter the authorization code: ",
                     "\nTo authorize colab-cli, visit this URL in any browser:\n\n  "
                     "https://accounts.google.com/o/oauth2/auth?x\n\nAfter approving, Google "
                     "will display an authorization code.\n\nAborted.\n")
ADC_NEEDED = Reply(["colab", "new"], 1, "[colab] Creating session 't1'...\n",
                   "No valid default credentials found. To authenticate, run:\n\n"
                   "  gcloud auth application-default login \\\n"
                   "      --scopes=openid,https://www.googleapis.com/auth/cloud-platform\n")
READY = Reply(["colab", "new"], 0, "[colab] Creating session 's'...\n[colab] Session READY.\n")


def _raised(line: str) -> Reply:
    return Reply(["colab", "new"], 1, "[colab] Creating session 's'...\n",
                 f"Traceback (most recent call last):\n  File \"x\", line 1\n{line}\n")


CAPACITY = _raised("colab_cli.client.ColabRequestError: Failed to issue request GET "
                   "https://colab.research.google.com/tun/m/assign?nbh=x: Service Unavailable")


# ---------------------------------------------------------------------------- replies
def test_new_tells_allocated_capacity_usage_limit_too_many_and_unknown_errors_apart():
    assert isinstance(replies.new_outcome(READY), replies.Allocated)
    assert replies.new_outcome(CAPACITY).reason == replies.CAPACITY
    assert replies.new_outcome(_raised(
        "colab_cli.client.ColabRequestError: Failed to issue request POST u: Too Many "
        "Requests")).reason == replies.CAPACITY
    rejected = Reply([], 1, "", "[colab] Backend rejected accelerator 'A100'. You may not have "
                                "quota or entitlement for this accelerator on your account.")
    assert replies.new_outcome(rejected).reason == replies.USAGE_LIMIT
    assert replies.new_outcome(_raised("colab_cli.client.TooManyAssignmentsError: Failed to "
                                       "issue request POST u: Precondition Failed")
                               ).reason == replies.TOO_MANY
    odd = replies.new_outcome(_raised("KeyError: 'endpoint'"))
    assert (odd.reason, odd.line) == (replies.ERROR, "KeyError: 'endpoint'")
    # a 0 without the READY line is no runtime
    assert replies.new_outcome(Reply([], 0, "[colab] Creating session 's'...\n")).reason == \
        replies.ERROR


def test_an_expired_login_is_told_apart_with_the_command_the_user_must_run():
    oauth = replies.new_outcome(OAUTH_NEEDED)
    assert isinstance(oauth, replies.LoginExpired) and "`colab sessions`" in oauth.line
    adc = replies.new_outcome(ADC_NEEDED)
    assert isinstance(adc, replies.LoginExpired)
    assert ("`gcloud auth application-default login --scopes=openid,"
            "https://www.googleapis.com/auth/cloud-platform`") in adc.line


def test_a_session_is_gone_only_when_the_cli_says_so_of_that_session():
    lost = Reply([], 1, "[colab] Session 's1' appears to be lost (404/401). Cleaning up.\n")
    assert replies.session_gone(lost, "s1")
    assert replies.session_gone(Reply([], 0, "[colab] Pruned 1 stale local session(s).\n"
                                             "[colab] Session 's1' not found.\n"), "s1")
    alive = Reply([], 0, "[s1] ep | Hardware: T4 | Variant: GPU | Status: IDLE\n")
    assert not replies.session_gone(alive, "s1")
    # our code's own error text, another session, a timeout: not gone
    assert not replies.session_gone(Reply([], 0, "", "FileNotFoundError: x not found."), "s1")
    assert not replies.session_gone(Reply([], 0, "[colab] Session 's2' not found.\n"), "s1")
    assert not replies.session_gone(Reply([], -1, "", "", timed_out=True), "s1")


def test_only_the_last_whole_marker_of_our_code_counts():
    out = (f"noise\n{replies.MARK}{{\"a\": 1}}\n{replies.MARK}{{\"a\": 2}}\n"
           f"{replies.MARK}{{torn\n")
    assert replies.marked(Reply([], 0, out)) == {"a": 2}
    assert replies.marked(Reply([], 0, "Traceback ...")) is None


# ---------------------------------------------------------------------------- policy
def test_refusals_back_off_doubling_to_the_cap_and_capacity_never_stops_the_loop():
    p = OuterPolicy(backoff=Backoff(initial_s=60, max_s=600, multiplier=2))
    waits = [p.refused(replies.CAPACITY) for _ in range(6)]
    assert [w for w, _ in waits] == [60, 120, 240, 480, 600, 600]
    assert all(stop is None for _, stop in waits)
    p.allocated()
    assert p.refused(replies.USAGE_LIMIT) == (60, None)  # a runtime given starts afresh


def test_errors_that_are_no_refusal_stop_after_so_many_in_a_row():
    p = OuterPolicy(budgets=Budgets(max_errors_in_row=3))
    assert p.refused(replies.ERROR)[1] is None
    assert p.refused(replies.CAPACITY)[1] is None  # a known refusal breaks the row
    assert p.refused(replies.ERROR)[1] is None and p.refused(replies.ERROR)[1] is None
    wait, stop = p.refused(replies.ERROR)
    assert wait is None and "3 times in a row" in stop


def test_each_budget_stops_further_requests_naming_its_option():
    p = OuterPolicy(budgets=Budgets(max_sessions=2, max_hours=1.0, max_runtime_hours=0.5),
                    started=100.0)
    assert p.may_request(100.0) is None
    p.allocated()
    p.allocated()
    assert "--max-sessions" in p.may_request(100.0)
    p = OuterPolicy(budgets=Budgets(max_sessions=None, max_hours=1.0), started=100.0)
    assert p.may_request(100.0 + 3599) is None and "--max-hours" in p.may_request(100.0 + 3600)
    p = OuterPolicy(budgets=Budgets(max_sessions=None, max_runtime_hours=0.5))
    p.ended(1799.0)
    assert p.may_request(0.0) is None
    p.ended(1.0)
    assert "--max-runtime-hours" in p.may_request(0.0)


def _probe(**found) -> Reply:
    return Reply([], 0, f"{replies.MARK}{json.dumps(found)}\n")


def test_a_probe_tells_running_exited_gone_and_unreachable_apart():
    assert policy.judge(_probe(supervisor="running"), "s")[0] == policy.RUNNING
    done = {"state": "completed"}
    assert policy.judge(_probe(supervisor="exited", rc=0, status=done), "s")[0] == \
        policy.COMPLETED
    # an exit 0 whose run is not completed is not believed
    assert policy.judge(_probe(supervisor="exited", rc=0, status={"state": "stopped"}),
                        "s")[0] == policy.SUPERVISOR_DIED
    assert [policy.judge(_probe(supervisor="exited", rc=rc), "s")[0] for rc in (1, 2, 3, 130)] \
        == [policy.FAILED, policy.BAD_JOB, policy.LOCKED, policy.STOPPED]
    assert policy.judge(_probe(supervisor="gone"), "s")[0] == policy.SUPERVISOR_DIED
    assert policy.judge(Reply([], 1, "[colab] Session 's' appears to be lost (404/401). "
                                     "Cleaning up."), "s")[0] == policy.LOST
    assert policy.judge(Reply([], -1, "", "", timed_out=True), "s")[0] == policy.UNREACHABLE


def test_an_unreachable_runtime_is_given_the_grace_then_counts_as_lost():
    r = policy.Reachability(grace_s=300)
    assert not r.silent(1000.0) and not r.silent(1299.0)
    r.answered()
    assert not r.silent(1300.0) and r.silent(1600.0)


# ---------------------------------------------------------------------------- kinds, bundle
def test_a_kind_the_cli_would_silently_replace_is_refused_naming_the_choices():
    assert runtime_kind(gpu="t4").flags == ["--gpu", "T4"]
    assert runtime_kind(tpu="V5E1").flags == ["--tpu", "v5e1"]
    assert runtime_kind().flags == []
    with pytest.raises(ValueError, match="expected one of T4, L4, G4, A100, H100"):
        runtime_kind(gpu="K80")  # the CLI would give an A100
    with pytest.raises(ValueError, match="expected one of v5e1, v6e1"):
        runtime_kind(tpu="v2-8")  # the CLI would give a v6e1
    with pytest.raises(ValueError, match="one accelerator"):
        runtime_kind(tpu="v5e1", gpu="T4")


def test_the_requirements_sent_to_a_runtime_are_the_packages_and_no_framework():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        block = re.search(r"^dependencies = \[(.*?)\]", f.read(), re.S | re.M).group(1)
    deps = re.findall(r'"([^"]+)"', block)
    assert sorted(bundle.REQUIRES) == sorted(deps)
    assert not {r.split(">=")[0] for r in bundle.REQUIRES} & set(remote.FRAMEWORKS)


# ---------------------------------------------------------------------------- outer journal
def test_the_outer_journal_reads_as_runtimes_with_their_refusals_and_ends():
    ev = [{"ts": 0, "event": Event.RUNTIME_REQUESTED, "session": "a-1", "kind": "gpu T4"},
          {"ts": 5, "event": Event.RUNTIME_ALLOCATED, "session": "a-1"},
          {"ts": 6, "event": Event.RUNTIME_READY, "session": "a-1", "host": "h1"},
          {"ts": 9, "event": Event.RUNTIME_ENDED, "session": "a-1", "why": "lost", "step": 40},
          {"ts": 10, "event": Event.RUNTIME_REQUESTED, "session": "a-2", "kind": "gpu T4"},
          {"ts": 11, "event": Event.RUNTIME_REFUSED, "session": "a-2", "reason": "capacity"},
          {"ts": 71, "event": Event.RUNTIME_REQUESTED, "session": "a-2", "kind": "gpu T4"},
          {"ts": 72, "event": Event.RUNTIME_ALLOCATED, "session": "a-2"}]
    got = [h.record(until=100) for h in hosts.hosts(ev)]
    assert [(r["session"], r["host"], r["why"], r["refusals"], r["lasted_s"], r["step"])
            for r in got] == [("a-1", "h1", "lost", 0, 4, 40), ("a-2", None, "running", 1, 28,
                                                                  None)]
    assert hosts.span(ev, now=100) == (0, 100)
    assert hosts.span(ev + [{"ts": 90, "event": Event.OUTER_ENDED}], now=100) == (0, 90)


def test_goodput_counts_the_time_between_runtimes_when_an_outer_loop_carried_the_run():
    ev = [{"ts": 10, "event": Event.RUN_STARTED, "host": "h1"},
          {"ts": 30, "event": Event.ATTEMPT_STARTED, "attempt": 1},
          {"ts": 40, "event": Event.RUN_RESUMED, "host": "h2"},
          {"ts": 50, "event": Event.RUN_COMPLETED}]
    tl = timeline.build(ev, now=60)
    plain = timeline.account(tl)
    assert (plain["wall_s"], plain["away_s"]) == (30, 10)
    carried = timeline.account(tl, span=(0, 60))
    assert carried["wall_s"] == 60 and carried["away_s"] == 0
    assert carried["by_cause_s"][timeline.BETWEEN_RUNTIMES] == 30  # 0-10, 30-40, 50-60
    assert [s.host for s in tl.sessions] == ["h1", "h2"]


# ---------------------------------------------------------------------------- the loop
class ScriptedCLI:
    """The verbs of ColabCLI, answered from a script: ``news`` (replies of ``new`` in order;
    READY when it runs out), ``probes`` (what each runtime's probes find, per runtime, in
    order; the last one repeats)."""

    def __init__(self, news=(), probes=None):
        self.news, self.probes = list(news), probes or {}
        self.calls: list = []
        self.given = 0

    def _r(self, verb, session, reply=None):
        self.calls.append((verb, session))
        assert len(self.calls) < 400, f"the loop does not end: {self.calls[-5:]}"
        return reply or Reply([verb], 0, "")

    def new(self, session, flags):
        reply = self.news.pop(0) if self.news else READY
        if replies.new_outcome(reply).__class__ is replies.Allocated:
            self.given += 1
        return self._r("new", session, reply)

    def status(self, session):
        return self._r("status", session, Reply([], 0, f"[colab] Session '{session}' not "
                                                       f"found.\n"))

    def drivemount(self, session):
        return self._r("drivemount", session, Reply([], 0, "Mounted at /content/drive\n"))

    def upload(self, session, local, there):
        return self._r("upload", session)

    def install(self, session, packages):
        return self._r("install", session)

    def download(self, session, there, local):
        return self._r("download", session, Reply([], 1, "[colab] Download failed: x"))

    def stop(self, session):
        return self._r("stop", session)

    def exec(self, session, code, timeout):
        if "def satisfied(req)" in code:
            return self._r("setup", session, _probe(host=f"h-{session}", drive=True,
                                                    missing=[], frameworks={"jax": "0.7.2"}))
        if "wrap = (" in code:
            return self._r("start", session, _probe(pid=42))
        if "def supervisor()" in code:
            script = self.probes.get(session) or [{"supervisor": "running"}]
            found = script.pop(0) if len(script) > 1 else script[0]
            if found == "lost":
                return self._r("probe", session, Reply([], 1, f"[colab] Session '{session}' "
                                                               f"appears to be lost (404/401)."))
            return self._r("probe", session, _probe(**found))
        return self._r("exec", session, _probe(ok=True))


def _loop(tmp_path, cli, **plan_keys):
    plan = Plan(job=str(tmp_path / "job.yaml"), name="digits", kind=runtime_kind(gpu="T4"),
                run_dir="/content/drive/MyDrive/runs/digits", local_dir=str(tmp_path / "local"),
                poll_s=30, lock_retry_s=30, **plan_keys)
    clock, out = FakeClock(), io.StringIO()
    loop = ColabLoop(plan, cli, clock=clock, out=out, bundles=("src.tgz", "job.tgz"))
    return loop, clock, out


DONE = {"supervisor": "exited", "rc": 0, "status": {"state": "completed", "step": 90}}


def test_a_lost_runtime_is_replaced_and_the_run_started_again_until_it_completes(tmp_path):
    cli = ScriptedCLI(probes={"orc-digits-1": [{"supervisor": "running",
                                                "status": {"step": 40}}, "lost"],
                              "orc-digits-2": [DONE]})
    loop, clock, out = _loop(tmp_path, cli)
    assert loop.run() == 0
    assert [c for c in cli.calls if c[0] in ("new", "start", "stop")] == [
        ("new", "orc-digits-1"), ("start", "orc-digits-1"), ("stop", "orc-digits-1"),
        ("new", "orc-digits-2"), ("start", "orc-digits-2"), ("stop", "orc-digits-2")]
    runtimes = hosts.hosts(loop.journal.events())
    assert [(h.why, h.step, h.host) for h in runtimes] == [
        ("lost", 40, "h-orc-digits-1"), ("completed", 90, "h-orc-digits-2")]
    assert "runtime orc-digits-1 is lost" in out.getvalue()


def test_a_capacity_refusal_backs_off_says_so_and_asks_again_for_the_same_runtime(tmp_path):
    cli = ScriptedCLI(news=[CAPACITY, CAPACITY], probes={"orc-digits-1": [DONE]})
    loop, clock, out = _loop(tmp_path, cli, backoff=Backoff(initial_s=60, max_s=1800))
    assert loop.run() == 0
    assert [c[1] for c in cli.calls if c[0] == "new"] == ["orc-digits-1"] * 3
    assert clock.slept[:2] == [60, 120]
    refused = loop.journal.events(Event.RUNTIME_REFUSED)
    assert [(e["reason"], e["retry_in_s"]) for e in refused] == [("capacity", 60),
                                                                 ("capacity", 120)]
    assert "refused (capacity): colab_cli.client.ColabRequestError" in out.getvalue()
    assert "asking again in 60 s" in out.getvalue()


def test_an_expired_login_stops_the_loop_with_the_line_and_no_runtime(tmp_path):
    cli = ScriptedCLI(news=[OAUTH_NEEDED])
    loop, clock, out = _loop(tmp_path, cli)
    assert loop.run() == EXIT_LOGIN
    assert cli.given == 0 and clock.slept == []
    end = loop.journal.events(Event.OUTER_ENDED)[-1]
    assert end["how"] == "login_expired" and "`colab sessions`" in end["line"]
    assert "`colab sessions`" in out.getvalue()


def test_the_sessions_budget_ends_the_loop_when_every_runtime_is_lost(tmp_path):
    cli = ScriptedCLI(probes={f"orc-digits-{n}": ["lost"] for n in range(1, 5)})
    loop, clock, out = _loop(tmp_path, cli, budgets=Budgets(max_sessions=3))
    assert loop.run() == EXIT_BUDGET
    assert cli.given == 3
    assert "--max-sessions" in loop.journal.events(Event.OUTER_ENDED)[-1]["line"]


def test_the_hours_budget_ends_a_wait_for_capacity(tmp_path):
    cli = ScriptedCLI(news=[CAPACITY] * 50)
    loop, clock, out = _loop(tmp_path, cli, budgets=Budgets(max_hours=2.0),
                             backoff=Backoff(initial_s=60, max_s=1800))
    assert loop.run() == EXIT_BUDGET
    assert cli.given == 0 and 7200 <= sum(clock.slept) < 7200 + 1800


def test_a_start_refused_by_a_live_lock_waits_and_starts_again_on_the_same_runtime(tmp_path):
    locked = {"supervisor": "exited", "rc": 3, "log_tail": ["orchestrator: ... in use by "
                                                            "another supervisor"]}
    cli = ScriptedCLI(probes={"orc-digits-1": [locked, DONE]})
    loop, clock, out = _loop(tmp_path, cli)
    assert loop.run() == 0
    assert [c[0] for c in cli.calls].count("start") == 2 and cli.given == 1
    assert [e["retry_in_s"] for e in loop.journal.events(Event.REMOTE_RUN_LOCKED)] == [30]


def test_a_runtime_silent_past_the_grace_and_gone_from_the_cli_is_replaced(tmp_path):
    cli = ScriptedCLI(probes={"orc-digits-2": [DONE]})
    real_exec = cli.exec

    def exec_(session, code, timeout):
        if session == "orc-digits-1" and "def supervisor()" in code:
            return cli._r("probe", session, Reply([], -1, "", "", timed_out=True))
        return real_exec(session, code, timeout)

    cli.exec = exec_
    loop, clock, out = _loop(tmp_path, cli, unreachable_s=120)
    assert loop.run() == 0
    probes = [c for c in cli.calls if c == ("probe", "orc-digits-1")]
    assert len(probes) == 5  # at 30, 60, 90, 120 and 150 s: the grace is 120 s from the first
    assert [h.why for h in hosts.hosts(loop.journal.events())] == ["lost", "completed"]


def test_the_outer_journal_is_copied_into_the_run_directory_each_time_a_run_starts(tmp_path):
    cli = ScriptedCLI(probes={"orc-digits-1": [DONE]})
    written = []
    real_exec = cli.exec

    def exec_(session, code, timeout):
        if 'P["text"]' in code:
            written.append(code)
        return real_exec(session, code, timeout)

    cli.exec = exec_
    loop, clock, out = _loop(tmp_path, cli)
    assert loop.run() == 0
    assert len(written) == 2  # before the run starts (its supervisor reads it), and at the end
    assert f"/content/drive/MyDrive/runs/digits/{hosts.FILE}" in written[-1]
    assert Event.OUTER_ENDED in written[-1]
    assert os.path.isfile(loop.journal.path) and Journal(loop.journal.path).events()


def test_the_cli_is_called_with_an_argument_list_its_auth_and_no_terminal_to_wait_on():
    seen = {}

    def runner(argv, **kw):
        seen.update(argv=argv, **kw)
        import subprocess
        return subprocess.CompletedProcess(argv, 0, "[colab] Session READY.\n", "")

    from orchestrator.colab.colabcli import ColabCLI
    reply = ColabCLI("/opt/colab", env={}, runner=runner, auth="adc").new("s1", ["--gpu", "T4"])
    assert seen["argv"] == ["/opt/colab", "--auth=adc", "new", "-s", "s1", "--gpu", "T4"]
    assert seen["start_new_session"] and seen["input"] == ""  # no tty, stdin closed
    assert seen["env"]["_TYPER_STANDARD_TRACEBACK"] == "1"
    assert isinstance(replies.new_outcome(reply), replies.Allocated)


def test_an_executable_that_is_not_there_is_named_with_how_to_install_it(tmp_path):
    from orchestrator.colab.colabcli import ENV_CLI, executable

    with pytest.raises(FileNotFoundError, match=f"from {ENV_CLI}.*pip install google-colab-cli"):
        executable(env={ENV_CLI: str(tmp_path / "nope")})
    with pytest.raises(FileNotFoundError, match="from --colab-cli"):
        executable(str(tmp_path / "nope"), env={})


def _failed(kind):
    return {"supervisor": "exited", "rc": 1, "status": {
        "state": "failed", "step": 30, "last_error": f"attempt 3: {kind}",
        "failure": {"kind": kind, "reason": "the ladder is spent"}}}


def test_a_run_failed_of_a_broken_accelerator_gets_a_new_runtime_and_a_job_error_does_not(
        tmp_path):
    """accelerator_context survived a fresh process and a fresh TPU system on that runtime:
    the next remedy is another runtime (the run resumes from Drive). The job's own error would
    fail the same on any runtime."""
    cli = ScriptedCLI(probes={"orc-digits-1": [_failed("accelerator_context")],
                              "orc-digits-2": [DONE]})
    loop, clock, out = _loop(tmp_path, cli)
    assert loop.run() == 0
    assert [c for c in cli.calls if c[0] in ("new", "start", "stop")] == [
        ("new", "orc-digits-1"), ("start", "orc-digits-1"), ("stop", "orc-digits-1"),
        ("new", "orc-digits-2"), ("start", "orc-digits-2"), ("stop", "orc-digits-2")]
    assert [h.why for h in hosts.hosts(loop.journal.events())] == [
        "accelerator_broken", "completed"]
    assert "its accelerator stayed broken" in out.getvalue()

    cli = ScriptedCLI(probes={"orc-digits-1": [_failed("user_error")]})
    loop, clock, out = _loop(tmp_path / "b", cli)
    assert loop.run() == 1
    assert [c[1] for c in cli.calls if c[0] == "new"] == ["orc-digits-1"]

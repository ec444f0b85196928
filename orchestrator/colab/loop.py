"""The outer loop: get a runtime, set it up, start the run there, follow it, and when the
runtime is lost get another; at the end free it and bring the export home.

    while the budgets allow:
        ask for a runtime             refused: journal, say, back off, ask again
        mount Drive, send the source and the job, install what is missing (no framework)
        start `orchestrator run` detached, follow it by `colab exec` of a probe
            locked: the previous runtime's supervisor may still hold the run directory
                    (core/lock.py): start again after a while - never two trainers
            lost, unreachable for too long, supervisor gone: end this session, free it
            completed: bring the export home, flush Drive, free the runtime, done

Before a runtime that still answers is stopped, Drive's write-back cache is flushed from inside
it (checkpoint/settle.py: a copy read back through the mount may not be in the cloud yet), with
a bounded wait, and what is still not settled is journaled (``drive_flushed``) and said.

Every runtime is one session of the outer journal (core/hosts.py), kept in ``local_dir`` and
copied into the run directory on Drive whenever a runtime can write it. The decisions
(budgets, backoff, what a probe means) are policy.py's; the CLI's words are replies.py's.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import tarfile
from dataclasses import dataclass, field

from orchestrator.colab import bundle, remote, replies
from orchestrator.colab.colabcli import ColabCLI
from orchestrator.colab.kinds import RuntimeKind
from orchestrator.colab.policy import (BAD_JOB, COMPLETED, FAILED, LOCKED, LOST, RUNNING,
                                       STOPPED, SUPERVISOR_DIED, UNREACHABLE, Backoff, Budgets,
                                       OuterPolicy, Reachability, judge)
from orchestrator.core import hosts, logs
from orchestrator.core.clock import SYSTEM, Clock
from orchestrator.core.events import Event
from orchestrator.core.journal import Journal
from orchestrator.core.kinds import Kind

log = logging.getLogger(__name__)

# `orchestrator colab`'s exit statuses beyond run's (0 completed, 1 failed, 2 bad job)
EXIT_LOGIN = 5       # the CLI needs the user to sign in (or Drive their consent)
EXIT_BUDGET = 6      # a budget is spent; running the command again goes on
EXIT_INTERRUPTED = 130

SETUP_FAILED = "setup_failed"
ACCELERATOR_BROKEN = "accelerator_broken"  # the run failed of accelerator_context there


@dataclass
class Plan:
    """One run to carry through runtimes: what to run, on what, and the loop's limits."""

    job: str                       # the job file, on this machine
    name: str                      # the job's name (sessions and folders are named after it)
    kind: RuntimeKind
    run_dir: str                   # on Drive, as the runtime sees it (/content/drive/...)
    local_dir: str                 # on this machine: the outer journal, the export
    budgets: Budgets = field(default_factory=Budgets)
    backoff: Backoff = field(default_factory=Backoff)
    poll_s: float = 30.0           # between two probes of a training runtime
    lock_retry_s: float = 30.0     # between two starts refused by a live lock
    unreachable_s: float = 300.0   # no readable answer this long: the runtime counts as lost
    remote_env: dict = field(default_factory=dict)  # added to the run's environment there
    flush_timeout_s: float = 300.0  # the most a stop waits for Drive's cache to reach the cloud

    @property
    def session_prefix(self) -> str:
        return "orc-" + (re.sub(r"[^a-z0-9-]+", "-", self.name.lower()).strip("-") or "run")


class ColabLoop:
    def __init__(self, plan: Plan, cli: ColabCLI, clock: Clock = SYSTEM, out=None,
                 bundles: tuple[str, str] | None = None):
        """``bundles``: the source's and the job's tar files to send (made from this package
        and the job's folder when None)."""
        self.plan, self.cli, self.clock, self.bundles = plan, cli, clock, bundles
        self.out = out if out is not None else sys.stdout
        os.makedirs(plan.local_dir, exist_ok=True)
        self.journal = Journal(os.path.join(plan.local_dir, hosts.FILE))
        self.policy = OuterPolicy(budgets=plan.budgets, backoff=plan.backoff)
        self.session: str | None = None
        self.last: dict = {}           # the run's state at the last probe

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Until the run completes or a budget is spent; the orchestrator's log lines go to
        ``out`` meanwhile (core/logs.routed)."""
        with logs.routed(lambda line: print(line, file=self.out, flush=True)):
            return self._run()

    def _run(self) -> int:
        p = self.plan
        self.policy.started = self.clock.monotonic()
        n = len(hosts.hosts(self.journal.events()))  # an earlier driver's runtimes
        if self.bundles is None:
            self.bundles = (
                bundle.source_bundle(os.path.join(p.local_dir, "orchestrator-src.tar.gz")),
                bundle.job_bundle(os.path.dirname(os.path.abspath(p.job)),
                                  os.path.join(p.local_dir, "orchestrator-job.tar.gz")))
        try:
            while True:
                spent = self.policy.may_request(self.clock.monotonic())
                if spent:
                    return self._end("budget", f"stopping: {spent}; the run resumes from Drive "
                                     f"when this command is run again", EXIT_BUDGET)
                # a refused request's name is asked for again: runtime n is session -n
                self.session = session = f"{p.session_prefix}-{n + 1}"
                self.journal.append(Event.RUNTIME_REQUESTED, session=session, kind=str(p.kind),
                                    n=n + 1)
                log.info(f"asking for a runtime ({p.kind}): session {session}")
                asked = self.clock.monotonic()
                got = replies.new_outcome(self.cli.new(session, p.kind.flags))
                if isinstance(got, replies.LoginExpired):
                    return self._end("login_expired", got.line, EXIT_LOGIN)
                if isinstance(got, replies.Refused):
                    wait, stop = self.policy.refused(got.reason)
                    self.journal.append(Event.RUNTIME_REFUSED, session=session,
                                        reason=got.reason, line=got.line, retry_in_s=wait)
                    if stop:
                        return self._end("failed", f"stopping: {stop} (last: {got.line})", 1)
                    log.info(f"refused ({got.reason.replace('_', ' ')}): {got.line}; asking "
                             f"again in {wait:.0f} s")
                    self.clock.sleep(wait)
                    continue
                given = self.clock.monotonic()
                n += 1
                self.policy.allocated()
                self.journal.append(Event.RUNTIME_ALLOCATED, session=session,
                                    took_s=round(given - asked, 3))
                log.info(f"runtime {session} given in {given - asked:.0f} s")
                why, code = self._session(session)
                held = self.clock.monotonic() - given
                self.policy.ended(held)
                self.journal.append(Event.RUNTIME_ENDED, session=session, why=why,
                                    lasted_s=round(held, 3), step=self.last.get("step"))
                if why == COMPLETED:
                    return self._complete(session)
                if why in (FAILED, BAD_JOB, SUPERVISOR_DIED, STOPPED):
                    self._flush_drive(session)  # it answers: what it wrote must not be lost
                self.cli.stop(session)  # free it (a lost one: the CLI forgets it)
                if code is not None:
                    return code
        except KeyboardInterrupt:
            where = (f"; the runtime {self.session} may still be training: `colab stop -s "
                     f"{self.session}` frees it") if self.session else ""
            return self._end("interrupted", f"interrupted{where}", EXIT_INTERRUPTED)

    # ------------------------------------------------------------------ one runtime
    def _session(self, session: str) -> tuple[str, int | None]:
        """Set the runtime up and follow the run there: ``(why it ended, the exit status to
        stop the loop with, or None to get another runtime)``."""
        p = self.plan
        t0 = self.clock.monotonic()
        mounted = self.cli.drivemount(session)
        if replies.drive_needs_consent(mounted):
            return SETUP_FAILED, self._end(
                "login_expired", "Drive needs your consent once: run `colab new -s consent`, "
                "`colab drivemount -s consent` in a terminal and follow its link, then "
                "`colab stop -s consent`; then run this command again", EXIT_LOGIN)
        if replies.session_gone(mounted, session):
            return LOST, None
        for local, there in zip(self.bundles, (remote.SOURCE_BUNDLE, remote.JOB_BUNDLE)):
            sent = self.cli.upload(session, local, there.lstrip("/"))
            if sent.rc != 0:
                return self._setup_failed(session, f"`colab upload` of {local}: "
                                                   f"{replies.last_line(sent.text)}")
        found = self._exec(session, remote.setup(bundle.REQUIRES), 300)
        if found is None:
            return self._setup_failed(session, "the set-up code did not run to its end there")
        if not found.get("drive"):
            return self._setup_failed(session, f"Drive is not mounted at {remote.DRIVE} after "
                                               f"`colab drivemount` "
                                               f"({replies.last_line(mounted.text)})")
        before = found.get("frameworks") or {}
        if found.get("missing"):
            log.info(f"installing {', '.join(found['missing'])} there (nothing else)")
            done = self.cli.install(session, found["missing"])
            again = self._exec(session, remote.setup(bundle.REQUIRES), 300)
            if not replies.installed(done) or again is None or again.get("missing"):
                return self._setup_failed(session, f"`colab install` did not install "
                                                   f"{', '.join(found['missing'])}: "
                                                   f"{replies.last_line(done.text)}")
            if (again.get("frameworks") or {}) != before:
                log.info(f"WARNING: the image's frameworks changed during the install: "
                         f"{before} -> {again.get('frameworks')}")
        self.journal.append(Event.RUNTIME_READY, session=session, host=found.get("host"),
                            python=found.get("python"), frameworks=before,
                            setup_s=round(self.clock.monotonic() - t0, 3))
        log.info(f"{session} is ready (host {found.get('host')}, Python {found.get('python')}"
                 + (", " + ", ".join(f"{k} {v}" for k, v in before.items()) if before else "")
                 + f"); run directory {p.run_dir}")
        return self._train(session)

    def _train(self, session: str) -> tuple[str, int | None]:
        p = self.plan
        args = [os.path.basename(p.job), "--run-dir", p.run_dir]
        while True:
            # before the start: its supervisor reads the earlier runtimes' last steps there
            # (checkpoint/lost.py)
            self._publish(session)
            started = self._exec(session, remote.start(args, p.remote_env), 120)
            if started is None:
                return self._setup_failed(session, "could not start the run there")
            self.policy.errors_in_row = 0
            self.journal.append(Event.REMOTE_RUN_STARTED, session=session,
                                pid=started.get("pid"))
            log.info(f"`orchestrator run` started on {session} (pid {started.get('pid')})")
            state, found = self._follow(session)
            if state == LOCKED:
                tail = " ".join(found.get("log_tail") or [])
                self.journal.append(Event.REMOTE_RUN_LOCKED, session=session,
                                    line=tail[-300:], retry_in_s=p.lock_retry_s)
                log.info(f"the run directory is still another supervisor's (a lost runtime's "
                         f"lock goes stale once it is silent long enough); starting again "
                         f"in {p.lock_retry_s:.0f} s")
                self.clock.sleep(p.lock_retry_s)
                continue
            return self._finish_state(state, found)

    def _follow(self, session: str) -> tuple[str, dict]:
        reach = Reachability(self.plan.unreachable_s)
        shown = None
        while True:
            self.clock.sleep(self.plan.poll_s)
            state, found = judge(self.cli.exec(session, remote.probe(self.plan.run_dir),
                                               120), session)
            if state == UNREACHABLE:
                if not reach.silent(self.clock.monotonic()):
                    continue
                if replies.session_gone(self.cli.status(session), session):
                    return LOST, found
                return UNREACHABLE, found
            reach.answered()
            s = found.get("status") or {}
            if s.get("step") is not None:
                self.last = s
            if state != RUNNING:
                return state, found
            now = (s.get("epoch"), s.get("step"), s.get("attempt"))
            if now != shown and s.get("epochs"):
                shown = now
                log.info(f"{session}: epoch {s.get('epoch')}/{s.get('epochs')}, step "
                         f"{s.get('step')}, attempt {s.get('attempt')}")

    def _finish_state(self, state: str, found: dict) -> tuple[str, int | None]:
        s = found.get("status") or {}
        if state == COMPLETED:
            return COMPLETED, None
        if state == FAILED and (s.get("failure") or {}).get("kind") == Kind.ACCELERATOR_CONTEXT:
            # the runtime's accelerator stayed broken through a fresh process and a fresh TPU
            # system there: another runtime is the next remedy (the run resumes from Drive)
            log.info(f"runtime {self.session}: its accelerator stayed broken "
                     f"({s.get('last_error') or 'accelerator_context'}); asking for another")
            return ACCELERATOR_BROKEN, None
        if state == FAILED:
            why = s.get("last_error") or f"see `orchestrator status {self.plan.run_dir}`"
            return FAILED, self._end("failed", f"the run failed: {why}", 1)
        if state == BAD_JOB:
            tail = " | ".join(found.get("log_tail") or [])
            return BAD_JOB, self._end("failed", f"`orchestrator run` refused the job: {tail}", 2)
        if state == LOST:
            log.info(f"runtime {self.session} is lost (the CLI no longer has it); the run "
                     f"stood at step {self.last.get('step')}; asking for another")
        else:
            log.info(f"runtime {self.session}: {state.replace('_', ' ')}; asking for another")
        return state, None

    # ------------------------------------------------------------------ helpers
    def _exec(self, session: str, code: str, timeout: float) -> dict | None:
        return replies.marked(self.cli.exec(session, code, timeout))

    def _setup_failed(self, session: str, detail: str,
                      why: str = SETUP_FAILED) -> tuple[str, int | None]:
        if replies.session_gone(self.cli.status(session), session):
            return LOST, None
        wait, stop = self.policy.refused(replies.ERROR)
        log.info(f"{session}: {detail}")
        if stop:
            return why, self._end("failed", f"stopping: {detail}", 1)
        self.clock.sleep(wait)
        return why, None

    def _publish(self, session: str) -> None:
        """Copy the outer journal into the run directory (best effort: the local one is the
        record; the copy lets `status` on any machine show the runtimes)."""
        with open(self.journal.path, encoding="utf-8") as f:
            text = f.read()
        self._exec(session, remote.write_file(f"{self.plan.run_dir}/{hosts.FILE}", text), 120)

    def _complete(self, session: str) -> int:
        p = self.plan
        self.journal.append(Event.OUTER_ENDED, how="completed",
                            line=f"completed in {self.policy.sessions} runtime(s)")
        self._publish(session)
        export = self._fetch_export(session)
        self._flush_drive(session)
        self.cli.stop(session)
        s = self.last
        log.info(f"completed: epoch {s.get('epoch')}/{s.get('epochs')} in "
                 f"{self.policy.sessions} runtime(s); runtime {session} stopped; "
                 + (f"export in {export}" if export else "no export to bring home")
                 + f"; the outer journal is {self.journal.path}")
        return 0

    def _flush_drive(self, session: str) -> dict | None:
        """Push Drive's write-back cache to the cloud from inside the runtime before it is
        stopped (bounded); journal and say what is still not settled."""
        t = self.plan.flush_timeout_s
        found = self._exec(session, remote.flush_drive(self.plan.run_dir, t), t + 120)
        if found is None:
            found = {"ok": False, "error": "the flush did not run to its end there",
                     "not_settled": ["checkpoint", "export", "journal"]}
        self.journal.append(Event.DRIVE_FLUSHED, session=session, **found)
        if found.get("ok"):
            log.info(f"Drive flushed on {session} in {found.get('seconds')} s: "
                     f"{', '.join(found.get('settled') or []) or 'nothing'} in the cloud")
        elif found.get("not_settled"):
            log.info(f"WARNING: Drive could not be flushed on {session} "
                     f"({found.get('error')}): {', '.join(found['not_settled'])} may not have "
                     f"reached the cloud; stopping the runtime loses what did not")
        return found

    def _fetch_export(self, session: str) -> str | None:
        packed = self._exec(session, remote.pack_export(self.plan.run_dir), 600)
        if not packed or packed.get("missing"):
            return None
        local = os.path.join(self.plan.local_dir, "export.tar.gz")
        got = self.cli.download(session, remote.EXPORT_BUNDLE.lstrip("/"), local)
        if got.rc != 0 or not os.path.isfile(local):
            log.info(f"could not download the export: {replies.last_line(got.text)}")
            return None
        with tarfile.open(local) as t:
            t.extractall(self.plan.local_dir,
                         **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        return os.path.join(self.plan.local_dir, "export")

    def _end(self, how: str, line: str, code: int) -> int:
        self.journal.append(Event.OUTER_ENDED, how=how, line=line)
        log.info(line)
        return code

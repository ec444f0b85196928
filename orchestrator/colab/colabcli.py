"""The one boundary to Google's Colab CLI: its executable, run with an argument list.

Every call is a process (``colab VERB -s SESSION ...``) with no standard input but what we
send, in a session of its own (no controlling terminal: a CLI that wants a person - a sign-in,
Drive's consent - fails at once instead of waiting on our terminal for hours), bounded in time.
What it printed and its exit status come back as a ``Reply``; ``replies.py`` reads them. The
CLI's credentials stay the CLI's: nothing here reads its files.

The executable is ``--colab-cli PATH``, else ``$ORCHESTRATOR_COLAB_CLI``, else ``colab`` on
the PATH; the tests give a simulator of the verbs (tests/fakes/colab_sim.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable

ENV_CLI = "ORCHESTRATOR_COLAB_CLI"
DEFAULT = "colab"


@dataclass
class Reply:
    """What one call of the CLI gave: its argument list, exit status and both outputs."""

    argv: list
    rc: int
    out: str = ""
    err: str = ""
    timed_out: bool = False

    @property
    def text(self) -> str:
        return self.out + ("\n" if self.out and self.err else "") + self.err


def executable(given: str | None = None, env: dict | None = None) -> str:
    """The CLI to run: ``given``, else the environment's ``ORCHESTRATOR_COLAB_CLI``, else
    ``colab`` from the PATH. FileNotFoundError saying how to install it when it is none."""
    env = os.environ if env is None else env
    path = given or env.get(ENV_CLI) or DEFAULT
    found = shutil.which(path)
    if found is None:
        where = ("--colab-cli" if given else ENV_CLI if env.get(ENV_CLI) else "the PATH")
        raise FileNotFoundError(
            f"the Colab CLI {path!r} (from {where}) is not an executable: install it with "
            f"`pip install google-colab-cli` (Python 3.12 or newer; executable `colab`), or "
            f"name it with --colab-cli PATH")
    return found


Runner = Callable[..., subprocess.CompletedProcess]


class ColabCLI:
    """The verbs we use, each one call of the executable. ``runner`` is ``subprocess.run``
    (a test gives its own: no process then)."""

    def __init__(self, path: str, env: dict | None = None, runner: Runner = subprocess.run,
                 auth: str | None = None):
        """``auth``: the CLI's global ``--auth`` (oauth2, its default, or adc), given to every
        call as the CLI wants it."""
        self.path, self.runner = path, runner
        self.globals = [f"--auth={auth}"] if auth else []
        # typer's plain tracebacks: the exception's line whole, not wrapped in a box
        self.env = dict(os.environ if env is None else env, _TYPER_STANDARD_TRACEBACK="1")

    def call(self, args: list, stdin: str | None = None, timeout: float = 120.0) -> Reply:
        argv = [self.path, *self.globals, *args]
        try:
            done = self.runner(argv, input=stdin if stdin is not None else "", text=True,
                               capture_output=True, timeout=timeout, env=self.env,
                               start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            return Reply(argv, -1, _text(exc.stdout), _text(exc.stderr), timed_out=True)
        except OSError as exc:
            return Reply(argv, -1, "", f"{self.path}: {exc}")
        return Reply(argv, done.returncode, done.stdout or "", done.stderr or "")

    def new(self, session: str, flags: list) -> Reply:
        return self.call(["new", "-s", session, *flags], timeout=600)

    def status(self, session: str) -> Reply:
        return self.call(["status", "-s", session], timeout=120)

    def exec(self, session: str, code: str, timeout: float) -> Reply:
        """Run Python ``code`` in the runtime's kernel. The CLI's ``--timeout`` bounds the
        kernel's silence; ours bounds the whole call, a little later."""
        return self.call(["exec", "-s", session, "--timeout", f"{timeout:g}"], stdin=code,
                         timeout=timeout + 60)

    def drivemount(self, session: str) -> Reply:
        return self.call(["drivemount", "-s", session], timeout=600)

    def install(self, session: str, packages: list) -> Reply:
        return self.call(["install", "-s", session, *packages], timeout=1200)

    def upload(self, session: str, local: str, remote: str) -> Reply:
        return self.call(["upload", "-s", session, local, remote], timeout=900)

    def download(self, session: str, remote: str, local: str) -> Reply:
        return self.call(["download", "-s", session, remote, local], timeout=1800)

    def stop(self, session: str) -> Reply:
        return self.call(["stop", "-s", session], timeout=300)


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data

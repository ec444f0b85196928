"""The tests' hand on the Colab CLI's simulator (tests/fakes/colab_sim.py): run its verbs, set
its ``control.json``, and see Drive's cloud, a runtime's cache of it and that cache's sync
(Drive's write-back, tests/fakes/drive_writeback.py). Test-side only: the product never reads
the simulator's state.
"""
import json
import os
import subprocess
import sys
import time

from helpers import ROOT

SIM = os.path.join(ROOT, "tests", "fakes", "colab_sim.py")


def namespaces_work() -> bool:
    """The simulator's runtimes are mount and UTS namespaces (``unshare``): root is needed."""
    try:
        return subprocess.run(["unshare", "--mount", "--uts", "true"],
                              capture_output=True).returncode == 0
    except OSError:
        return False


def env(home, **more) -> dict:
    return dict(os.environ, COLAB_SIM_HOME=str(home), COLAB_SIM_PYTHON=sys.executable, **more)


def sim(home, *args, stdin: str | None = None, timeout: float = 120):
    """One call of the simulator (``new``, ``drivemount``, ``exec``, ``_recycle`` ...)."""
    return subprocess.run([SIM, *args], env=env(home), input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def control(home, **keys) -> None:
    """Merge ``keys`` into ``control.json`` (``refuse``, ``login_expired``, ``drive_consent``,
    ``writeback``)."""
    path = home / "control.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(dict(data, **keys)))


def writeback(home, quiet_s: float, bytes_per_s: float) -> None:
    """Drive's write-back cache for the runtimes mounted from now on: a file reaches the cloud
    once left alone ``quiet_s``, at ``bytes_per_s``; ``control(home, writeback=None)``: off."""
    control(home, writeback={"quiet_s": quiet_s, "bytes_per_s": bytes_per_s})


def cloud(home):
    """Drive as the cloud holds it (what a runtime mounting now starts from)."""
    return home / "drive"


def cache(home, runtime: str):
    """Runtime's cache of Drive: what its /content/drive shows, gone with the runtime."""
    return home / "caches" / runtime


def sync_state(home, runtime: str) -> dict | None:
    """The runtime's sync: ``alive``, ``lost`` (recycled), ``pending`` (``path`` relative to
    Drive's root, ``bytes``, ``quiet_for_s``), ``uploading`` (``path``, ``done``, ``bytes``),
    ``uploads`` (how many so far), ``flushed``; None before any write-back mount."""
    try:
        return json.loads((home / "drive_sync" / f"{runtime}.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def settled(home, runtime: str) -> bool:
    """Everything the runtime wrote to Drive is in the cloud."""
    s = sync_state(home, runtime)
    return bool(s) and not s["pending"] and s["uploading"] is None


def wait_for(cond, what: str, cap: float = 60.0, every: float = 0.05):
    """Poll ``cond`` until it gives something true (returned); an AssertionError after ``cap``
    seconds (the simulator's sync has no bound of its own to wait on)."""
    deadline = time.time() + cap
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"no {what} after {cap:g} s")


def new_runtime(home, name: str) -> None:
    """A runtime with Drive mounted (``colab new`` and ``colab drivemount``)."""
    for verb in (("new", "-s", name), ("drivemount", "-s", name)):
        done = sim(home, *verb)
        assert done.returncode == 0, done.stdout + done.stderr


def run_in(home, runtime: str, code: str, timeout: float = 120) -> str:
    """Run Python ``code`` in the runtime (``colab exec``); its stdout, stderr appended."""
    done = sim(home, "exec", "-s", runtime, "--timeout", str(timeout), stdin=code,
               timeout=timeout + 30)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr

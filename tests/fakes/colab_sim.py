#!/usr/bin/env python3
"""A simulator of Google's Colab CLI (``colab``) over local "runtimes", for the tests of
``orchestrator colab``: the verbs it uses, with the CLI's own output lines and exit statuses
(read from google-colab-cli's source, ``colab_cli/commands/*.py``; see
orchestrator/colab/replies.py for the list).

State lives in ``$COLAB_SIM_HOME``:

- ``drive/`` is Google Drive's cloud (``drive/MyDrive``): shared by every runtime, unless
  ``control.json`` sets ``writeback`` (below);
- ``runtimes/NAME/`` is runtime NAME's disk: what its processes see as ``/content``. Code
  run there (``exec``) runs in a mount namespace and a UTS namespace of its own (``unshare``;
  root is needed): that folder bind-mounted at ``/content``, Drive at ``/content/drive`` once
  ``drivemount`` ran, and the host name NAME. ``TMPDIR`` is on that disk too.
- ``backend.json`` holds the runtimes Colab's backend still has; ``sessions.json`` the CLI's
  local state (the CLI drops a session from it when the backend no longer lists it, as
  ``sync_sessions`` does);
- ``control.json`` is the test's hand: ``refuse`` (a list of ``capacity``, ``usage_limit``,
  ``too_many``, popped one per ``new``), ``login_expired`` (true: every verb that signs in
  fails as the real one does without a token), ``drive_consent`` (true: ``drivemount`` wants
  a person), ``writeback`` (``{"quiet_s": Q, "bytes_per_s": B}``, read at ``drivemount``:
  Drive's write-back cache, drive_writeback.py; absent or null: Drive shared directly);
- ``caches/NAME/``, with write-back: runtime NAME's cache of Drive, its ``/content/drive``,
  uploaded by its sync process; ``drive_sync/NAME.json`` that sync's state (the tests' eye);
- ``calls.jsonl``: one line per call (verb, session, exit status), for the test to read.

``colab_sim.py _recycle NAME`` is what Colab does to a runtime at its time limit: every
process of the runtime is SIGKILLed (found by a token in its environment that only this
runtime's processes inherit, its Drive sync among them) and its disk deleted, with its cache
of Drive; the backend forgets it, the CLI's local state still names it.

In a runtime's Python, ``google.colab.drive`` is importable (fakes/colab_runtime, put on its
``PYTHONPATH``): ``mount`` and ``flush_and_unmount`` as Colab's, through ``_drive``.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import drive_writeback as wb

HOME = os.environ.get("COLAB_SIM_HOME", "")
PYTHON = os.environ.get("COLAB_SIM_PYTHON", sys.executable)
TOKEN_ENV = "COLAB_SIM_RUNTIME"
# what a runtime's processes get of our environment: a runtime is another machine
KEEP_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
            "OMP_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL")
FAKES = os.path.dirname(os.path.abspath(__file__))
RUNTIME_PYTHONPATH = os.path.join(FAKES, "colab_runtime")  # google.colab.drive, in runtimes only
GPUS = {"a100": "A100", "h100": "H100", "l4": "L4", "t4": "T4", "g4": "G4"}


def path(*parts: str) -> str:
    return os.path.join(HOME, *parts)


class Locked:
    """The simulator's state is read and written under one lock (calls may overlap)."""

    def __enter__(self):
        self.f = open(path(".lock"), "w")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def load(name: str) -> dict:
    try:
        with open(path(name)) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def save(name: str, data: dict) -> None:
    tmp = path(f"{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path(name))


def out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def traceback(exc_line: str) -> None:
    """A plain Python traceback as the CLI ends with (typer's standard traceback)."""
    err("Traceback (most recent call last):\n  File \"/usr/lib/python3/colab_cli/cli.py\", "
        "line 1, in main\n" + exc_line)


def option(args: list, *names: str, default=None):
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args):
            return args[i + 1]
        for n in names:
            if n.startswith("--") and a.startswith(n + "="):
                return a.split("=", 1)[1]
    return default


def positionals(args: list) -> list:
    out_, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-s", "--session", "--tpu", "--gpu", "--timeout", "-f", "--file", "-r",
                   "--requirement", "--env"):
            skip = True
        elif not a.startswith("-"):
            out_.append(a)
    return out_


def login_needed() -> int:
    """What the CLI does with no token and no terminal (seen with the released 0.7.5)."""
    sys.stdout.write("Enter the authorization code: ")
    sys.stdout.flush()
    err("\nTo authorize colab-cli, visit this URL in any browser:\n\n  "
        "https://accounts.google.com/o/oauth2/auth?response_type=code&client_id=sim\n\n"
        "After approving, Google will display an authorization code.\n\nAborted.")
    return 1


# ---------------------------------------------------------------------------- the runtimes
def runtime_dir(name: str) -> str:
    return path("runtimes", name)


def runtime_procs(token: str) -> list[int]:
    """The processes of a runtime: those whose environment holds its token (every process
    the runtime's code starts inherits it)."""
    mine, needle = [], f"{TOKEN_ENV}={token}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    mine.append(int(pid))
        except OSError:
            continue
    return mine


def destroy(name: str, meta: dict) -> int:
    """SIGKILL every process of the runtime until none is left, then delete its disk."""
    killed = 0
    for _ in range(100):
        pids = runtime_procs(meta["token"])
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    shutil.rmtree(runtime_dir(name), ignore_errors=True)
    wb.mark_lost(HOME, name)
    return killed


def resolve(name: str, meta: dict, remote: str) -> str:
    """A path of the CLI's file verbs (relative to the Jupyter root, ``/``) on this machine."""
    rel = remote.lstrip("/")
    if not (rel == "content" or rel.startswith("content/")):
        raise FileNotFoundError(f"File or directory not found: {remote}")
    rest = rel[len("content"):].lstrip("/")
    if meta.get("mounted") and (rest == "drive" or rest.startswith("drive/")):
        return os.path.join(drive_source(name, meta), rest[len("drive"):].lstrip("/"))
    return os.path.join(runtime_dir(name), rest)


def live(name: str, verb_lost_line: bool = True):
    """``(meta, rc)``: the runtime's state, or the CLI's answer for a session it does not
    have (not in its local state) or that the backend lost."""
    with Locked():
        sessions, backend = load("sessions.json"), load("backend.json")
        if name not in sessions:
            out(f"[colab] Session '{name}' not found.")
            return None, 1
        if name not in backend:
            if verb_lost_line:
                out(f"[colab] Session '{name}' appears to be lost (404/401). Cleaning up.")
                del sessions[name]
                save("sessions.json", sessions)
            else:
                traceback("requests.exceptions.HTTPError: 404 Client Error: Not Found for url: "
                          f"https://sim/tun/m/{name}")
            return None, 1
        return backend[name], 0


# ---------------------------------------------------------------------------- the verbs
def cmd_new(args: list) -> int:
    name = option(args, "-s", "--session") or uuid.uuid4().hex[:6]
    tpu, gpu = option(args, "--tpu"), option(args, "--gpu")
    variant, accel = "DEFAULT", "NONE"
    if tpu:
        variant, accel = "TPU", "V5E1" if tpu.lower() == "v5e1" else "V6E1"
    elif gpu:
        variant, accel = "GPU", GPUS.get(gpu.lower(), "A100")
    out(f"[colab] Creating session '{name}'...")
    with Locked():
        control = load("control.json")
        if control.get("login_expired"):
            return login_needed()
        refusals = control.get("refuse") or []
        if refusals:
            why = refusals.pop(0)
            save("control.json", dict(control, refuse=refusals))
            if why == "usage_limit":
                err(f"[colab] Backend rejected accelerator '{accel}'. You may not have quota "
                    f"or entitlement for this accelerator on your account. Try a different one "
                    f"(e.g. --gpu T4) or omit --gpu/--tpu for a CPU runtime.")
            elif why == "too_many":
                traceback("colab_cli.client.TooManyAssignmentsError: Failed to issue request "
                          "POST https://colab.research.google.com/tun/m/assign?nbh=x: "
                          "Precondition Failed")
            else:
                traceback("colab_cli.client.ColabRequestError: Failed to issue request GET "
                          "https://colab.research.google.com/tun/m/assign?nbh=x: "
                          "Service Unavailable")
            return 1
        shutil.rmtree(runtime_dir(name), ignore_errors=True)
        os.makedirs(os.path.join(runtime_dir(name), ".tmp"))
        meta = {"token": uuid.uuid4().hex, "endpoint": f"sim-{accel.lower()}-{uuid.uuid4().hex[:8]}",
                "variant": variant, "accelerator": accel, "mounted": False}
        backend, sessions = load("backend.json"), load("sessions.json")
        backend[name] = meta
        sessions[name] = {"endpoint": meta["endpoint"]}
        save("backend.json", backend)
        save("sessions.json", sessions)
    out("[colab] Session READY.")
    return 0


def cmd_status(args: list) -> int:
    name = option(args, "-s", "--session")
    with Locked():
        if load("control.json").get("login_expired"):
            return login_needed()
        sessions, backend = load("sessions.json"), load("backend.json")
        stale = [n for n in sessions if n not in backend]
        for n in stale:
            del sessions[n]
        save("sessions.json", sessions)
    if stale:
        out(f"[colab] Pruned {len(stale)} stale local session(s).")
    names = [name] if name else list(sessions)
    if not names:
        out("[colab] No active sessions.")
    for n in names:
        if n not in sessions:
            out(f"[colab] Session '{n}' not found.")
            continue
        m = backend[n]
        hw = "CPU" if m["accelerator"] == "NONE" else m["accelerator"]
        out(f"[{n}] {m['endpoint']} | Hardware: {hw} | Variant: {m['variant']} | Status: IDLE")
    return 0


def run_in_runtime(name: str, meta: dict, code: str, timeout: float) -> int:
    """Run Python ``code`` as the runtime's kernel would: in its namespaces, from /content."""
    os.makedirs("/content", exist_ok=True)  # the mount point, empty, on this machine
    env = {k: v for k, v in os.environ.items() if k in KEEP_ENV}
    env.update({TOKEN_ENV: meta["token"], "TMPDIR": "/content/.tmp", "COLAB_SIM_HOME": HOME,
                "COLAB_SIM_PYTHON": PYTHON, "COLAB_SIM_SESSION": name,
                "COLAB_SIM_SCRIPT": os.path.abspath(__file__),
                "PYTHONPATH": RUNTIME_PYTHONPATH})
    p = subprocess.Popen(["unshare", "--mount", "--uts", "--propagation", "private", "--",
                          sys.executable, os.path.abspath(__file__), "_enter", name],
                         stdin=subprocess.PIPE, env=env, text=True)
    try:
        p.communicate(code, timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()  # we started it; its detached children are the runtime's, as in a kernel
        p.wait()
        traceback(f"TimeoutError: code execution timed out after {timeout:g} s")
        return 1
    return 0  # the CLI's exec exits 0 whatever the code did (its traceback went to stderr)


def cmd_enter(args: list) -> int:
    """Inside the runtime's fresh namespaces: mount its disk and Drive, name the host, run."""
    name = args[0]
    code = sys.stdin.read()
    meta = load("backend.json").get(name)
    if meta is None:
        return 1
    disk = runtime_dir(name)
    subprocess.run(["mount", "--bind", disk, "/content"], check=True)
    if meta.get("mounted"):
        os.makedirs("/content/drive", exist_ok=True)
        subprocess.run(["mount", "--bind", drive_source(name, meta), "/content/drive"],
                       check=True)
    socket.sethostname(name)
    os.chdir("/content")
    os.execve(PYTHON, [PYTHON, "-c", code], dict(os.environ))
    return 1


def cmd_exec(args: list) -> int:
    name = option(args, "-s", "--session")
    meta, rc = live(name)
    if meta is None:
        return rc
    file = option(args, "-f", "--file")
    if file:
        with open(file) as f:
            code = f.read()
    else:
        code = sys.stdin.read()
    if not code.strip():
        return 0
    return run_in_runtime(name, meta, code, float(option(args, "--timeout", default=30.0)))


def cmd_drivemount(args: list) -> int:
    name = option(args, "-s", "--session")
    where = (positionals(args) or ["/content/drive"])[0]
    meta, rc = live(name, verb_lost_line=False)
    if meta is None:
        return rc
    out(f"[colab] Mounting Google Drive to '{where}' on {name}...")
    with Locked():
        if load("control.json").get("drive_consent"):
            out("\n[colab] Intercepted Drive Auth Request. Connecting to "
                "https://colab.research.google.com...")
            out("\n[colab] REQUIRED: Google Drive Authorization needed.\nPlease visit:\n\n"
                "https://accounts.google.com/o/oauth2/auth?sim\n")
            sys.stdout.write("Press Enter after you have granted access... ")
            traceback("OSError: [Errno 6] No such device or address: '/dev/tty'")
            return 1
        try:
            mount_drive(name)
        except (ValueError, OSError) as exc:
            traceback(f"{type(exc).__name__}: {exc}")
            return 1
    out(f"Mounted at {where}")
    return 0


# ---------------------------------------------------------------------------- Drive
def drive_source(name: str, meta: dict) -> str:
    """What the runtime sees at /content/drive: its cache with write-back, else the cloud."""
    return wb.cache_dir(HOME, name) if meta.get("writeback") else path("drive")


def mount_drive(name: str) -> dict:
    """Mount Drive for runtime NAME (under the lock): with write-back (control.json), its
    cache made from the cloud and its sync process started, once per mount."""
    backend = load("backend.json")
    meta = backend[name]
    if meta.get("mounted"):
        return meta
    settings = wb.settings(load("control.json"), path("control.json"))
    os.makedirs(path("drive", "MyDrive"), exist_ok=True)
    meta.update(mounted=True, writeback=settings)
    if settings:
        wb.make_cache(HOME, name)
        start_sync(name, meta, settings)
    save("backend.json", backend)
    return meta


def start_sync(name: str, meta: dict, settings: dict) -> None:
    """The runtime's Drive sync: a process of the runtime (its token), started detached; back
    once it has taken stock of the cache (before that, a write could go unseen)."""
    env = {k: v for k, v in os.environ.items() if k in KEEP_ENV}
    env.update({TOKEN_ENV: meta["token"], "COLAB_SIM_HOME": HOME})
    with open(path("drive_sync", f"{name}.log"), "ab") as log:
        subprocess.Popen([sys.executable, os.path.abspath(__file__), "_sync", name,
                          repr(settings["quiet_s"]), repr(settings["bytes_per_s"])],
                         env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                         start_new_session=True)
    deadline = time.time() + 30
    while wb.read_state(HOME, name) is None:
        if time.time() > deadline:
            raise OSError(f"the Drive sync of {name} did not start (drive_sync/{name}.log)")
        time.sleep(0.05)


def cmd_sync(args: list) -> int:
    """Not a CLI verb: the runtime's Drive sync process (drive_writeback.Sync)."""
    name, quiet_s, bytes_per_s = args[0], float(args[1]), float(args[2])
    sync = wb.Sync(HOME, name, quiet_s, bytes_per_s)
    sync.write_state(time.monotonic())
    return sync.run()


def cmd_drive(args: list) -> int:
    """Not a CLI verb: google.colab.drive's side in the simulator, run from inside runtime
    NAME. ``mount NAME``: mount Drive (as ``drivemount``) and print what to bind at the
    mount point. ``flush NAME TIMEOUT_S``: upload everything pending (at the bandwidth, the
    sync's own way), stop the sync and unmount; exit 1 if that took longer than TIMEOUT_S."""
    what, name = args[0], args[1]
    with Locked():
        if name not in load("backend.json"):
            err(f"colab_sim: no runtime {name}")
            return 1
        if what == "mount":
            try:
                meta = mount_drive(name)
            except (ValueError, OSError) as exc:
                err(f"colab_sim: {exc}")
                return 1
            out(drive_source(name, meta))
            return 0
        meta = load("backend.json")[name]
    if meta.get("writeback") and meta.get("mounted"):
        rid = uuid.uuid4().hex
        request = wb.flush_request_path(HOME, name)
        with open(request + ".tmp", "w") as f:
            f.write(rid)
        os.replace(request + ".tmp", request)
        deadline = time.time() + float(args[2])
        while (wb.read_state(HOME, name) or {}).get("flushed") != rid:
            state = wb.read_state(HOME, name) or {}
            if time.time() > deadline or not state.get("alive"):
                if os.path.exists(request):  # called off: the sync goes on as before
                    os.remove(request)
                time.sleep(2 * wb.TICK_S)
                if (wb.read_state(HOME, name) or {}).get("flushed") == rid:
                    break
                err(f"colab_sim: the flush of {name} did not end in {args[2]} s: {state}")
                return 1
            time.sleep(0.05)
    with Locked():
        backend = load("backend.json")
        if name in backend:
            backend[name]["mounted"] = False
            save("backend.json", backend)
    return 0


def cmd_install(args: list) -> int:
    name = option(args, "-s", "--session")
    meta, rc = live(name, verb_lost_line=False)
    if meta is None:
        return rc
    packages = positionals(args)
    out(f"[colab] Installing packages on {name} (preferring uv)...")
    # no network here: a requirement the runtime's Python already satisfies "installs"; any
    # other fails as pip does, and the CLI still exits 0 (its error goes to stderr)
    code = ("import importlib.metadata as md, sys\n"
            f"missing = []\nfor req in {packages!r}:\n"
            "    name = req.split('>=')[0].split('==')[0]\n"
            "    try:\n        md.version(name)\n    except md.PackageNotFoundError:\n"
            "        missing.append(req)\n"
            "if missing:\n"
            "    sys.stderr.write('ERROR: Could not find a version that satisfies the "
            "requirement %s\\n' % missing[0])\n"
            "else:\n    print('Installation Complete (via pip)!')\n")
    run_in_runtime(name, meta, code, 300)
    return 0


def file_verb(args: list, copy) -> int:
    """``upload``/``download``: ``copy(meta, name, first, second)`` does the one copy and
    returns the CLI's line; an OSError is the CLI's ``failed`` line."""
    name = option(args, "-s", "--session")
    first, second = positionals(args)[:2]
    meta, rc = live(name, verb_lost_line=False)
    if meta is None:
        return rc
    try:
        out(copy(name, meta, first, second))
    except OSError as exc:
        out(f"[colab] {copy.__doc__} failed: {exc}")
        return 1
    return 0


def upload(name: str, meta: dict, local: str, remote: str) -> str:
    """Upload"""
    if not os.path.isfile(local):
        raise FileNotFoundError(f"Local file '{local}' not found.")
    dest = resolve(name, meta, remote)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copyfile(local, dest)
    return f"[colab] Uploaded '{local}' to '{remote}'"


def download(name: str, meta: dict, remote: str, local: str) -> str:
    """Download"""
    src = resolve(name, meta, remote)
    if os.path.isdir(src):
        raise IsADirectoryError(f"Cannot download a directory: {remote}")
    if not os.path.isfile(src):
        raise FileNotFoundError(f"File or directory not found: {remote}")
    shutil.copyfile(src, local)
    return f"[colab] Downloaded '{remote}' to '{local}'"


def cmd_upload(args: list) -> int:
    return file_verb(args, upload)


def cmd_download(args: list) -> int:
    return file_verb(args, download)


def cmd_stop(args: list) -> int:
    name = option(args, "-s", "--session")
    with Locked():
        sessions, backend = load("sessions.json"), load("backend.json")
        if name not in sessions:
            out(f"[colab] Session '{name}' not found.")
            return 0
        out(f"[colab] Stopping session '{name}'...")
        if name not in backend:  # unassign of an endpoint the backend no longer has
            traceback("colab_cli.client.ColabRequestError: Failed to issue request GET "
                      f"https://colab.research.google.com/tun/m/unassign/"
                      f"{sessions[name]['endpoint']}: Not Found")
            return 1
        destroy(name, backend.pop(name))
        del sessions[name]
        save("backend.json", backend)
        save("sessions.json", sessions)
    out("[colab] Session terminated.")
    return 0


def cmd_recycle(args: list) -> int:
    """Not a CLI verb: what Colab does to a runtime at its limit (the tests' hand)."""
    name = args[0]
    with Locked():
        backend = load("backend.json")
        meta = backend.pop(name, None)
        save("backend.json", backend)
    if meta is None:
        out(f"no runtime {name}")
        return 1
    out(f"recycled {name}: killed {destroy(name, meta)} process(es)")
    return 0


VERBS = {"new": cmd_new, "status": cmd_status, "exec": cmd_exec, "drivemount": cmd_drivemount,
         "install": cmd_install, "upload": cmd_upload, "download": cmd_download,
         "stop": cmd_stop, "_recycle": cmd_recycle, "_enter": cmd_enter, "_sync": cmd_sync,
         "_drive": cmd_drive}


def main(argv: list) -> int:
    if not HOME:
        err("colab_sim: set COLAB_SIM_HOME to the simulator's state folder")
        return 2
    os.makedirs(path("drive", "MyDrive"), exist_ok=True)
    os.makedirs(path("runtimes"), exist_ok=True)
    args = [a for a in argv if a not in ("--logtostderr",)]
    if not args or args[0] not in VERBS:
        err(f"Usage: colab [OPTIONS] COMMAND [ARGS]...\nError: No such command "
            f"'{args[0] if args else ''}'.")
        return 2
    verb, rest = args[0], args[1:]
    rc = VERBS[verb](rest)
    if verb not in ("_enter", "_sync", "_drive"):
        with open(path("calls.jsonl"), "a") as f:
            f.write(json.dumps({"ts": round(time.time(), 3), "verb": verb,
                                "session": option(rest, "-s", "--session")
                                or (rest[0] if verb == "_recycle" and rest else None),
                                "rc": rc}) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The Python the outer loop runs in a runtime's kernel (``colab exec``), as text.

Each snippet reads its parameters from one JSON literal, uses the standard library only (the
runtime's own Python, before anything is installed), and ends by printing one marker line
(``replies.MARK`` + JSON) with what it found: ``colab exec`` exits 0 even when the code raised,
so a missing marker is how a failure shows. Nothing here imports TensorFlow or JAX: a probe
that took the TPU would keep the worker from it.
"""
from __future__ import annotations

import json

from orchestrator.colab.replies import MARK

# Where things go in a runtime: its own disk (lost with it) and Drive (kept).
HOME = "/content/orchestrator-colab"
SOURCE_BUNDLE = "/content/orchestrator-src.tar.gz"   # ``colab upload`` puts them in /content
JOB_BUNDLE = "/content/orchestrator-job.tar.gz"
EXPORT_BUNDLE = "/content/orchestrator-export.tar.gz"
SRC = f"{HOME}/src"
JOB = f"{HOME}/job"
LOG = f"{HOME}/run.log"
PID_FILE = f"{HOME}/run.pid"
RC_FILE = f"{HOME}/run.rc"
DRIVE = "/content/drive"

# The frameworks of the image: never installed over (checked before and after the install).
FRAMEWORKS = ("tensorflow", "tensorflow-tpu", "tensorflow-cpu", "jax", "jaxlib", "libtpu",
              "keras")

_PRELUDE = f"""import json, os, sys, time
P = json.loads({{params!r}})
def mark(**found):
    print({MARK!r} + json.dumps(found), flush=True)
"""


def _snippet(body: str, **params) -> str:
    return _PRELUDE.format(params=json.dumps(params)) + body


SETUP = """
import importlib.metadata as md, socket, tarfile
for bundle, dest in ((P["source"], P["src"]), (P["job_bundle"], P["job"])):
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(bundle) as t:
        t.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
def satisfied(req):
    name, _, low = req.partition(">=")
    have = version(name)
    if have is None:
        return False
    try:
        return tuple(int(x) for x in have.split(".")[:2]) >= tuple(int(x) for x in low.split(".")[:2])
    except ValueError:
        return True
mark(host=socket.gethostname(), python=sys.version.split()[0],
     drive=os.path.isdir(os.path.join(P["drive"], "MyDrive")),
     missing=[r for r in P["requires"] if not satisfied(r)],
     frameworks={n: version(n) for n in P["frameworks"] if version(n)})
"""


def setup(requires: list) -> str:
    """Unpack the orchestrator's source and the job's folder (uploaded as bundles), and say
    the host, whether Drive is mounted, which of our requirements are missing and which
    frameworks the image has (their versions, to prove afterwards that none was replaced)."""
    return _snippet(SETUP, source=SOURCE_BUNDLE, src=SRC, job_bundle=JOB_BUNDLE, job=JOB,
                    drive=DRIVE, requires=list(requires), frameworks=list(FRAMEWORKS))


START = """
import subprocess
for stale in (P["rc_file"], P["pid_file"]):
    if os.path.exists(stale):
        os.remove(stale)
# a small parent that outlives the kernel's call and writes the supervisor's exit status
wrap = ("import os, subprocess, sys\\n"
        "rc = subprocess.call(sys.argv[2:])\\n"
        "open(sys.argv[1] + '.tmp', 'w').write(str(rc))\\n"
        "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\\n")
env = dict(os.environ, PYTHONPATH=os.pathsep.join([P["src"], os.environ.get("PYTHONPATH", "")]))
env.update(P["env"])
with open(P["log"], "ab") as log:
    p = subprocess.Popen([sys.executable, "-c", wrap, P["rc_file"], sys.executable, "-m",
                          "orchestrator", "run", *P["args"]], cwd=P["job"], env=env,
                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
with open("/proc/%d/stat" % p.pid) as f:
    started = f.read().rsplit(")", 1)[1].split()[19]
with open(P["pid_file"], "w") as f:
    json.dump({"pid": p.pid, "start_ticks": started}, f)
mark(pid=p.pid)
"""


def start(args: list, env: dict | None = None) -> str:
    """Start ``orchestrator run ARGS`` detached (a session of its own, so that it outlives the
    kernel's call), under a parent that writes its exit status to ``RC_FILE``; record the
    parent's pid with its start time (a pid alone may be reused)."""
    return _snippet(START, src=SRC, job=JOB, log=LOG, pid_file=PID_FILE, rc_file=RC_FILE,
                    args=list(args), env=dict(env or {}))


PROBE = """
import subprocess
def supervisor():
    if os.path.exists(P["rc_file"]):
        with open(P["rc_file"]) as f:
            return {"supervisor": "exited", "rc": int(f.read().strip() or -1)}
    try:
        with open(P["pid_file"]) as f:
            rec = json.load(f)
        with open("/proc/%d/stat" % rec["pid"]) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, KeyError):
        return {"supervisor": "gone"}
    if fields[19] != rec["start_ticks"] or fields[0] in ("Z", "X"):
        return {"supervisor": "gone"}
    return {"supervisor": "running"}
found = supervisor()
env = dict(os.environ, PYTHONPATH=os.pathsep.join([P["src"], os.environ.get("PYTHONPATH", "")]))
try:
    done = subprocess.run([sys.executable, "-m", "orchestrator", "status", P["run_dir"], "--json"],
                          capture_output=True, text=True, timeout=P["timeout"], env=env)
    s = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-400:]}
except (subprocess.TimeoutExpired, ValueError) as exc:
    s = {"error": str(exc)[-400:]}
found["status"] = {k: s.get(k) for k in P["keys"] if k in s}
if "error" in s:
    found["status_error"] = s["error"]
try:
    with open(P["log"], "rb") as f:
        f.seek(max(0, os.path.getsize(P["log"]) - 600))
        found["log_tail"] = f.read().decode(errors="replace").splitlines()[-3:]
except OSError:
    pass
mark(**found)
"""

STATUS_KEYS = ("state", "epoch", "epochs", "step", "attempt", "restarts", "goodput",
               "last_error", "failure", "weights_sha256")


def probe(run_dir: str, timeout: float = 60.0) -> str:
    """Is the supervisor started there still running (its pid, the same process), did it exit
    (its status) or is it gone; and where the run stands (``orchestrator status --json``)."""
    return _snippet(PROBE, src=SRC, log=LOG, pid_file=PID_FILE, rc_file=RC_FILE,
                    run_dir=run_dir, timeout=timeout, keys=list(STATUS_KEYS))


WRITE = """
os.makedirs(os.path.dirname(P["path"]), exist_ok=True)
with open(P["path"] + ".tmp", "w") as f:
    f.write(P["text"])
os.replace(P["path"] + ".tmp", P["path"])
mark(written=len(P["text"]))
"""


def write_file(path: str, text: str) -> str:
    """Write ``text`` to ``path`` there (the outer journal into the run directory on Drive)."""
    return _snippet(WRITE, path=path, text=text)


PACK = """
import tarfile
src = P["export"]
if not os.path.isdir(src):
    mark(missing=True)
else:
    with tarfile.open(P["bundle"], "w:gz") as t:
        t.add(src, arcname="export")
    mark(bytes=os.path.getsize(P["bundle"]))
"""


def pack_export(run_dir: str) -> str:
    """Put the run's export folder in one file (``colab download`` takes files only)."""
    return _snippet(PACK, export=f"{run_dir}/export", bundle=EXPORT_BUNDLE)


FLUSH = """
import threading
def newest_checkpoint(root):
    try:
        names = sorted(n for n in os.listdir(root) if n.isdigit() and len(n) == 10)
    except OSError:
        return None
    return os.path.join(root, names[-1]) if names else None
def facts(p):
    # (bytes, the newest write) of a file or a folder's files
    size, last = 0, 0.0
    walk = os.walk(p) if os.path.isdir(p) else [(os.path.dirname(p), [], [os.path.basename(p)])]
    for d, _, files in walk:
        for n in files:
            try:
                st = os.stat(os.path.join(d, n))
            except OSError:
                continue
            size, last = size + st.st_size, max(last, st.st_mtime)
    return size, last
targets = {"checkpoint": newest_checkpoint(P["checkpoints"]), "export": P["export"],
           "journal": P["journal"] if os.path.exists(P["journal"]) else P["journal_live"]}
targets = {k: v for k, v in targets.items() if v and os.path.exists(v)}
before = {k: facts(v) for k, v in targets.items()}
done = {}
def flush():
    try:
        from google.colab import drive
        drive.flush_and_unmount()
        done["ok"] = True
    except BaseException as exc:
        done["error"] = "%s: %s" % (type(exc).__name__, exc)
t0 = time.time()
worker = threading.Thread(target=flush, daemon=True)
worker.start()
worker.join(P["timeout"])
seconds = round(time.time() - t0, 3)
if done.get("ok"):
    mark(ok=True, seconds=seconds, settled=sorted(targets), not_settled=[], how="flush",
         bytes=sum(b for b, _ in before.values()))
else:
    # no flush: settled only where the estimate says so (margin x (quiet + bytes / rate))
    now, settled, not_settled = time.time(), [], []
    for k, (size, last) in sorted(before.items()):
        wait = P["margin"] * (P["quiet_s"] + size / P["bytes_per_s"])
        (settled if now - last >= wait else not_settled).append(k)
    mark(ok=False, seconds=seconds, settled=settled, not_settled=not_settled, how="estimate",
         error=done.get("error") or "no answer in %s s" % P["timeout"])
"""


def flush_drive(run_dir: str, timeout: float = 300.0, quiet_s: float = 15.0,
                bytes_per_s: float = 10e6, margin: float = 2.0) -> str:
    """Before a runtime is stopped: push Drive's write-back cache to the cloud
    (``google.colab.drive.flush_and_unmount``, bounded by ``timeout``) and say which of the
    run's final checkpoint, export and journal are settled (checkpoint/settle.py); without a
    flush, those the estimate from their size and last write allows."""
    return _snippet(FLUSH, checkpoints=f"{run_dir}/checkpoints", export=f"{run_dir}/export",
                    journal=f"{run_dir}/events", journal_live=f"{run_dir}/events.jsonl",
                    timeout=timeout, quiet_s=quiet_s, bytes_per_s=bytes_per_s, margin=margin)


def run_here(code: str) -> dict | None:
    """Run a snippet in this process (the notebook's kernel on Colab: the same code the outer
    loop runs there); what it marked, or None when it marked nothing."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<orchestrator.colab.remote>", "exec"), {})  # noqa: S102 - our code
    for line in reversed(out.getvalue().splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return None

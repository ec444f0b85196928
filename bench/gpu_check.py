"""The JAX issue's GPU checks in one prepared run: ``python3 bench/gpu_check.py OUT_DIR``.

Made for a machine with one NVIDIA GPU and JAX with CUDA but no TensorFlow (the device machine
this project can borrow for minutes at a time), from the repository's root. It runs the real
supervisor and workers (``python -m orchestrator run ... --backend jax``) and reads what they
journal; nothing is faked. In order, each step bounded in time:

1. the runtime: ``nvidia-smi``, the JAX version and the devices JAX sees;
2. the digits job on the GPU, ``deterministic: true``, no standby: the uninterrupted reference
   (its cold start, and a second run's, which finds the compile cache);
3. the same job with its worker SIGKILLed 3 times in training: its weights against (2);
4. a longer digits run with the standby on: both processes' GPU memory (``nvidia-smi``'s
   per-process figure, the pid matched to the journal's worker and standby), then the worker
   SIGKILLed once the standby is ready: kill -> next first step against the cold start, and
   the weights against an uninterrupted run of the same job;
5. ResNet-20 (synthetic CIFAR-10 shapes) for 3 epochs with ``deterministic`` off and on: what
   XLA's deterministic GPU ops cost per epoch;
6. a real device OOM (a layer of 160 GB), and the kind the supervisor names it.

Everything lands in OUT_DIR/gpu_check.json (and each run's console in OUT_DIR/*.log).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# GPU_CHECK_DRY=1: the same steps on the CPU with a small ResNet and no OOM step, to check
# the script itself before it spends the GPU machine's minutes.
DRY = os.environ.get("GPU_CHECK_DRY") == "1"
STRATEGY = "cpu" if DRY else "gpu"
DIGITS = """
name: {name}
model: digits_job:build_model
data: digits_job:load_data
compile: {{optimizer: adam, loss: sparse_categorical_crossentropy, metrics: [accuracy]}}
epochs: {epochs}
batch_size: 32
strategy: {strategy}
seed: 7
deterministic: true
backend: jax
standby: {standby}
checkpoint: {{every_epochs: 1, every_steps: 10, keep: 2}}
restarts: {{max: 8, backoff: {{initial: 0.2, max: 1}}}}
heartbeat_interval: 0.05
"""
RESNET = """
name: resnet-{det}
model: {{factory: cifar10_resnet_job:build_model, args: {{depth: 20}}}}
data: {{factory: cifar10_resnet_job:load_data, args: {{synthetic: true, synthetic_examples: {n}}}}}
compile: {{optimizer: {{class_name: SGD, config: {{learning_rate: 0.1, momentum: 0.9}}}},
          loss: sparse_categorical_crossentropy, metrics: [accuracy]}}
epochs: 3
batch_size: 128
strategy: {strategy}
seed: 0
deterministic: {det}
backend: jax
standby: off
checkpoint: {{every_epochs: 1, keep: 2}}
"""
OOM = '''
def build_model():
    import keras
    return keras.Sequential([keras.Input((200_000,)), keras.layers.Dense(200_000),
                             keras.layers.Dense(10)])


def load_data():
    import numpy as np
    return np.zeros((64, 200_000), "float32"), np.zeros((64,), "int32")
'''
OOM_JOB = """
name: oom
model: oom_job:build_model
data: oom_job:load_data
compile: {optimizer: adam, loss: sparse_categorical_crossentropy}
epochs: 1
batch_size: 8
strategy: {strategy}
backend: jax
standby: off
restarts: {max: 1, backoff: {initial: 0.1, max: 0.1}}
"""


class Check:
    def __init__(self, out: str):
        self.out, self.results = out, {}
        self.work = tempfile.mkdtemp(prefix="gpu-check-")
        for f in ("jobs/digits/digits_job.py", "jobs/cifar10_resnet/cifar10_resnet_job.py"):
            shutil.copy(os.path.join(ROOT, f), self.work)
        with open(os.path.join(self.work, "oom_job.py"), "w") as f:
            f.write(OOM)

    def save(self) -> None:
        with open(os.path.join(self.out, "gpu_check.json"), "w") as f:
            json.dump(self.results, f, indent=1, default=str)

    def job(self, name: str, text: str) -> str:
        path = os.path.join(self.work, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(text)
        return path

    def start(self, job: str, run_dir: str, *args: str, log: str, env: dict | None = None):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1", **(env or {}))
        f = open(os.path.join(self.out, log), "w")
        return subprocess.Popen([sys.executable, "-m", "orchestrator", "run", job, "--run-dir",
                                 run_dir, *args], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT)

    def run(self, job: str, run_dir: str, *args: str, log: str, timeout: float = 240,
            env: dict | None = None):
        t0 = time.time()
        p = self.start(job, run_dir, *args, log=log, env=env)
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "timeout"
        return rc, round(time.time() - t0, 2), events(run_dir)


def events(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def first(evs, name, **match):
    return next((e for e in evs if e["event"] == name
                 and all(e.get(k) == v for k, v in match.items())), None)


def wait_event(run_dir, name, timeout=120, **match):
    deadline = time.time() + timeout
    while time.time() < deadline:
        e = first(events(run_dir), name, **match)
        if e:
            return e
        time.sleep(0.05)
    return None


def gpu_memory() -> dict[int, int]:
    """MiB of GPU memory per process, as nvidia-smi reports it."""
    if not shutil.which("nvidia-smi"):
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    mem = {}
    for line in out.strip().splitlines():
        pid, used = (x.strip() for x in line.split(","))
        if pid.isdigit():
            mem[int(pid)] = int(used) if used.isdigit() else used
    return mem


def summary(rc, wall, evs) -> dict:
    done = first(evs, "run_completed") or {}
    ready = [e for e in evs if e["event"] == "worker_ready"]
    steps = {e["attempt"]: e.get("since_start_s") for e in evs if e["event"] == "first_step"}
    return {"rc": rc, "wall_s": wall, "weights_sha256": done.get("weights_sha256"),
            "attempts": len([e for e in evs if e["event"] == "attempt_started"]),
            "ended": [(e.get("attempt"), e.get("kind"), e.get("exit_code")) for e in evs
                      if e["event"] == "attempt_ended"],
            "first_step_s": steps, "strategy": ready[0].get("strategy") if ready else None,
            "versions": ready[0].get("versions") if ready else None,
            "compile_cache": [r.get("compile_cache") for r in ready],
            "resumed_from_step": [r.get("resumed_from_step") for r in ready],
            "not_exact": [e.get("reasons") for e in evs if e["event"] == "resume_not_exact"]}


def main(out: str) -> int:
    os.makedirs(out, exist_ok=True)
    c = Check(out)
    r = c.results
    smi = subprocess.run(["nvidia-smi", "-L"] if shutil.which("nvidia-smi") else ["true"],
                         capture_output=True, text=True)
    probe = subprocess.run([sys.executable, "-c", "import jax, jaxlib; print(jax.__version__, "
                            "jaxlib.__version__, jax.devices())"], capture_output=True, text=True)
    r["runtime"] = {"nvidia_smi": smi.stdout.strip(), "jax": probe.stdout.strip() or probe.stderr[-800:]}
    c.save()
    print("runtime:", r["runtime"], flush=True)

    # 2. reference, twice (the second finds the local compile cache)
    job = c.job("digits", DIGITS.format(name="digits-gpu", epochs=5, standby="off", strategy=STRATEGY))
    r["reference"] = summary(*c.run(job, f"{c.work}/ref", log="ref.log"))
    cache = (r["reference"]["compile_cache"] or [{}])[0].get("dir")
    r["reference_again"] = summary(*c.run(job, f"{c.work}/ref2", log="ref2.log",
                                          env={"JAX_COMPILATION_CACHE_DIR": cache} if cache else None))
    c.save()
    print("reference:", r["reference"], "\nagain:", r["reference_again"], flush=True)

    # 3. three SIGKILLs in training
    r["killed_3x"] = summary(*c.run(job, f"{c.work}/kills", "--fault", "kill@step=23",
                                    "--fault", "kill@step=81", "--fault", "kill@step=150",
                                    log="kills.log"))
    r["killed_3x"]["bit_identical"] = (r["killed_3x"]["weights_sha256"]
                                       == r["reference"]["weights_sha256"] is not None)
    c.save()
    print("killed 3x:", r["killed_3x"], flush=True)

    # 4. the standby: memory, then a kill after it is ready
    sjob = c.job("standby", DIGITS.format(name="digits-standby", epochs=60 if not DRY else 25, standby="auto",
                                       strategy=STRATEGY))
    r["standby_reference"] = summary(*c.run(sjob, f"{c.work}/sref", log="sref.log"))
    run_dir = f"{c.work}/sb"
    p = c.start(sjob, run_dir, log="standby.log")
    info = {}
    started = wait_event(run_dir, "attempt_started", attempt=1)
    ready = wait_event(run_dir, "standby_ready", timeout=180)
    if started and ready:
        time.sleep(1.0)
        mem = gpu_memory()
        info["gpu_mib"] = {"worker": mem.get(started["pid"]), "standby": mem.get(ready["pid"]),
                           "all": mem}
        info["standby_phases_s"] = ready.get("phases_s")
        t_kill = time.time()
        os.kill(started["pid"], signal.SIGKILL)
        step = wait_event(run_dir, "first_step", attempt=2, timeout=120)
        info["kill_to_first_step_s"] = round(step["ts"] - t_kill, 3) if step else None
        a2 = wait_event(run_dir, "attempt_started", attempt=2, timeout=5)
        info["attempt_2_path"] = a2.get("path") if a2 else None
    else:
        info["error"] = f"attempt_started={bool(started)} standby_ready={bool(ready)}"
    try:
        rc = p.wait(240)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = "timeout"
    s = summary(rc, None, events(run_dir))
    cold = r["standby_reference"]["first_step_s"].get(1)
    info.update(run=s, cold_first_step_s=cold,
                ratio_to_cold=(round(info["kill_to_first_step_s"] / cold, 3)
                               if info.get("kill_to_first_step_s") and cold else None),
                bit_identical=s["weights_sha256"] == r["standby_reference"]["weights_sha256"])
    r["standby"] = info
    c.save()
    print("standby:", info, flush=True)

    # 5. ResNet-20: what the deterministic flags cost
    for det in ("false", "true"):
        rc, wall, evs = c.run(c.job(f"resnet{det}", RESNET.format(det=det, strategy=STRATEGY, n=512 if DRY else 8192)),
                              f"{c.work}/resnet-{det}", log=f"resnet-{det}.log")
        ends = [e["ts"] for e in evs if e["event"] == "epoch_completed"]
        s = summary(rc, wall, evs)
        s["epoch_s"] = [round(b - a, 3) for a, b in zip(ends, ends[1:])]
        r[f"resnet_deterministic_{det}"] = s
        c.save()
        print(f"resnet deterministic={det}:", s, flush=True)

    # 6. a real device OOM
    if DRY:
        return 0
    rc, wall, evs = c.run(c.job("oom", OOM_JOB.replace("{strategy}", STRATEGY)), f"{c.work}/oom", log="oom.log", timeout=180)
    s = summary(rc, wall, evs)
    ended = [e for e in evs if e["event"] == "attempt_ended"]
    s["attempt_ended"] = [{k: v for k, v in e.items() if k not in ("log_tail", "traceback")}
                          for e in ended]
    log = os.path.join(c.work, "oom", "attempts", "1.log")
    if os.path.exists(log):
        with open(log, errors="replace") as f:
            s["log_tail"] = f.read()[-1500:]
    r["oom"] = s
    c.save()
    print("oom:", s, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-check-out"))
